"""Offline batched generation: `LLM(model_dir).generate(prompts, params)`."""
from dataclasses import dataclass, field

from tqdm import tqdm

from tandem.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.protocol import EngineRequest, TokenLogprobs
from tandem.engine.sampling_params import SamplingParams


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


class LLM:
    """Keyword arguments are EngineConfig fields (the CLI flag names with '_')."""

    def __init__(self, model: str = DEFAULT_MODEL_DIR, **kwargs):
        config = EngineConfig.create(model=model, **kwargs)
        if config.parallel.data_parallel_size > 1:
            raise ValueError("LLM runs one engine; --data-parallel-size > 1 runs one engine core per rank "
                             "in the server (`server --data-parallel-size N`)")
        self.engine = EngineCore(config)
        self._tokenizer = None
        self._counter = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.engine.tokenizer_path)
        return self._tokenizer

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationOutput]:
        """Prompts are strings (tokenized with the model's tokenizer) or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerationOutput] = {}
        order = []
        for prompt, p in zip(prompts, param_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(self._counter)
            self._counter += 1
            self.engine.add_request(EngineRequest(rid, ids, p))
            results[rid] = GenerationOutput(rid, ids)
            order.append(rid)
        with tqdm(total=len(order), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    r = results[o.request_id]
                    r.token_ids.extend(o.new_token_ids)
                    if o.new_logprobs is not None:
                        r.logprobs = (r.logprobs or []) + o.new_logprobs
                    if o.prompt_logprobs is not None:
                        r.prompt_logprobs = o.prompt_logprobs
                    r.num_cached_tokens = o.num_cached_tokens
                    if o.finished:
                        r.finish_reason = o.finish_reason
                        bar.update(1)
        out = [results[rid] for rid in order]
        if any(isinstance(p, str) for p in prompts):
            for r in out:
                r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        return out
