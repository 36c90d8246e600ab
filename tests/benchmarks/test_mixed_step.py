"""benchmarks.mixed_step on CPU with a tiny MoE: the steps it times hold what its table says they
hold (D decode rows and C prompt tokens in a mixed step, each part alone otherwise). No timing is
asserted."""
from benchmarks import mixed_step, roofline

TINY = dict(roofline.MODELS["qwen3-30b-a3b"], hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, vocab_size=32000)


def test_mixed_steps_hold_the_decodes_and_the_chunk(monkeypatch):
    monkeypatch.setitem(roofline.MODELS, "tiny-moe", TINY)
    decodes, chunk, context, steps = 4, 48, 100, 3
    llm = roofline.build("tiny-moe", device="cpu", max_num_batched_tokens=64, max_num_seqs=16,
                         max_model_len=context + 4 * steps + 64, async_scheduling=False)
    m = mixed_step.measure(llm.engine, decodes, chunk, context, steps, seed=1)
    assert m["shapes"] == {"decode": (decodes, 0), "mixed": (decodes, chunk), "prefill": (0, chunk)}
    assert all(t > 0 for t in m["seconds"].values())
    assert not llm.engine.has_unfinished_requests()  # every request of the run was cleared
