"""Sampling: seeded reproducibility, the filters against direct computation, stop conditions."""
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.request import Request
from tandem.engine.sampler import SamplingBatch, sample


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], block_size=4)


def test_seeded_sampling_reproducible_across_batches(llm):
    prompt = [11, 12, 13, 14, 15]
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], p)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True) for n, s in [(5, 1), (20, None)]]
    batched = llm.generate([[3, 4], prompt, list(range(30, 60))], [others[0], p, others[1]])
    assert batched[1].token_ids == alone
    again = llm.generate([list(range(30, 60)), prompt], [others[1], p])
    assert again[1].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50,
                                                       seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def _rows(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingBatch:
    reqs = []
    for i, p in enumerate(params):
        r = Request(str(i), [1, 2, 3], p)
        r.all_token_ids += (outputs[i] if outputs else [])
        reqs.append(r)
    return SamplingBatch.build(reqs, 8, torch.device("cpu"))


LOGITS = torch.tensor([[4.0, 3.0, 2.5, 1.0, 0.0, -1.0, -2.0, -3.0]])


def _draws(params: SamplingParams, n: int = 300) -> set[int]:
    b = _rows([params])
    b.requests[0].generator = torch.Generator().manual_seed(0)
    return {int(sample(LOGITS.clone(), b, set())[0][0]) for _ in range(n)}


def test_filters_restrict_support():
    probs = LOGITS.softmax(-1)[0]
    assert _draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # top_p: keep the smallest prefix whose mass reaches p.
    mass2 = float(probs[:2].sum())
    assert _draws(SamplingParams(temperature=1.0, top_p=mass2 - 1e-3)) == {0, 1}
    # min_p: keep tokens with prob >= min_p * max prob.
    min_p = float(probs[2] / probs[0]) - 1e-3
    assert _draws(SamplingParams(temperature=1.0, min_p=min_p)) == {0, 1, 2}
    assert len(_draws(SamplingParams(temperature=5.0))) >= 6


def test_greedy_ignores_filters_and_penalties_apply():
    b = _rows([SamplingParams(temperature=0, top_k=2, top_p=0.5)])
    assert b.temperature is None and b.top_k is None  # an all-greedy batch builds no tensors
    assert int(sample(LOGITS.clone(), b, set())[0][0]) == 0
    mixed = _rows([SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2)])
    assert mixed.temperature.tolist() == [0.0, 1.0] and mixed.top_k.tolist() == [8, 2]
    toks, _ = sample(LOGITS.repeat(2, 1), mixed, set())
    assert int(toks[0]) == 0 and int(toks[1]) in (0, 1)
    # frequency penalty 2 on token 0 seen twice: 4 - 4 = 0 < 3 -> token 1 wins.
    b = _rows([SamplingParams(temperature=0, frequency_penalty=2.0)], [[0, 0]])
    assert int(sample(LOGITS.clone(), b, set())[0][0]) == 1
    # presence penalty counts once: 4 - 1.5 = 2.5 < 3 -> token 1.
    b = _rows([SamplingParams(temperature=0, presence_penalty=1.5)], [[0, 0, 0]])
    assert int(sample(LOGITS.clone(), b, set())[0][0]) == 1


def test_min_tokens_masks_eos_and_stop_tokens():
    b = _rows([SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])], [[5]])
    tok, _ = sample(LOGITS.clone(), b, eos_token_ids={0})
    assert int(tok[0]) == 2


def test_stop_token_ids_and_min_tokens_end_to_end(llm):
    prompt = [11, 12, 13, 14, 15]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    stop = free[3]
    first = free.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    late = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop],
                                                 min_tokens=first + 1))[0]
    assert len(late.token_ids) > first + 1


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                    dict(min_p=2), dict(min_tokens=5, max_tokens=2), dict(logprobs=-1),
                                    dict(repetition_penalty=0)])
def test_invalid_params_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
