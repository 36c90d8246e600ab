"""KV block accounting and request states: nothing leaks after completion, abort,
preemption or a failed remote transfer; WAITING_FOR_REMOTE_KVS is skipped until its KV lands.
Reference for the remote-KV scenario: the same engine's collocated output."""
import time

import pytest

from tandem.engine import LLM, SamplingParams
from tandem.engine.block_manager import BlockManager
from tandem.engine.protocol import EngineRequest
from tandem.engine.request import Request, RequestStatus


def test_prefix_cache_shares_and_evicts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Request("a", list(range(10)), SamplingParams())
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = Request("b", list(range(8)) + [99, 98, 97], SamplingParams())
    hit = bm.find_cached_prefix(b)
    assert hit == a.block_ids[:2]
    assert bm.allocate(b, 3, hit) and b.num_computed_tokens == 8
    assert bm.ref_counts[hit[0]] == 2
    bm.free_blocks(a.block_ids)
    bm.free_blocks(b.block_ids)
    assert bm.num_free_blocks == 8
    # Freed blocks keep their hash until reused.
    c = Request("c", list(range(9)), SamplingParams())
    assert bm.find_cached_prefix(c) == hit
    assert bm.allocate(c, 8 * 4 + 1, []) is False  # 9 blocks needed, 8 exist: nothing changes
    assert bm.num_free_blocks == 8 and c.block_ids == []


def test_abort_at_any_point_frees_everything(tiny_models):
    llm = LLM(tiny_models["qwen3"][0], block_size=4, max_num_batched_tokens=8)
    core = llm.engine
    for i in range(6):
        core.add_request(EngineRequest(f"r{i}", list(range(3, 3 + 5 * (i + 1))),
                                       SamplingParams(max_tokens=20, ignore_eos=True)))
    outputs = []
    for _ in range(4):
        outputs += core.step()
    core.abort_requests(["r0", "r3", "r5", "does-not-exist"])
    outputs += core.step()
    aborted = {o.request_id for o in outputs if o.finish_reason == "abort"}
    assert aborted == {"r0", "r3", "r5"}
    core.abort_requests([f"r{i}" for i in range(6)])
    while core.has_unfinished_requests():
        core.step()
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


class FakeConnector:
    recompute_on_failure = False
    first_token_at_step = False

    def ready(self, req):
        return True

    def build_meta(self, scheduled):
        return None

    def take_first_tokens(self):
        return {}

    def wait(self, timeout_s):
        time.sleep(timeout_s)

    def close(self):
        pass


class CopyConnector(FakeConnector):
    """Fake decode-side connector: 'receives' a prompt's KV (every prompt token) by copying it
    from a prefill engine's cache after `delay` polls (or fails it), and the prefill's first
    token at once. Stands in for connectors/ in these tests."""

    def __init__(self, prefill: LLM, decode: LLM, delay: int, first_token: int, fail: bool = False):
        self.prefill, self.decode, self.delay, self.fail = prefill, decode, delay, fail
        self.first_token, self.tokens = first_token, {}
        self.pending: dict[str, list] = {}
        self.polls_while_waiting = 0

    def num_remote_tokens(self, req, num_local):
        return req.num_prompt_tokens - num_local if req.kv_transfer_params else 0

    def on_blocks_allocated(self, req, num_remote):
        self.pending[req.request_id] = [self.delay, req]
        self.tokens[req.request_id] = (self.first_token, None)

    def take_first_tokens(self):
        out, self.tokens = self.tokens, {}
        return out

    def poll(self):
        landed, failed = set(), {}
        for rid, entry in list(self.pending.items()):
            self.polls_while_waiting += 1
            entry[0] -= 1
            if entry[0] > 0:
                continue
            req = entry[1]
            del self.pending[rid]
            if self.fail:
                failed[rid] = "KV transfer timed out"
                continue
            src = req.kv_transfer_params.remote_block_ids
            n = len(src)
            self.decode.engine.runner.kv_cache[:, :, req.block_ids[:n]] = self.prefill.engine.runner.kv_cache[:, :, src]
            landed.add(rid)
        return landed, failed, set()

    def on_request_finished(self, req):
        self.pending.pop(req.request_id, None)
        return False, None


