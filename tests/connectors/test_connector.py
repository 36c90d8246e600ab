"""Two engines in one process joined by the real TandemConnector over the tcp transport.
Reference: a collocated engine's greedy output on the same model."""
import importlib.util
import time
import uuid

import pytest
import torch
import transformers

from tandem.engine import LLM, SamplingParams
from tandem.engine.protocol import EngineRequest

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 10 + n)) for n in (1, 5, 17, 33, 40)]
# Host transports (no GPU needed); nixl runs over DRAM with UCX when the nixl extra is installed.
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="the nixl extra is not installed"))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("qwen3")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def expected(model_dir):
    return [o.token_ids for o in LLM(model_dir, block_size=4).generate(PROMPTS, PARAMS)]


def make(model_dir, role, **extra):
    kv = {"kv_connector": "TandemConnector", "kv_role": role,
          "kv_connector_extra_config": {"transfer_timeout_s": 15, "hold_timeout_s": 15, **extra}}
    return LLM(model_dir, block_size=4, max_num_batched_tokens=16, **kv).engine


def run_all(*cores, until, remote_waiting: list | None = None):
    """Step every engine until `until()` holds; collect outputs by request id (and, if given,
    each step's count of WAITING_FOR_REMOTE_KVS requests of the last engine)."""
    outs: dict[str, list] = {}
    deadline = time.time() + 30
    while not until(outs):
        assert time.time() < deadline, f"timed out; outputs so far: {outs}"
        for core in cores:
            for o in core.step():
                outs.setdefault(o.request_id, []).append(o)
        if remote_waiting is not None:
            remote_waiting.append(cores[-1].get_stats().num_waiting_for_remote_kvs)
        time.sleep(0.001)
    return outs


def tokens(outs, rid):
    return [t for o in outs[rid] for t in o.new_token_ids]


def finished(outs, rid):
    return rid in outs and outs[rid][-1].finished


