"""Write mode: the prefill computes the prompt without waiting for decode's block ids, and pushes
what it computed once they come. Two engines in one process over tcp; the decode is held back
(not stepped, or not even given its request) so its ids come late on purpose.
Reference: a collocated engine's greedy output on the same model, and every block free after."""
import uuid

import pytest

from tandem.connectors.protocol import AbortTransfer
from tandem.connectors.transfer import TransferState as S
from tandem.engine import SamplingParams
from tandem.engine.protocol import EngineRequest
from tests.connectors.test_connector import (PARAMS, PROMPTS, expected, finished, make, model_dir, run_all,  # noqa: F401
                                             settle, tokens)

FIRST = SamplingParams(max_tokens=1, temperature=0)


def _params(engine, tid: str, side: str) -> dict:
    host, port = engine.connector.address.rsplit(":", 1)
    key = "do_remote_decode" if side == "prefill" else "do_remote_prefill"
    return {key: True, "mode": "write", "transfer_id": tid, "remote_host": host, "remote_port": int(port)}


def _step(core, times: int, outs: dict) -> None:
    for _ in range(times):
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)


@pytest.mark.parametrize("ids_come", ["after_prefill_finished", "between_chunks"])
def test_prefill_computes_before_the_block_ids_and_matches_collocated(model_dir, expected, ids_come):
    """The prompts take 1-3 chunks (16-token budget). after_prefill_finished: the prefill samples
    every first token before decode has even received its requests (their pushes then come all
    from the held blocks); between_chunks: decode's ids come after the first prefill step (the
    computed part goes at once, the rest layer by layer). A second round repeats the prompts: the
    prefill finds them in its prefix cache and must push those cached blocks too."""
    prefill = make(model_dir, "kv_producer")
    decode = make(model_dir, "kv_consumer")
    try:
        for rnd in range(2):
            tids = [uuid.uuid4().hex for _ in PROMPTS]
            outs: dict[str, list] = {}
            for i, p in enumerate(PROMPTS):
                prefill.add_request(EngineRequest(f"p{rnd}{i}", p, FIRST,
                                                  kv_transfer_params=_params(decode, tids[i], "prefill")))
            if ids_come == "after_prefill_finished":
                outs = run_all(prefill, until=lambda o: all(finished(o, f"p{rnd}{i}") for i in range(len(PROMPTS))))
                # computed and answered with no word from decode: its KV waits in held blocks
                assert [tokens(outs, f"p{rnd}{i}") for i in range(len(PROMPTS))] == [e[:1] for e in expected]
                assert all(prefill.connector.table.get(f"p{rnd}{i}").state == S.WAITING_FOR_BLOCKS
                           for i in range(len(PROMPTS)))
                assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks
            else:
                table = prefill.connector.table
                while not any(0 < t.request.num_computed_tokens < t.request.num_prompt_tokens
                              for t in table.transfers.values() if t.state == S.WAITING_FOR_BLOCKS):
                    _step(prefill, 1, outs)  # until a prompt is computed in part, with no ids yet
            for i, p in enumerate(PROMPTS):
                decode.add_request(EngineRequest(f"d{rnd}{i}", p, PARAMS,
                                                 kv_transfer_params=_params(prefill, tids[i], "decode")))
            outs.update(run_all(prefill, decode,
                                until=lambda o: all(finished(o, f"d{rnd}{i}") for i in range(len(PROMPTS)))))
            assert [o.error for i in range(len(PROMPTS)) for o in outs[f"d{rnd}{i}"] if o.error] == []
            assert [tokens(outs, f"d{rnd}{i}") for i in range(len(PROMPTS))] == expected
            settle(prefill, decode)
        assert prefill.get_stats().prefix_cache_hits > 0  # the second round's pushes came from cached blocks
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_decode_aborted_before_the_prefill_starts_stops_it(model_dir):
    """Decode's abort reaches the prefill before its request does: the prefill does not compute
    it and answers with an error; nothing leaks on either side."""
    prefill = make(model_dir, "kv_producer")
    decode = make(model_dir, "kv_consumer")
    try:
        decode.add_request(EngineRequest("d", PROMPTS[4], PARAMS, kv_transfer_params=_params(prefill, "t", "decode")))
        outs: dict[str, list] = {}
        while "t" not in prefill.connector.inbox:
            _step(decode, 1, outs)
        decode.abort_requests(["d"])
        while not isinstance(prefill.connector.inbox.get("t"), AbortTransfer):
            _step(decode, 1, outs)
        prefill.add_request(EngineRequest("p", PROMPTS[4], FIRST, kv_transfer_params=_params(decode, "t", "prefill")))
        out = run_all(prefill, decode, until=lambda o: finished(o, "p"))["p"][-1]
        assert out.finish_reason == "error" and "aborted" in out.error
        settle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_requests_waiting_for_ids_hold_at_most_half_the_cache(model_dir, expected):
    """A prefill of 24 blocks computes the 40-token prompt (10 blocks) before any ids, but not the
    33-token one too (9 more would pass half the cache): that one waits for its ids, so requests
    whose ids came always find room. Both still match collocated once decode sends the ids."""
    from tandem.engine import LLM

    kv = {"kv_connector": "TandemConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"transfer_timeout_s": 15, "hold_timeout_s": 15}}
    prefill = LLM(model_dir, block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=24, **kv).engine
    decode = make(model_dir, "kv_consumer")
    try:
        tids = {i: uuid.uuid4().hex for i in (4, 3)}
        for i in (4, 3):
            prefill.add_request(EngineRequest(f"p{i}", PROMPTS[i], FIRST,
                                              kv_transfer_params=_params(decode, tids[i], "prefill")))
        outs = run_all(prefill, until=lambda o: finished(o, "p4"))
        for _ in range(5):
            _step(prefill, 1, outs)
        assert prefill.connector.table.get("p3").request.num_computed_tokens == 0  # waits for its ids
        for i in (4, 3):
            decode.add_request(EngineRequest(f"d{i}", PROMPTS[i], PARAMS,
                                             kv_transfer_params=_params(prefill, tids[i], "decode")))
        outs.update(run_all(prefill, decode, until=lambda o: finished(o, "d4") and finished(o, "d3")))
        assert [tokens(outs, "d4"), tokens(outs, "d3")] == [expected[4], expected[3]]
        settle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
