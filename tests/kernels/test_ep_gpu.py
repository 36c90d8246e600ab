"""Expert-parallel dispatch/combine on 2 GPUs (NCCL, one process per GPU): naive, naive with
uniform tokens, a2a, a2a-fp8 and ipc. Reference: fused_experts_ref over each rank's tokens with
all experts (for fp8, on the tokens after the e4m3 round trip), bf16 tolerances. ipc and
naive-uniform are also captured in a CUDA graph (dispatch -> experts -> combine) and replayed
with new inputs several times in a row."""
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.kernels.ep import make_dispatcher
from tandem.kernels.ep.fp8 import dequantize_rows, quantize_rows
from tandem.kernels.ep.placement import local_experts
from tandem.kernels.moe import fused_experts, fused_experts_ref
from tests.ports import free_port_range

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORLD, E, K, H, I, MAX_TOKENS = 2, 16, 4, 1280, 128, 16  # H: two hidden chunks, the second partial
BF16 = dict(rtol=3e-2, atol=3e-2)
# (backend, make_dispatcher options, token counts per rank: uneven with an idle rank, or equal)
CASES = [("naive", {}, [5, 0]), ("naive", {}, [3, 12]), ("naive", {"uniform_tokens": True}, [6, 6]),
         ("a2a", {}, [5, 0]), ("a2a", {}, [3, 12]), ("a2a", {"fp8": True}, [0, 9]), ("a2a", {"fp8": True}, [7, 4]),
         ("ipc", {}, [5, 0]), ("ipc", {}, [3, 12]), ("ipc", {}, [MAX_TOKENS, 1]),
         ("ipc", {"uniform_tokens": True}, [7, 7])]
GRAPH_CASES = [("ipc", {}, [5, 0]), ("ipc", {}, [4, 11]), ("naive", {"uniform_tokens": True}, [6, 6]),
               ("ipc", {"uniform_tokens": True}, [3, 3])]
PLACEMENTS = ["linear", "round_robin"]


def _data(rank: int, counts: list[int], seed: int):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    t = counts[rank]
    x = torch.randn(t, H, generator=g)
    w = torch.rand(t, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).int() if t else torch.zeros(0, K).int()
    return x.cuda().bfloat16(), w.cuda(), ids.cuda()


def _weights():
    g = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.05, torch.randn(E, H, I, generator=g) * 0.1
    return w13.cuda().bfloat16(), w2.cuda().bfloat16()


def _dispatcher(backend, options, placement):
    return make_dispatcher(backend, dist.group.WORLD, E, placement, max_tokens_per_rank=MAX_TOKENS,
                           hidden_size=H, dtype=torch.bfloat16, **options)


def _reference(x, w, ids, options):
    w13, w2 = _weights()
    x = dequantize_rows(quantize_rows(x), x.dtype) if options.get("fp8") else x
    return fused_experts_ref(x, w13, w2, w, ids)


def _name(backend, options, counts, placement, graph=False):
    return "-".join([backend, *options, *map(str, counts), placement] + (["graph"] if graph else []))


def _eager(rank, backend, options, counts, placement) -> None:
    w13, w2 = _weights()
    mine = local_experts(E, WORLD, rank, placement)
    d = _dispatcher(backend, options, placement)
    for seed in range(2):  # twice: buffers are reused
        x, w, ids = _data(rank, counts, seed)
        xd, wd, idsd, handle = d.dispatch(x, w, ids)
        got = d.combine(fused_experts_ref(xd, w13[mine], w2[mine], wd, idsd), handle)
        torch.testing.assert_close(got, _reference(x, w, ids, options), **BF16,
                                   msg=lambda m, seed=seed: f"rank {rank} seed {seed}: {m}")
    getattr(d, "close", lambda: None)()


