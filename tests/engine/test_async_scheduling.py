"""--async-scheduling (on by default): the next decode step is launched before the previous
step's tokens reach the host. Reference: the same engine with --no-async-scheduling. Outputs
(tokens, finish reasons) must be identical, whatever stops a request (length, EOS/stop token,
abort, preemption), and no KV block may leak."""
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.protocol import EngineRequest

COMMON = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=16, device="cpu")
PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 2, 11, 7)]


def _params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_token]),  # stops early
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, min_tokens=6, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True),  # host-side: runs synced
    ]


def _spy_launches(llm):
    """Count launches made ahead of the host (prev given)."""
    runner, counts = llm.engine.runner, {"ahead": 0}
    launch = runner.launch

    def spy(out, eos, prev=None, **kw):
        counts["ahead"] += prev is not None
        return launch(out, eos, prev, **kw)

    runner.launch = spy
    return counts


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_async_matches_sync(tiny_models, arch, device):
    """On a GPU the decode steps replay CUDA graphs whose input ids are copied on the device
    from the step before, and tokens come back through pinned memory."""
    path = tiny_models[arch][0]
    kw = dict(COMMON, device=device, dtype="float32", num_gpu_blocks_override=256, compile_ahead=False)
    sync = LLM(path, async_scheduling=False, **kw)
    probe = sync.generate([PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = probe.token_ids[6]  # greedy reaches it within 30 tokens: request 1 stops early
    params = _params(stop)
    want = sync.generate(PROMPTS, params)
    assert want[1].finish_reason == "stop" and len(want[1].token_ids) < 30
    llm = LLM(path, async_scheduling=True, **kw)
    assert (llm.engine.runner.graphs is not None) == (device == "cuda")
    counts = _spy_launches(llm)
    got = llm.generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert torch.allclose(torch.tensor([lp.logprobs for lp in got[4].logprobs]),
                          torch.tensor([lp.logprobs for lp in want[4].logprobs]))
    assert counts["ahead"] > 0
    # plain decoding of a full batch: every step after the first decode is launched ahead
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    counts["ahead"] = 0
    got = llm.generate(PROMPTS[:3], plain)
    assert [g.token_ids for g in got] == [w.token_ids for w in sync.generate(PROMPTS[:3], plain)]
    assert counts["ahead"] >= 17
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_async_abort_and_preemption_leave_no_blocks(tiny_models):
    path = tiny_models["qwen3"][0]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    small = dict(COMMON, num_gpu_blocks_override=16)  # 3 sequences of up to 43 tokens: preemption
    want = LLM(path, async_scheduling=False, **small).generate(PROMPTS[:4], p)
    llm = LLM(path, async_scheduling=True, **small)
    got = llm.generate(PROMPTS[:4], p)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert llm.engine.scheduler.num_preempted_total > 0
    core = llm.engine
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"a{i}", prompt, p))
    outputs = []
    for _ in range(12):  # mid-decode, a step in flight
        outputs += core.step()
    assert core._inflight is not None
    core.abort_requests(["a0", "a2"])
    while core.has_unfinished_requests():
        outputs += core.step()
    finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finished["a0"] == finished["a2"] == "abort"
    assert all(finished[f"a{i}"] == "length" for i in (1, 3, 4))
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


def test_async_is_the_default(tiny_models):
    assert LLM(tiny_models["llama"][0], device="cpu").engine.async_scheduling
    assert not LLM(tiny_models["llama"][0], device="cpu", async_scheduling=False).engine.async_scheduling


class _ArrivingKV:
    """The scheduler side of a PD decode's connector, reduced to what a step asks of it: one
    request's KV is in flight until `landed` names it."""

    def __init__(self):
        self.landed: set[str] = set()

    def take_first_tokens(self):
        return {}

    def ready(self, req):
        return True

    def num_remote_tokens(self, req, num_local):  # requests added here compute their prompt
        return 0

    def poll(self):
        return set(self.landed), {}, set()

    def on_request_finished(self, req):
        return False, None


def test_decode_launches_ahead_while_kv_arrives(tiny_models):
    """A PD decode always has requests whose KV is still arriving. They cannot be scheduled, so
    they must not stop the running requests' steps from launching ahead of the host (that put
    every decode step of a loaded PD decode on the synchronous path); once the KV lands, the
    request starts at the next step. Reference: the same request alone (its tokens from the
    landed KV are the engine's own computation of the prompt, copied into its blocks here)."""
    from tandem.engine.request import Request, RequestStatus

    path = tiny_models["llama"][0]
    p = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    kw = dict(COMMON, num_gpu_blocks_override=64)
    want = LLM(path, async_scheduling=False, **kw).generate([PROMPTS[0], PROMPTS[3]], p)
    llm = LLM(path, async_scheduling=True, **kw)
    core, kv = llm.engine, _ArrivingKV()
    core.scheduler.connector = kv
    counts = _spy_launches(llm)
    core.add_request(EngineRequest("run", PROMPTS[0], p))
    outputs = []
    for _ in range(3):  # prefill, then decoding
        outputs += core.step()
    # the request whose KV arrives: blocks for its prompt and first token, as _admit hands out
    remote = Request("remote", PROMPTS[3], p, max_tokens=14)
    assert core.blocks.allocate(remote, len(PROMPTS[3]) + 1)
    remote.remote_computed_tokens = len(PROMPTS[3])
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    remote.wait_for_kv()
    core.scheduler.requests["remote"] = remote
    core.scheduler.waiting.append(remote)
    before = counts["ahead"]
    for _ in range(4):
        outputs += core.step()
    assert counts["ahead"] - before >= 3, "a request waiting for its KV stopped the launches ahead"
    # the KV lands: the prompt's KV (computed here by a twin engine) and the prefill's first token
    twin = LLM(path, async_scheduling=False, **kw).engine
    twin.add_request(EngineRequest("t", PROMPTS[3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    first = []
    while not first:  # the prompt's steps: its first token (the prefill's), blocks still held
        first = [o for o in twin.step() if o.new_token_ids]
    n_blocks = -(-len(PROMPTS[3]) // COMMON["block_size"])
    src = twin.scheduler.requests["t"].block_ids[:n_blocks]
    core.runner.kv_cache[:, :, remote.block_ids[:n_blocks]] = twin.runner.kv_cache[:, :, src]
    remote.all_token_ids.append(first[0].new_token_ids[0])
    kv.landed.add("remote")
    outputs += core.step()
    outputs += core.step()
    assert remote.status == RequestStatus.RUNNING, "the landed request did not start within two steps"
    while core.has_unfinished_requests():
        outputs += core.step()
    got = {rid: [t for o in outputs if o.request_id == rid for t in o.new_token_ids] for rid in ("run", "remote")}
    assert got["run"] == want[0].token_ids
    assert [first[0].new_token_ids[0]] + got["remote"] == want[1].token_ids
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
