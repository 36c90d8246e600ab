"""benchmarks.ab_decode on CPU with a tiny dense model: a batch whose prompts prefill over several
steps (the first sequences decode meanwhile) still has every sequence running through the timed
steps, and two engines built alike agree on their greedy tokens. No timing is asserted."""
import json

import pytest
import torch

from benchmarks import ab_decode, roofline

TINY = dict(roofline.MODELS["llama3-8b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)


def test_decode_keeps_every_sequence_through_the_timed_steps(monkeypatch):
    monkeypatch.setitem(roofline.MODELS, "tiny-dense", TINY)
    batch, context, steps = 8, 100, 6  # 800 prompt tokens at 64 a step: 13+ prefill steps before the timed ones
    engines = [roofline.build("tiny-dense", device="cpu", max_num_batched_tokens=64, max_num_seqs=batch, seed=0,
                              max_model_len=ab_decode.MAX_MODEL_LEN, async_scheduling=False).engine
               for _ in range(2)]
    runs = [ab_decode.decode(core, batch, context, steps, f"run{i}") for i, core in enumerate(engines)]
    for (times, tokens), core in zip(runs, engines):
        assert len(times) == steps
        assert len(tokens) == batch and all(len(t) >= steps + 1 for t in tokens)
        assert not core.has_unfinished_requests()
    assert ab_decode.agreement(runs[0][1], runs[1][1]) == 1.0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kv_cache_bytes_hold_one_sequence_of_the_model_length_at_batch_1(monkeypatch, kv_cache_dtype):
    """kv_cache_bytes sizes the cache by the batch's tokens in the engine's own bytes a token (an fp8
    cache's too), and at batch 1 never below MAX_MODEL_LEN, which the engine refuses to start under."""
    monkeypatch.setitem(roofline.MODELS, "tiny-dense", TINY)
    runner = roofline.build("tiny-dense", device="cpu", max_model_len=64, kv_cache_dtype=kv_cache_dtype).engine.runner
    per_token = runner.kv_bytes_per_block() // runner.block_size
    tokens = [(ab_decode.kv_cache_bytes("tiny-dense", b, 1024, 64, kv_cache_dtype) - (256 << 20)) / per_token
              for b in (1, 64)]  # (less its fixed margin)
    assert tokens[0] >= ab_decode.MAX_MODEL_LEN and tokens[1] == 64 * (1024 + 64 + 64)


def test_plans_variant_puts_plan_tunes_best_plans_in_the_tables_while_building(tmp_path):
    from tandem.kernels.triton import fp8_skinny, linear, moe
    key, plan = (64, 4096, 4096, 128), {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "QUANT": False,
                                        "num_warps": 4, "num_stages": 4}
    walks = [dict(what=f"fp8 {key}", best=plan), dict(what="bf16 (2048, 128)", best={"BLOCK_N": 16}),
             dict(what="experts", best=dict(moe.W8A16_PAIRS, num_warps=1)),
             dict(what="decode attention", best={"num_warps": 8})]
    f = tmp_path / "tuned.json"
    f.write_text(json.dumps(dict(walks=walks)))
    from tandem.kernels.triton import attention
    before = [dict(t) for t in (fp8_skinny.PLANS, linear.SKINNY_PLANS, moe.W8A16_PAIRS)]
    rule = attention._launch_plans
    assert ab_decode.kernel_fields(f"plans={f}") == {}
    with ab_decode.plans_installed(ab_decode.tuned_plans(f"plans={f}")):
        assert fp8_skinny.plan(64, 4096, 4096, 128) == dict(plan, PRELOAD=2)  # what a capture now asks for
        assert linear.SKINNY_PLANS[(2048, 128)] == {"BLOCK_N": 16}
        assert moe.W8A16_PAIRS["num_warps"] == 1
        q = torch.zeros(64, 32, 128, dtype=torch.bfloat16)  # a decode batch: 64 sequences, one query each
        args = (q, 4, 64, 8, 1, 1024, False, 1)  # (GQA group 4, 8 KV heads, 1k context, fp8 cache)
        assert rule(*args)[0]["num_warps"] != 8
        assert attention._launch_plans(*args)[0]["num_warps"] == 8
    assert [dict(t) for t in (fp8_skinny.PLANS, linear.SKINNY_PLANS, moe.W8A16_PAIRS)] == before
    assert attention._launch_plans is rule
    assert ab_decode.tuned_plans("default") == []
    f.write_text(json.dumps(dict(walks=[dict(what="router", best={})])))
    with pytest.raises(SystemExit, match="unknown walk"):
        ab_decode.tuned_plans(f"plans={f}")


def test_a_plans_file_joins_fields_turned_off(tmp_path):
    """"plans=FILE+no-x": the file's plans and the fields turned off, each part read as alone."""
    plans = tmp_path / "p.json"
    plans.write_text(json.dumps({"walks": [{"what": "fp8 (16, 4096, 4096, 128)", "best": {"BLOCK_N": 64}}]}))
    both = f"plans={plans}+no-pdl+no-fuse-norms"
    assert ab_decode.kernel_fields(both) == {"pdl": False, "fuse_norms": False}
    assert ab_decode.tuned_plans(both) == ab_decode.tuned_plans(f"plans={plans}")
    assert [(key, plan) for _, key, plan in ab_decode.tuned_plans(both)] == [((16, 4096, 4096, 128), {"BLOCK_N": 64})]
    assert ab_decode.kernel_fields(f"plans={plans}") == {} and ab_decode.tuned_plans("no-pdl") == []
    with pytest.raises(SystemExit, match="unknown variant part"):
        ab_decode.kernel_fields(f"plans={plans}+no-such-field")


def test_a_field_named_without_no_is_turned_on():
    """"x" turns field x on (the fields that are off by default), "no-x" off, in one variant."""
    assert ab_decode.kernel_fields("fp8-tma-gemm+no-pdl") == {"fp8_tma_gemm": True, "pdl": False}
    with pytest.raises(SystemExit, match="unknown variant part"):
        ab_decode.kernel_fields("tma")


def test_plans_files_join_in_order_the_later_winning(tmp_path):
    """"plans=A+plans=B": both files' plans, installed in that order, so B's plan wins a key both set."""
    from tandem.kernels.triton import fp8_skinny
    shared, own = (16, 4096, 4096, 128), (16, 6144, 4096, 128)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"walks": [{"what": f"fp8 {shared}", "best": {"BLOCK_N": 64}},
                                       {"what": f"fp8 {own}", "best": {"BLOCK_N": 32}}]}))
    b.write_text(json.dumps({"walks": [{"what": f"fp8 {shared}", "best": {"BLOCK_N": 128}}]}))
    plans = ab_decode.tuned_plans(f"plans={a}+plans={b}+no-pdl")
    assert [(key, plan) for _, key, plan in plans] == [(shared, {"BLOCK_N": 64}), (own, {"BLOCK_N": 32}),
                                                       (shared, {"BLOCK_N": 128})]
    before = dict(fp8_skinny.PLANS)
    with ab_decode.plans_installed(plans):
        assert fp8_skinny.PLANS[shared] == {"BLOCK_N": 128} and fp8_skinny.PLANS[own] == {"BLOCK_N": 32}
    assert fp8_skinny.PLANS == before