class HoldConnector(FakeConnector):
    """Fake prefill-side connector: keeps a finished request's blocks until told they were sent."""

    def __init__(self):
        self.sent: set[str] = set()

    def num_remote_tokens(self, req, num_local):
        return 0

    def on_blocks_allocated(self, req, num_remote):
        raise AssertionError("prefill side never receives")

    def poll(self):
        sent, self.sent = self.sent, set()
        return set(), {}, sent

    def on_request_finished(self, req):
        return True, {"remote_block_ids": list(req.block_ids)}


def _prefilled(path: str, prompt: list[int], params: SamplingParams):
    """(a collocated engine's tokens for prompt, the reference; a prefill engine holding the prompt's KV;
    its first output, max_tokens 1, whose kv_transfer_params name the held blocks)."""
    expected = LLM(path, block_size=4).generate([prompt], params)[0].token_ids
    prefill = LLM(path, block_size=4)
    prefill.engine.set_connector(HoldConnector())
    prefill.engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0)))
    first = next(o for _ in range(3) for o in prefill.engine.step())  # async: one call later
    return expected, prefill, first


@pytest.mark.parametrize("fail", [False, True])
def test_waiting_for_remote_kvs(tiny_models, fail):
    path = tiny_models["llama"][0]
    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = LLM(path, block_size=4).generate([prompt], params)[0].token_ids

    prefill = LLM(path, block_size=4)
    hold = HoldConnector()
    prefill.engine.set_connector(hold)
    prefill.engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0)))
    first = next(o for _ in range(3) for o in prefill.engine.step())  # async: one call later
    assert first.finished and prefill.engine.blocks.num_free_blocks < prefill.engine.blocks.num_blocks
    src_blocks = first.kv_transfer_params["remote_block_ids"]

    decode = LLM(path, block_size=4, enable_prefix_caching=False)
    conn = CopyConnector(prefill, decode, delay=3, first_token=first.new_token_ids[0], fail=fail)
    decode.engine.set_connector(conn)
    core = decode.engine
    started = time.monotonic()
    core.add_request(EngineRequest("remote", prompt, params, kv_transfer_params={"remote_block_ids": src_blocks}))
    core.add_request(EngineRequest("local", [5, 6, 7], params))
    seen_states, outs = [], {"remote": [], "local": []}
    while core.has_unfinished_requests():
        req = core.scheduler.requests.get("remote")
        if req is not None:
            seen_states.append(req.status)
        for o in core.step():
            outs[o.request_id].append(o)
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in seen_states
    assert conn.polls_while_waiting == 3
    assert len(outs["local"]) == 8  # the local request ran while the remote one waited
    final = outs["remote"][-1]
    if fail:
        assert final.finish_reason == "error" and "timed out" in final.error
    else:
        assert [t for o in outs["remote"] for t in o.new_token_ids] == expected
        assert final.num_prompt_tokens == len(prompt)
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
    # engine phase times (the tandem:request_*_time_seconds metrics) come with each final output only
    wall = time.monotonic() - started
    assert all(o.times is None for o in outs["remote"][:-1] + outs["local"][:-1])
    local, remote = outs["local"][-1].times, final.times
    assert local.kv_transfer_wait is None and 0 < local.prefill <= local.inference
    assert local.inference == pytest.approx(local.prefill + local.decode) and local.queue + local.inference < wall
    assert 0 < remote.kv_transfer_wait < wall  # three polls, each a step of the local request
    if fail:  # ended while waiting: it never ran
        assert remote.queue is remote.prefill is remote.decode is None
    else:  # ran after its KV landed; the first token it sampled is its second output
        assert remote.inference == pytest.approx(remote.prefill + remote.decode)
        assert remote.kv_transfer_wait + remote.queue + remote.inference < wall
    hold.sent.add("p")
    prefill.engine.step()
    assert prefill.engine.blocks.num_free_blocks == prefill.engine.blocks.num_blocks


