"""benchmarks.roofline.RoutedExperts on CPU with a tiny MoE: it keeps the routers' outputs (and
nothing else of the same width) made while a stream captures, and counts the distinct experts
their top-k picks, which sets the MoE step's HBM floor at batch > 1. CPU engines capture no
graphs, so the capture check is forced on for the forward passes here."""
import pytest
import torch

from benchmarks import roofline

# num_experts == hidden_size: o_proj's and the experts' outputs are as wide as the routers', and must not be kept
TINY = dict(roofline.MODELS["qwen3-30b-a3b"], hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=64,
            num_experts_per_tok=4, vocab_size=1024)


def _decode_tokens(llm, batch: int) -> None:
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest

    core = llm.engine
    for i in range(batch):
        core.add_request(EngineRequest(f"r{i}", [(i * 37 + j) % 1000 + 1 for j in range(6 + i)],
                                       SamplingParams(max_tokens=1, temperature=0)))
    while core.has_unfinished_requests():
        core.step()


def test_counts_the_distinct_experts_the_routers_pick(monkeypatch):
    monkeypatch.setitem(roofline.MODELS, "tiny-moe", TINY)
    llm = roofline.build("tiny-moe", device="cpu", max_num_batched_tokens=256, max_num_seqs=8, max_model_len=64,
                         async_scheduling=False)
    routers = [m.gate for m in llm.engine.runner.model.modules() if type(m).__name__ == "FusedMoE"]
    assert len(routers) == TINY["num_hidden_layers"]
    seen = []
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append(out)) for r in routers]
    routed = roofline.RoutedExperts(TINY["num_experts"], TINY["num_experts_per_tok"])
    with routed:
        _decode_tokens(llm, 3)  # not capturing: nothing kept
        assert routed.logits == {}
        monkeypatch.setattr(routed, "_capturing", lambda out: True)
        seen.clear()
        _decode_tokens(llm, 5)
    for h in hooks:
        h.remove()
    kept = [t for ts in routed.logits.values() for t in ts]
    assert len(kept) == len(seen) and all(any(k is s for s in seen) for k in kept)  # the routers' outputs only
    rows = seen[-1].shape[0]
    counts = routed.counts(rows, TINY["num_hidden_layers"])
    want = [len(set(torch.topk(t.float(), TINY["num_experts_per_tok"], dim=1).indices.flatten().tolist()))
            for t in seen[-TINY["num_hidden_layers"]:]]
    assert counts == want and all(TINY["num_experts_per_tok"] <= c <= TINY["num_experts"] for c in counts)
    with pytest.raises(RuntimeError, match="router outputs captured"):
        routed.counts(rows + 1000, TINY["num_hidden_layers"])
    # one token picks its top-k, router output or not (route_token's logits stay in its kernel)
    assert roofline.RoutedExperts(TINY["num_experts"], 2).counts(1, 3) == [2, 2, 2]
    # the floor's weight bytes grow with the experts counted, from one token's top-k up to all of them
    runner = llm.engine.runner
    one, counted, every = (roofline.param_bytes(runner, e) for e in
                           (TINY["num_experts_per_tok"], sum(counts) / len(counts), TINY["num_experts"]))
    assert one <= counted <= every == roofline.param_bytes(runner)
