"""Reference: Hugging Face transformers (float32), greedy decoding by full recompute and
log_softmax of its logits. Every scenario also checks that all KV blocks are free afterwards."""
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tests.engine.conftest import ARCHS

GEN = 12
PROMPTS = [
    [7, 19, 3],
    [int(t) for t in torch.randint(3, 300, (41,), generator=torch.Generator().manual_seed(1))],
    [5] * 18,
    [200],
    [int(t) for t in torch.randint(3, 300, (27,), generator=torch.Generator().manual_seed(2))],
]


def hf_reference(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the log-softmax at every position of prompt + generated."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return ids[len(prompt):], logprobs


@pytest.fixture(scope="module")
def references(tiny_models):
    return {arch: [hf_reference(tiny_models[arch][1], p, GEN) for p in PROMPTS] for arch in ARCHS}


def assert_all_blocks_free(llm: LLM) -> None:
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not llm.engine.scheduler.requests and not llm.engine.scheduler.running


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption", "prefix_cache"])
def test_greedy_tokens_match_hf(tiny_models, references, arch, scenario):
    path, _ = tiny_models[arch]
    ref_tokens = [r[0] for r in references[arch]]
    if scenario == "chunked_prefill":
        llm = LLM(path, block_size=4, max_num_batched_tokens=8)
    elif scenario == "preemption":
        # 14 blocks of 4 tokens hold the longest request (53 tokens) but not all five at once.
        llm = LLM(path, block_size=4, num_gpu_blocks_override=14, max_num_batched_tokens=32)
    else:
        llm = LLM(path, block_size=4)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == ref_tokens
    assert all(o.finish_reason == "length" for o in outs)
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preempted_total > 0
    if scenario == "prefix_cache":
        again = llm.generate(PROMPTS, greedy())
        assert [o.token_ids for o in again] == ref_tokens
        # Every full block of each prompt (all but the last token) comes from the cache.
        assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]
        assert llm.engine.blocks.prefix_hits > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logprobs_match_hf(tiny_models, references, arch):
    path, _ = tiny_models[arch]
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, greedy(logprobs=5, prompt_logprobs=3))
    for prompt, out, (ref_tokens, ref_lp) in zip(PROMPTS, outs, references[arch]):
        assert out.token_ids == ref_tokens
        seq = prompt + ref_tokens
        # Generated token i sits at position len(prompt)+i and is predicted from the row before.
        for i, lp in enumerate(out.logprobs):
            row = ref_lp[len(prompt) + i - 1]
            assert lp.token_ids[0] == ref_tokens[i]
            assert abs(lp.logprobs[0] - row[ref_tokens[i]].item()) < 1e-4
            top = row.topk(5)
            assert lp.token_ids[1:] == top.indices.tolist()
            assert torch.allclose(torch.tensor(lp.logprobs[1:]), top.values, atol=1e-4)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            lp, row = out.prompt_logprobs[j], ref_lp[j - 1]
            assert lp.token_ids[0] == seq[j]
            assert abs(lp.logprobs[0] - row[seq[j]].item()) < 1e-4
            assert lp.rank == int((row > row[seq[j]]).sum()) + 1
            assert torch.allclose(torch.tensor(lp.logprobs[1:]), row.topk(3).values, atol=1e-4)
    assert_all_blocks_free(llm)


def test_repetition_penalty_matches_hf(tiny_models):
    path, model = tiny_models["llama"]
    prompt = PROMPTS[1]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=GEN, do_sample=False, repetition_penalty=1.5,
                         min_new_tokens=GEN, pad_token_id=0)[0, len(prompt):].tolist()
    out = LLM(path).generate([prompt], greedy(repetition_penalty=1.5))[0]
    assert out.token_ids == ref