def _graph(rank, backend, options, counts, placement) -> None:
    w13, w2 = _weights()
    mine = local_experts(E, WORLD, rank, placement)
    w13, w2 = w13[mine].contiguous(), w2[mine].contiguous()
    d = _dispatcher(backend, options, placement)
    x_in, w_in, ids_in = _data(rank, counts, seed=0)

    def step():
        xd, wd, idsd, handle = d.dispatch(x_in, w_in, ids_in)
        return d.combine(fused_experts(xd, w13, w2, wd, idsd), handle)

    step()  # warm-up: Triton compiles, the expert maps reach the GPU
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(1, 5):
        x, w, ids = _data(rank, counts, seed)
        x_in.copy_(x), w_in.copy_(w), ids_in.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _reference(x, w, ids, options), **BF16,
                                   msg=lambda m, seed=seed: f"rank {rank} replay {seed}: {m}")
    del graph
    getattr(d, "close", lambda: None)()


def _worker(rank, port, out_dir):
    """Comparison failures are recorded per case so that both ranks stay in step (a rank that
    left a case early would leave its peer spinning in a barrier); anything else raises. The
    results are saved after every case, so a crash still reports the cases before it."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results: dict[str, str | None] = {}
    try:
        for graph, cases in ((False, CASES), (True, GRAPH_CASES)):
            for placement in PLACEMENTS:
                for backend, options, counts in cases:
                    name = _name(backend, options, counts, placement, graph)
                    print(f"rank {rank}: {name}", flush=True)
                    try:
                        (_graph if graph else _eager)(rank, backend, options, counts, placement)
                        torch.cuda.synchronize()
                        results[name] = None
                    except AssertionError as e:
                        results[name] = str(e)
                    torch.save(results, out_dir / f"{rank}.pt")
        d = _dispatcher("ipc", {}, "linear")
        try:
            d.dispatch(*_data(rank, [MAX_TOKENS + 1] * WORLD, seed=0))
            results["ipc-too-many-tokens"] = "no error"
        except ValueError as e:
            results["ipc-too-many-tokens"] = None if "max_tokens_per_rank" in str(e) else str(e)
        d.close()
        torch.save(results, out_dir / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(fn, args, nprocs: int, timeout_s: float) -> None:
    """mp.spawn with a deadline: a hung barrier kills the ranks instead of the test run."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            raise TimeoutError(f"EP ranks still running after {timeout_s:.0f} s (a barrier that never met?)")


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory) -> dict[str, list[str]]:
    """case -> its failures on either rank; a case missing from it did not run (see "crash")."""
    out_dir = tmp_path_factory.mktemp("ep_gpu")
    merged: dict[str, list[str]] = {}
    try:
        _spawn(_worker, (free_port_range(1), out_dir), WORLD, timeout_s=110)
    except Exception as e:  # reported by every case that did not finish
        merged["crash"] = [f"{type(e).__name__}: {str(e)[-3000:]}"]
    per_rank = [torch.load(out_dir / f"{r}.pt") if (out_dir / f"{r}.pt").exists() else {} for r in range(WORLD)]
    for case in set().union(*per_rank):
        if all(case in results for results in per_rank):  # finished on every rank
            merged[case] = [results[case] for results in per_rank if results[case]]
    return merged


def _check(results: dict[str, list[str]], case: str) -> None:
    assert case in results, f"{case} did not run: {results.get('crash')}"
    assert not results[case], "\n".join(results[case])


@pytest.mark.parametrize("case", [_name(b, o, c, p) for p in PLACEMENTS for b, o, c in CASES])
def test_dispatch_combine_matches_all_experts(gpu_results, case):
    _check(gpu_results, case)


@pytest.mark.parametrize("case", [_name(b, o, c, p, graph=True) for p in PLACEMENTS for b, o, c in GRAPH_CASES])
def test_cuda_graph_replays_match(gpu_results, case):
    _check(gpu_results, case)


def test_ipc_refuses_more_than_max_tokens(gpu_results):
    _check(gpu_results, "ipc-too-many-tokens")