@pytest.mark.parametrize("at_step", [False, True])
def test_forwarded_first_token_out_on_arrival_or_with_the_first_step(tiny_models, at_step):
    """A PD decode's first output (the prefill's token) goes out when it arrives, or (first_token
    'step', the connector's default) with the step that computes the next token: then the client's
    first gap is one step, not the KV's wait plus a step, and the tokens are the same."""
    path = tiny_models["llama"][0]
    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected, prefill, first = _prefilled(path, prompt, params)
    decode = LLM(path, block_size=4, enable_prefix_caching=False)
    conn = CopyConnector(prefill, decode, delay=4, first_token=first.new_token_ids[0])
    conn.first_token_at_step = at_step
    core = decode.engine
    core.set_connector(conn)
    core.add_request(EngineRequest("remote", prompt, params,
                                   kv_transfer_params={"remote_block_ids": first.kv_transfer_params["remote_block_ids"]}))
    calls = []  # per engine call: (the remote's tokens out, its state after the call)
    while core.has_unfinished_requests():
        out = [t for o in core.step() if o.request_id == "remote" for t in o.new_token_ids]
        req = core.scheduler.requests.get("remote")
        calls.append((out, req.status if req else None))
    assert [t for out, _ in calls for t in out] == expected
    first_out = next(i for i, (out, _) in enumerate(calls) if out)
    second_out = next(i for i, (out, _) in enumerate(calls) if i > first_out and out)
    if at_step:  # out once its KV landed, one call before the next token (async scheduling)
        assert calls[first_out][1] == RequestStatus.RUNNING and second_out == first_out + 1
    else:  # out at once, while its KV is still arriving (four polls)
        assert first_out == 0 and calls[0][1] == RequestStatus.WAITING_FOR_REMOTE_KVS and second_out > 3


def test_remote_kv_requests_never_deadlock_the_decode(tiny_models):
    """More remote-KV requests than blocks: landed requests (holding their blocks) must start even
    when a newer request at the head of the queue cannot get blocks. Prompts fill whole blocks, so
    a landed request's first decode step needs room past its prompt. Reference: a collocated
    engine's greedy tokens, and the decode ending with every block free."""
    path = tiny_models["llama"][0]
    prompt = list(range(40, 64))  # 24 tokens = 6 blocks of 4
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected, prefill, first = _prefilled(path, prompt, params)
    decode = LLM(path, block_size=4, enable_prefix_caching=False, num_gpu_blocks_override=18, max_num_seqs=4)
    core = decode.engine
    core.set_connector(CopyConnector(prefill, decode, delay=2, first_token=first.new_token_ids[0]))
    kv = {"remote_block_ids": first.kv_transfer_params["remote_block_ids"]}
    for i in range(6):
        core.add_request(EngineRequest(f"r{i}", prompt, params, kv_transfer_params=kv))
    outs: dict[str, list[int]] = {}
    for _ in range(400):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not core.has_unfinished_requests(), [(r.request_id, r.status) for r in core.scheduler.waiting]
    assert outs == {f"r{i}": expected for i in range(6)}
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


@pytest.mark.parametrize("nbytes,message", [(0, "no memory is left for the KV cache"),
                                            (40000, "the KV cache holds 64 tokens, fewer than max_model_len")])
def test_too_small_kv_cache_is_a_clear_error(tiny_models, nbytes, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["llama"][0], device="cpu", block_size=16, kv_cache_memory_bytes=nbytes)