def settle(*cores, within_s: float = 10.0):
    """Let held blocks be released, then check nothing leaked (every block free within within_s)."""
    deadline = time.monotonic() + within_s
    while any(c.blocks.num_free_blocks != c.blocks.num_blocks for c in cores):
        assert time.monotonic() < deadline, f"blocks not all free within {within_s} s: " + str(
            [c.blocks.num_free_blocks for c in cores])
        for c in cores:
            c.step()
        time.sleep(0.01)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_read_mode_matches_collocated(model_dir, expected, transport):
    prefill = make(model_dir, "kv_producer", transport=transport)
    decode = make(model_dir, "kv_consumer", transport=transport)
    try:
        for i, p in enumerate(PROMPTS):
            prefill.add_request(EngineRequest(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0),
                                              kv_transfer_params={"do_remote_decode": True}))
        outs = run_all(prefill, until=lambda o: all(finished(o, f"p{i}") for i in range(len(PROMPTS))))
        assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks  # held for the reads
        for i, p in enumerate(PROMPTS):
            params = outs[f"p{i}"][-1].kv_transfer_params
            assert params["remote_engine_id"] == prefill.connector.engine_id
            decode.add_request(EngineRequest(f"d{i}", p, PARAMS, kv_transfer_params=params))
        waiting = []
        outs = run_all(prefill, decode, until=lambda o: all(finished(o, f"d{i}") for i in range(len(PROMPTS))),
                       remote_waiting=waiting)
        assert max(waiting) > 0 and waiting[-1] == 0
        assert [tokens(outs, f"d{i}") for i in range(len(PROMPTS))] == expected
        settle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_write_mode_matches_collocated(model_dir, expected, transport):
    prefill = make(model_dir, "kv_producer", transport=transport)
    decode = make(model_dir, "kv_consumer", transport=transport)
    host, port = prefill.connector.address.rsplit(":", 1)
    dhost, dport = decode.connector.address.rsplit(":", 1)
    try:
        for i, p in enumerate(PROMPTS):
            tid = uuid.uuid4().hex
            decode.add_request(EngineRequest(f"d{i}", p, PARAMS, kv_transfer_params={
                "do_remote_prefill": True, "mode": "write", "transfer_id": tid, "remote_host": host,
                "remote_port": int(port)}))
            prefill.add_request(EngineRequest(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={
                "do_remote_decode": True, "mode": "write", "transfer_id": tid, "remote_host": dhost,
                "remote_port": int(dport)}))
        outs = run_all(prefill, decode, until=lambda o: all(finished(o, f"d{i}") for i in range(len(PROMPTS))))
        assert [o.error for i in range(len(PROMPTS)) for o in outs[f"d{i}"] if o.error] == []
        assert [tokens(outs, f"d{i}") for i in range(len(PROMPTS))] == expected
        assert all(outs[f"p{i}"][-1].finish_reason == "length" for i in range(len(PROMPTS)))
        settle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_layout_mismatch_is_refused(model_dir, tmp_path):
    prefill = make(model_dir, "kv_producer")
    decode = LLM(model_dir, block_size=8, kv_connector="TandemConnector", kv_role="kv_consumer",
                 kv_connector_extra_config={"transfer_timeout_s": 3}).engine
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[3], SamplingParams(max_tokens=1, temperature=0),
                                          kv_transfer_params={"do_remote_decode": True}))
        params = run_all(prefill, until=lambda o: finished(o, "p"))["p"][-1].kv_transfer_params
        decode.add_request(EngineRequest("d", PROMPTS[3], PARAMS, kv_transfer_params=params))
        out = run_all(decode, until=lambda o: finished(o, "d"))["d"][-1]
        assert out.finish_reason == "error" and "KV layouts differ (block_size: 4 vs 8)" in out.error
        settle(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("recompute", [False, True])
def test_unreachable_prefill_times_out_or_recomputes(model_dir, expected, recompute):
    decode = make(model_dir, "kv_consumer", transfer_timeout_s=1, recompute_on_failure=recompute)
    try:
        params = {"do_remote_prefill": True, "remote_block_ids": list(range(10)), "remote_host": "127.0.0.1",
                  "remote_port": 9, "remote_request_id": "gone", "remote_engine_id": "x"}
        decode.add_request(EngineRequest("d", PROMPTS[3], PARAMS, kv_transfer_params=params))
        out = run_all(decode, until=lambda o: finished(o, "d"))["d"]
        if recompute:
            assert [t for o in out for t in o.new_token_ids] == expected[3]
        else:
            # (the handshake's own timeout and the transfer's deadline are equal: either may fire first)
            assert out[-1].finish_reason == "error" and ("no answer" in out[-1].error
                                                          or "no KV handshake" in out[-1].error)
        settle(decode)
    finally:
        decode.shutdown()


def test_prefill_frees_blocks_when_decode_never_reads(model_dir):
    prefill = make(model_dir, "kv_producer", hold_timeout_s=1)
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0),
                                          kv_transfer_params={"do_remote_decode": True}))
        run_all(prefill, until=lambda o: finished(o, "p"))
        assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks
        settle(prefill)
    finally:
        prefill.shutdown()


