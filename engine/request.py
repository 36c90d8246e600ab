"""A request inside the engine and its state machine."""
import enum
import time

import torch

from tandem.engine.protocol import RequestTimes, TokenLogprobs
from tandem.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # decode side of PD: prompt KV still arriving
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks freed; recomputed when rescheduled
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Token ids, progress and KV blocks of one sequence.

    num_computed_tokens counts tokens whose KV is in the cache; the tokens still to
    run are all_token_ids[num_computed_tokens:].
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, kv_transfer_params=None,
                 max_tokens: int = 0, device: str = "cpu"):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved against max_model_len by the engine
        self.arrival_time = arrival_time or time.time()
        self.kv_transfer_params = kv_transfer_params  # connectors.params.KVTransferParams | None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first schedule
        self.block_ids: list[int] = []
        self.block_row = None  # the model runner's int32 copy of block_ids (see ModelRunner._block_row)
        self.block_hashes: list[int] = []  # prefix-cache keys of full blocks, filled lazily
        self.stop_reason: int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        # Built chunk by chunk during prefill; positions already filled are not recomputed
        # after a preemption. None when not asked for.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.remote_computed_tokens = 0  # PD decode side: tokens whose KV arrives remotely
        self.kv_transfer_params_out: dict | None = None  # PD: returned to the client when finished
        self.first_token_logprobs: TokenLogprobs | None = None  # PD: the prefill hands them to the decode
        self.held_first_output = None  # PD decode: the prefill's first token, out with the first step
        self.skipped_draws = 0  # PD decode: draws the prefill took from the generator (see sampler)
        self.grammar = None  # xgrammar GrammarMatcher when the output is constrained (set by EngineCore)
        # engine clock (time.monotonic) at each phase's start, for RequestTimes (see times())
        self.queued_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.kv_wait_at: float | None = None
        self.kv_wait: float | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def wait_for_kv(self) -> None:
        """Its prompt KV starts arriving (WAITING_FOR_REMOTE_KVS)."""
        self.kv_wait_at = time.monotonic()

    def kv_done(self) -> None:
        """Its prompt KV landed (or failed): schedulable from now."""
        self.queued_at = time.monotonic()
        self.kv_wait = self.queued_at - self.kv_wait_at

    def times(self) -> RequestTimes:
        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else b - a
        return RequestTimes(
            queue=span(self.queued_at, self.scheduled_at), prefill=span(self.scheduled_at, self.first_token_at),
            decode=span(self.first_token_at, self.last_token_at), inference=span(self.scheduled_at, self.last_token_at),
            kv_transfer_wait=self.kv_wait if self.kv_wait is not None else span(self.kv_wait_at, time.monotonic()))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