def test_block_row_follows_block_ids():
    """The runner's int32 copy of a request's block ids: grown as blocks are appended, rebuilt
    when the request gets a new list (freed or preempted, then allocated again)."""
    from tandem.engine.model_runner import _block_row
    req = Request("r", [1, 2, 3], SamplingParams())
    assert _block_row(req).tolist() == []
    for n in range(1, 70):
        req.block_ids.append(100 + n)
        assert _block_row(req).tolist() == req.block_ids
    req.block_ids = [7, 8, 9]  # same length as nothing cached, different ids
    assert _block_row(req).tolist() == [7, 8, 9]
    req.block_ids.extend([1, 2])
    assert _block_row(req).tolist() == [7, 8, 9, 1, 2]


def test_prefills_from_start_flag(tiny_models):
    """The promise the GPU prefill path relies on (it then reads keys from the step's rows, not
    the cache): set only when every sequence of more than one new token starts at position 0."""
    llm = LLM(tiny_models["llama"][0], block_size=4, max_num_batched_tokens=8, async_scheduling=False)
    core, seen = llm.engine, []
    prepare = core.runner.prepare

    def recording(out, *args, **kwargs):
        inputs = prepare(out, *args, **kwargs)
        seen.append(([(r.request_id, r.num_computed_tokens, n) for r, n in out.scheduled],
                     inputs[0].prefills_from_start))
        return inputs
    core.runner.prepare = recording
    core.add_request(EngineRequest("a", list(range(3, 23)), SamplingParams(max_tokens=3, ignore_eos=True)))
    for _ in range(4):  # 20 prompt tokens in chunks of 8, 8, 4; then a decode
        core.step()
    core.add_request(EngineRequest("b", list(range(40, 45)), SamplingParams(max_tokens=2, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    assert seen[0] == ([("a", 0, 8)], True)
    assert seen[1] == ([("a", 8, 8)], False) and seen[2] == ([("a", 16, 4)], False)
    assert seen[3] == ([("a", 20, 1)], True)  # decodes only
    assert seen[4] == ([("a", 21, 1), ("b", 0, 5)], True)  # a decode next to a fresh prefill


class LateFirstTokenConnector(CopyConnector):
    """Write-mode order: the prefill's first token arrives together with the last of the KV (in
    the poll that lands it), so the decode's first step is scheduled in the same step()."""

    def take_first_tokens(self):
        ready = {rid: tok for rid, tok in self.tokens.items() if self.pending.get(rid, [0])[0] <= 1}
        for rid in ready:
            del self.tokens[rid]
        return ready


@pytest.mark.parametrize("logprobs", [None, 1], ids=["async-step", "sync-step"])
def test_forwarded_first_token_goes_out_before_the_first_decode_step(tiny_models, logprobs):
    """A PD decode emits the prefill's first token (its TTFT) before it runs its own first
    forward pass, not after it; the engine core process sends such outputs through emit_early.
    Reference: the same engine's collocated greedy tokens."""
    path = tiny_models["llama"][0]
    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=logprobs)
    expected = LLM(path, block_size=4).generate([prompt], params)[0].token_ids

    prefill = LLM(path, block_size=4)
    prefill.engine.set_connector(HoldConnector())
    prefill.engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0)))
    first = next(o for _ in range(3) for o in prefill.engine.step())
    decode = LLM(path, block_size=4, enable_prefix_caching=False)
    core = decode.engine
    core.set_connector(LateFirstTokenConnector(prefill, decode, delay=2, first_token=first.new_token_ids[0]))
    events = []

    def emit(outputs):
        events.extend(("out", t) for o in outputs for t in o.new_token_ids)

    def recorded(run):
        def forward(out, *args, **kwargs):
            events.append(("forward", None))
            return run(out, *args, **kwargs)
        return forward

    core.emit_early = emit
    core.runner.launch, core.runner.execute = recorded(core.runner.launch), recorded(core.runner.execute)
    remote_blocks = first.kv_transfer_params["remote_block_ids"]
    core.add_request(EngineRequest("remote", prompt, params, kv_transfer_params={"remote_block_ids": remote_blocks}))
    while core.has_unfinished_requests():
        emit(core.step())
    assert [t for kind, t in events if kind == "out"] == expected
    assert events[0] == ("out", expected[0]) and events[1][0] == "forward"