@pytest.fixture
def silent_decode():
    """The KV port of a decode that is alive (it accepts connections) but never answers: its port."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield port
    sock.close(0)
    ctx.term()


def test_write_mode_prefill_frees_blocks_when_decode_never_sends_blocks(model_dir, expected, silent_decode):
    """The prefill computes without decode's block ids; its blocks wait for them until the
    transfer timeout, then are freed."""
    prefill = make(model_dir, "kv_producer", transfer_timeout_s=3)
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[2], SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={
            "do_remote_decode": True, "mode": "write", "transfer_id": "t", "remote_host": "127.0.0.1",
            "remote_port": silent_decode}))
        outs = run_all(prefill, until=lambda o: finished(o, "p"))
        assert outs["p"][-1].finish_reason == "length" and tokens(outs, "p") == expected[2][:1]
        assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks  # held for the ids
        settle(prefill, within_s=10)
    finally:
        prefill.shutdown()


def test_write_mode_prefill_fails_when_the_ids_time_out_mid_prompt(model_dir, silent_decode):
    """A prompt of several chunks still computing when the wait for decode's block ids times out
    stops there with an error."""
    prefill = make(model_dir, "kv_producer", transfer_timeout_s=0.001)
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={
            "do_remote_decode": True, "mode": "write", "transfer_id": "t", "remote_host": "127.0.0.1",
            "remote_port": silent_decode}))
        out = run_all(prefill, until=lambda o: finished(o, "p"))["p"][-1]
        assert out.finish_reason == "error" and "did not send its KV block ids" in out.error
        settle(prefill)
    finally:
        prefill.shutdown()


def test_write_mode_prefill_frees_at_once_when_the_decode_is_gone(model_dir):
    """Write mode: nothing listens at the decode's KV port: the prefill (which computes meanwhile)
    frees its blocks within a couple of seconds, not after transfer_timeout_s (60 s here)."""
    from tests.ports import free_port

    prefill = make(model_dir, "kv_producer", transfer_timeout_s=60)
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={
            "do_remote_decode": True, "mode": "write", "transfer_id": "t", "remote_host": "127.0.0.1",
            "remote_port": free_port()}))
        run_all(prefill, until=lambda o: finished(o, "p"))
        settle(prefill, within_s=2.0)
    finally:
        prefill.shutdown()


def test_prefill_frees_at_once_when_the_reading_decode_is_gone(model_dir):
    """Read mode: the decode named by the router is dead (nothing listens at its KV port): the
    prefill frees its held blocks within a second, not after hold_timeout_s (60 s here)."""
    from tests.ports import free_port

    prefill = make(model_dir, "kv_producer", hold_timeout_s=60)
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={
            "do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": free_port()}))
        run_all(prefill, until=lambda o: finished(o, "p"))
        settle(prefill, within_s=1.0)
    finally:
        prefill.shutdown()


def test_prefill_frees_at_once_when_the_router_drops_the_decode(model_dir):
    """Read mode: the decode is hung (its KV port still accepts connections) and the router,
    which dropped it for not pinging, sends PeerGone: the prefill frees its held blocks within
    a second, not after hold_timeout_s (60 s here)."""
    import zmq

    from tandem.connectors.protocol import PeerGone, encoder
    ctx = zmq.Context()
    hung = ctx.socket(zmq.ROUTER)
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.DEALER)
    prefill = make(model_dir, "kv_producer", hold_timeout_s=60)
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0),
                                          kv_transfer_params={"do_remote_decode": True, "remote_host": "127.0.0.1",
                                                              "remote_port": port}))
        run_all(prefill, until=lambda o: finished(o, "p"))
        time.sleep(0.5)
        assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks  # held: the decode looks alive
        router.connect(f"tcp://{prefill.connector.address}")
        router.send(encoder.encode(PeerGone(f"127.0.0.1:{port}")))
        settle(prefill, within_s=1.0)
    finally:
        prefill.shutdown()
        router.close(0)
        hung.close(0)
        ctx.term()


def test_write_mode_decode_aborted_while_queued_frees_the_prefill_at_once(model_dir):
    """Write mode: the decode request is aborted before it asked for any KV (still queued, no
    blocks, no handshake): decode tells the prefill, which frees the prompt's blocks it held for
    decode's ids within a couple of seconds, not after transfer_timeout_s (60 s here)."""
    prefill = make(model_dir, "kv_producer", transfer_timeout_s=60)
    decode = make(model_dir, "kv_consumer", transfer_timeout_s=60)
    host, port = prefill.connector.address.rsplit(":", 1)
    dhost, dport = decode.connector.address.rsplit(":", 1)
    try:
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={
            "do_remote_decode": True, "mode": "write", "transfer_id": "t", "remote_host": dhost,
            "remote_port": int(dport)}))
        run_all(prefill, until=lambda o: finished(o, "p"))
        assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks  # held for decode's ids
        decode.add_request(EngineRequest("d", PROMPTS[4], PARAMS, kv_transfer_params={
            "do_remote_prefill": True, "mode": "write", "transfer_id": "t", "remote_host": host,
            "remote_port": int(port)}))
        decode.abort_requests(["d"])
        settle(prefill, decode, within_s=2.0)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_read_mode_decode_aborted_while_queued_frees_the_prefill_at_once(model_dir):
    """Read mode: the decode request is aborted while queued (no blocks, nothing read): decode
    tells the prefill to free the blocks it holds for the read within a couple of seconds, not
    after hold_timeout_s (60 s here)."""
    prefill = make(model_dir, "kv_producer", hold_timeout_s=60)
    decode = make(model_dir, "kv_consumer", hold_timeout_s=60)
    dhost, dport = decode.connector.address.rsplit(":", 1)
    try:
        to_prefill = {"do_remote_decode": True, "remote_host": dhost, "remote_port": int(dport)}
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0),
                                          kv_transfer_params=to_prefill))
        outs = run_all(prefill, until=lambda o: finished(o, "p"))
        assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks  # held for the read
        decode.add_request(EngineRequest("d", PROMPTS[4], PARAMS, kv_transfer_params=outs["p"][-1].kv_transfer_params))
        decode.abort_requests(["d"])
        settle(prefill, decode, within_s=2.0)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_write_mode_abort_before_the_prefill_request_frees_at_once(model_dir, transport):
    """A decode request aborted after it said where to write, before its prefill request reached
    the prefill (the client hung up first): the prefill, holding decode's ids and its abort for a
    request it never saw, tells decode nothing will be pushed, and decode frees its blocks within
    a couple of seconds, not after transfer_timeout_s (60 s here). The prefill request that still
    comes ends without computing for decode (nothing is pushed into the freed blocks)."""
    prefill = make(model_dir, "kv_producer", transport=transport, transfer_timeout_s=60)
    decode = make(model_dir, "kv_consumer", transport=transport, transfer_timeout_s=60)
    host, port = prefill.connector.address.rsplit(":", 1)
    dhost, dport = decode.connector.address.rsplit(":", 1)
    try:
        decode.add_request(EngineRequest("d", PROMPTS[4], PARAMS, kv_transfer_params={
            "do_remote_prefill": True, "mode": "write", "transfer_id": "t", "remote_host": host,
            "remote_port": int(port)}))
        deadline = time.time() + 30
        while "t" not in prefill.connector.inbox:  # decode allocated and said where to write
            assert time.time() < deadline
            decode.step()
            time.sleep(0.01)
        decode.abort_requests(["d"])
        settle(decode, within_s=2.0)
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1, temperature=0),
                                          kv_transfer_params={
            "do_remote_decode": True, "mode": "write", "transfer_id": "t", "remote_host": dhost,
            "remote_port": int(dport)}))
        outs = run_all(prefill, until=lambda o: finished(o, "p"))
        assert outs["p"][-1].finish_reason in ("abort", "error") and not tokens(outs, "p"), outs["p"]
        settle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("ids_first", [True, False])
