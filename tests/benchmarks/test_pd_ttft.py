"""benchmarks/pd_ttft.py without starting servers: the deployments' command lines and how stage
stamps from several processes are lined up with the client's sends. Reference: hand-computed
medians of a made-up log."""
from benchmarks.pd_ttft import Result, beyond_prefill, deployment_argv, median_stages, parse_args, table, trace_stages


def test_deployments_share_flags_and_differ_only_in_role():
    args = parse_args(["--server-args", "--load-format dummy --no-compile-ahead", "--model", "/m"])
    colloc = deployment_argv("collocated", args, 9000)
    read = deployment_argv("read", args, 9000)
    assert colloc[-2:] == ["--device", "cpu"] and "--role" not in colloc
    assert read[read.index("--role") + 1] == "disagg" and read[read.index("--kv-mode") + 1] == "read"
    for argv in (colloc, read):
        assert "--load-format" in argv and argv[argv.index("--model") + 1] == "/m"
    gpu = parse_args(["--gpu", "0", "--kv-transport", "ipc"])
    assert deployment_argv("collocated", gpu, 1)[-2:] == ["--device", "cuda:0"]
    write = deployment_argv("write", gpu, 1)
    assert write[-4:] == ["--prefill-gpus", "0", "--decode-gpus", "0"] and "ipc" in write
    assert "--log-level" not in write and "--log-level" in deployment_argv("write", parse_args(["--trace"]), 1)


def test_stamps_belong_to_the_last_request_sent_before_them():
    sends = [100.0, 200.0]
    log = "\n".join([
        "x DEBUG pdtrace prefill.core.first_token cmpl-a 99.5",  # a warm-up request: dropped
        "x DEBUG pdtrace router.parsed r1 100.001",
        "x DEBUG pdtrace prefill.core.first_token cmpl-b 100.050",
        "x DEBUG pdtrace prefill.core.first_token cmpl-b 100.090",  # a later pass: the first one counts
        "x DEBUG pdtrace router.parsed r2 200.003",
        "x DEBUG pdtrace prefill.core.first_token cmpl-c 200.070",
    ])
    per_request = trace_stages(log, sends)
    assert [round(r["prefill.core.first_token"], 3) for r in per_request] == [50.0, 70.0]
    stages = median_stages(per_request)
    assert list(stages) == ["router.parsed", "prefill.core.first_token"]
    assert abs(stages["router.parsed"] - 2.0) < 1e-6 and abs(stages["prefill.core.first_token"] - 60.0) < 1e-6


def test_overhead_is_ttft_less_the_prefill_compute():
    per_request = [{"prefill.core.scheduled": 2.0, "prefill.core.first_token": 52.0},
                   {"colloc.core.scheduled": 1.0, "colloc.core.first_token": 41.0}, {}]
    assert beyond_prefill([60.0, 45.0, 30.0], per_request) == [10.0, 5.0]


def test_table_shows_the_excess_over_collocated():
    out = table([Result("collocated", [10.0, 12.0, 14.0], {}, []), Result("read", [15.0, 17.0, 19.0], {"a": 1.0}, [])])
    assert "+5.0" in out.splitlines()[2] and "read stages" in out
    traced = table([Result("collocated", [10.0], {}, [3.0]), Result("write", [20.0], {}, [7.0])])
    assert traced.splitlines()[2].split()[-2:] == ["7.0", "+4.0"]
