"""PD between two engine processes' KV caches: prefill in a child process, decode in this one, in
read and write mode, over ipc (GPU 0 -> GPU 1) and nixl (VRAM over UCX: both on GPU 0, and GPU 0 ->
GPU 1 when there are two); the same harness between CPU caches over tcp and nixl (DRAM) runs
without a GPU. The prefill gets the client's sampling parameters with max_tokens=1, as the router
sends them: it samples the first token and hands it to decode. Reference: a collocated engine's
greedy output on the decode device (same kernels, same shapes, so the same tokens)."""
import importlib.util
import multiprocessing as mp
import queue
import time
import uuid

import msgspec
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.config import DEFAULT_MODEL_DIR
from tandem.engine.protocol import EngineRequest

PROMPTS = [f"Question: Sam has {n} marbles and finds {2 * n + 1} more. How many does he have?\nAnswer:"
           for n in range(8)]
PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
KV = lambda role, transport: dict(kv_connector="TandemConnector", kv_role=role,  # noqa: E731
                                  kv_connector_extra_config={"transport": transport, "transfer_timeout_s": 60,
                                                             "hold_timeout_s": 60})
# The prefill's request: the client's (greedy) parameters, one token, as router/orchestrator.py builds it.
PREFILL_PARAMS = msgspec.structs.replace(PARAMS, max_tokens=1)
GPU = pytest.mark.gpu
TWO_GPUS = [GPU, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="the nixl extra is not installed")


def _prefill_main(inbox, outbox, async_scheduling, transport, device) -> None:
    if device == "cpu":
        torch.set_num_threads(1)  # as the decode side (see test_gpu_pd_matches_collocated)
    core = LLM(DEFAULT_MODEL_DIR, device=device, dtype="float32", num_gpu_blocks_override=512,
               async_scheduling=async_scheduling, **KV("kv_producer", transport)).engine
    outbox.put(("address", core.connector.address))
    while True:
        try:
            req = inbox.get(timeout=0.001)
            if req is None:
                break
            core.add_request(req)
        except queue.Empty:
            pass
        for o in core.step() if core.has_unfinished_requests() else []:
            outbox.put(("out", o))
    core.shutdown()


GPU_PAIRS = [("ipc", "cuda:0", "cuda:1", TWO_GPUS), ("nixl", "cuda:0", "cuda:0", [NIXL, GPU]),
             ("nixl", "cuda:0", "cuda:1", [NIXL] + TWO_GPUS)]
# CPU: the harness itself (kept from going stale where no GPU is), one case per mode and transport.
CPU_CASES = [("read", False, "tcp", [pytest.mark.slow]), ("write", True, "tcp", [pytest.mark.slow]),
             ("read", True, "nixl", [NIXL, pytest.mark.slow]), ("write", False, "nixl", [NIXL, pytest.mark.slow])]
CASES = [pytest.param(mode, a, t, src, dst, marks=marks, id=f"{mode}-{a}-{t}-{src}-{dst}")
         for t, src, dst, marks in GPU_PAIRS for mode in ("read", "write") for a in (True, False)] + [
    pytest.param(mode, a, t, "cpu", "cpu", marks=marks, id=f"{mode}-{a}-{t}-cpu-cpu") for mode, a, t, marks in CPU_CASES]


@pytest.fixture(scope="module")
def expected_tokens():
    """dst device -> (prompt ids, the collocated engine's greedy tokens there): the reference,
    computed once per device for every case that decodes on it."""
    cache = {}

    def get(dst: str) -> tuple[list[list[int]], list[list[int]]]:
        if dst not in cache:
            ref_llm = LLM(DEFAULT_MODEL_DIR, device=dst, dtype="float32", num_gpu_blocks_override=512)
            ids = [ref_llm.tokenizer.encode(p) for p in PROMPTS]
            cache[dst] = ids, [o.token_ids for o in ref_llm.generate(ids, PARAMS)]
            del ref_llm
        return cache[dst]
    return get


@pytest.fixture(autouse=True)
def _keep_num_threads():
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


@pytest.mark.parametrize("mode,async_scheduling,transport,src,dst", CASES)
def test_gpu_pd_matches_collocated(expected_tokens, mode, async_scheduling, transport, src, dst):
    if dst == "cpu":  # both engines step in busy loops: one torch thread each, or their threads oversubscribe
        torch.set_num_threads(1)  # the CPU cores and every step waits on a descheduled one (3-4x slower)
    ids, expected = expected_tokens(dst)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill_main, args=(inbox, outbox, async_scheduling, transport, src),
                       daemon=True)
    proc.start()
    decode = LLM(DEFAULT_MODEL_DIR, device=dst, dtype="float32", num_gpu_blocks_override=512,
                 async_scheduling=async_scheduling, **KV("kv_consumer", transport)).engine
    assert decode.async_scheduling == async_scheduling
    try:
        _, p_addr = outbox.get(timeout=300)
        p_host, p_port = p_addr.rsplit(":", 1)
        d_host, d_port = decode.connector.address.rsplit(":", 1)
        for i, toks in enumerate(ids):
            if mode == "read":
                inbox.put(EngineRequest(f"p{i}", toks, PREFILL_PARAMS, kv_transfer_params={"do_remote_decode": True}))
            else:
                tid = uuid.uuid4().hex
                decode.add_request(EngineRequest(f"d{i}", toks, PARAMS, kv_transfer_params={
                    "do_remote_prefill": True, "mode": "write", "transfer_id": tid, "remote_host": p_host,
                    "remote_port": int(p_port)}))
                inbox.put(EngineRequest(f"p{i}", toks, PREFILL_PARAMS, kv_transfer_params={
                    "do_remote_decode": True, "mode": "write", "transfer_id": tid, "remote_host": d_host,
                    "remote_port": int(d_port)}))
        outs: dict[str, list] = {}
        deadline = time.time() + 300
        while not all(outs.get(f"d{i}") and outs[f"d{i}"][-1].finished for i in range(len(ids))):
            assert time.time() < deadline
            while not outbox.empty():
                kind, o = outbox.get()
                if mode == "read" and o.finished:
                    decode.add_request(EngineRequest(o.request_id.replace("p", "d"), ids[int(o.request_id[1:])],
                                                     PARAMS, kv_transfer_params=o.kv_transfer_params))
            for o in decode.step() if decode.has_unfinished_requests() else []:
                outs.setdefault(o.request_id, []).append(o)
        got = [[t for o in outs[f"d{i}"] for t in o.new_token_ids] for i in range(len(ids))]
        assert [o[-1].error for o in outs.values() if o[-1].error] == []
        assert got == expected
        assert decode.get_stats().num_remote_prefills_total == len(ids)
    finally:
        inbox.put(None)
        proc.join(60)
        decode.shutdown()