def test_a_tma_split_walk_goes_in_the_tma_table_while_building(tmp_path):
    """"tma (N, K)" walks (written by hand) set the TMA decode GEMM's split for that shape, and only while the
    variant's engine is built."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from tandem.kernels.triton import fp8_tma
    f = tmp_path / "tma.json"
    f.write_text(json.dumps({"walks": [{"what": "tma (4096, 4096)", "best": {"SPLIT": 4}}]}))
    assert fp8_tma.split_for(4096, 4096, 132) == 16
    tma_before = dict(fp8_tma.PLANS)  # (the table's own measured plans)
    with ab_decode.plans_installed(ab_decode.tuned_plans(f"plans={f}")):
        assert fp8_tma.split_for(4096, 4096, 132) == 4
    assert fp8_tma.split_for(4096, 4096, 132) == 16 and fp8_tma.PLANS == tma_before
    f.write_text(json.dumps({"walks": [{"what": "tma ring (4096, 14336)", "best": {"SPLIT": 4, "STAGES": 8}}]}))
    before = dict(fp8_tma.RING_PLANS)  # (the table's own measured plans)
    with ab_decode.plans_installed(ab_decode.tuned_plans(f"plans={f}")):
        assert fp8_tma.ring_plan(4096, 14336, 132) == (4, 8)
    assert fp8_tma.ring_plan(4096, 14336, 132) == (8, 6) and fp8_tma.RING_PLANS == before


def test_a_fused_experts_walk_goes_in_its_table_while_building(tmp_path):
    """"fused (H, I, top_k)" walks (written by hand) set the fused experts launch's plan for those experts
    (kernels/triton/fp8_tma_moe.py FUSED_PLANS), and only while the variant's engine is built."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from tandem.kernels.triton import fp8_tma_moe
    f = tmp_path / "fused.json"
    f.write_text(json.dumps({"walks": [{"what": "fused (2048, 768, 8)", "best": {"STAGES": 6}}]}))
    assert fp8_tma_moe.fused_plan(2048, 768, 8, 132)["STAGES"] == 11
    with ab_decode.plans_installed(ab_decode.tuned_plans(f"plans={f}")):
        assert fp8_tma_moe.fused_plan(2048, 768, 8, 132)["STAGES"] == 6
    assert fp8_tma_moe.fused_plan(2048, 768, 8, 132)["STAGES"] == 11 and not fp8_tma_moe.FUSED_PLANS
