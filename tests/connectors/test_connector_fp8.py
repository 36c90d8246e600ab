"""The KV connector with an FP8 KV cache (--kv-cache-dtype fp8): fp8 blocks move as they are.
Reference: a collocated engine with the same fp8 KV cache; a bf16/fp32 peer is refused by the
layout check (the dtype is part of the handshake's KVLayout)."""
from tandem.engine import LLM, SamplingParams
from tandem.engine.protocol import EngineRequest
from tests.connectors.test_connector import PARAMS, PROMPTS, finished, model_dir, run_all, settle, tokens  # noqa: F401


def _make(model_dir, role, kv_cache_dtype):
    kv = {"kv_connector": "TandemConnector", "kv_role": role,
          "kv_connector_extra_config": {"transfer_timeout_s": 15, "hold_timeout_s": 15}}
    return LLM(model_dir, block_size=4, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype, **kv).engine


def _prefill_then_decode(prefill, decode, prompts):
    for i, p in enumerate(prompts):  # greedy: the prefill's one token is the decode's first token too
        prefill.add_request(EngineRequest(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0),
                                          kv_transfer_params={"do_remote_decode": True}))
    outs = run_all(prefill, until=lambda o: all(finished(o, f"p{i}") for i in range(len(prompts))))
    for i, p in enumerate(prompts):
        decode.add_request(EngineRequest(f"d{i}", p, PARAMS, kv_transfer_params=outs[f"p{i}"][-1].kv_transfer_params))
    return run_all(prefill, decode, until=lambda o: all(finished(o, f"d{i}") for i in range(len(prompts))))


def test_fp8_read_mode_matches_collocated_fp8(model_dir):
    expected = [o.token_ids for o in LLM(model_dir, block_size=4, kv_cache_dtype="fp8").generate(PROMPTS, PARAMS)]
    prefill, decode = _make(model_dir, "kv_producer", "fp8"), _make(model_dir, "kv_consumer", "fp8")
    try:
        assert prefill.runner.kv_cache.element_size() == 1
        outs = _prefill_then_decode(prefill, decode, PROMPTS)
        assert [tokens(outs, f"d{i}") for i in range(len(PROMPTS))] == expected
        settle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_kv_dtype_mismatch_is_refused(model_dir):
    prefill, decode = _make(model_dir, "kv_producer", "fp8"), _make(model_dir, "kv_consumer", "auto")
    try:
        outs = _prefill_then_decode(prefill, decode, PROMPTS[3:4])
        out = outs["d0"][-1]
        assert out.finish_reason == "error" and "dtype: float8_e4m3fn vs float32" in out.error, out.error
        settle(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