def test_write_mode_prefill_aborted_while_queued_releases_the_decode_at_once(model_dir, ids_first):
    """Write mode: the prefill request is aborted while still queued (never scheduled, nothing
    pushed), with decode's block ids already in (ids_first) or coming after. The prefill answers
    the ids at once: decode's request fails with an error and its blocks are free within a couple
    of seconds, not after transfer_timeout_s (60 s here), which under load starves the decode."""
    prefill = make(model_dir, "kv_producer", transfer_timeout_s=60)
    decode = make(model_dir, "kv_consumer", transfer_timeout_s=60)
    host, port = prefill.connector.address.rsplit(":", 1)
    dhost, dport = decode.connector.address.rsplit(":", 1)
    to_prefill = {"do_remote_decode": True, "mode": "write", "transfer_id": "t", "remote_host": dhost,
                  "remote_port": int(dport)}

    def queue_and_abort_prefill():
        prefill.add_request(EngineRequest("p", PROMPTS[4], SamplingParams(max_tokens=1), kv_transfer_params=to_prefill))
        prefill.abort_requests(["p"])

    try:
        if not ids_first:
            queue_and_abort_prefill()
        decode.add_request(EngineRequest("d", PROMPTS[4], PARAMS, kv_transfer_params={
            "do_remote_prefill": True, "mode": "write", "transfer_id": "t", "remote_host": host,
            "remote_port": int(port)}))
        if ids_first:
            deadline = time.time() + 30
            while "t" not in prefill.connector.inbox:  # decode allocated and said where to write
                assert time.time() < deadline
                decode.step()
                time.sleep(0.01)
            queue_and_abort_prefill()
        start = time.monotonic()
        outs = run_all(decode, until=lambda o: finished(o, "d"))
        assert time.monotonic() - start < 5
        assert outs["d"][-1].error and "prefill" in outs["d"][-1].error, outs["d"][-1]
        settle(prefill, decode, within_s=2.0)
    finally:
        prefill.shutdown()
        decode.shutdown()
