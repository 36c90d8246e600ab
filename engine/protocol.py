"""Messages between the engine core and its clients (the offline LLM, the API process).

msgspec structs so the API process and the engine core process exchange them as
compact msgpack frames over ZMQ.
"""
import msgspec

from tandem.connectors.params import KVTransferParams
from tandem.engine.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # PD disaggregation: set by the router, read by the KV connector (see connectors/params.py).
    kv_transfer_params: KVTransferParams | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: token_ids[0]/logprobs[0] is the actual token (sampled or
    prompt), the rest are the top-N in descending order. rank = 1-based rank of the actual token."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class RequestTimes(msgspec.Struct, omit_defaults=True, array_like=True):
    """Where a finished request's time went inside the engine, seconds (vLLM's request_*_time
    metrics; None: the phase never began). queue: from schedulable (arrival, or its remote KV
    landed) to first scheduled; prefill: first scheduled to the first token this engine sampled;
    decode: that token to the last; inference: first scheduled to the last token; kv_transfer_wait: a PD
    decode's wait for its prompt KV (WAITING_FOR_REMOTE_KVS)."""

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    inference: float | None = None
    kv_transfer_wait: float | None = None


class RequestOutput(msgspec.Struct, omit_defaults=True):
    """What one request produced in one engine step (a delta, not the whole text so far)."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    # Sent once, with the first output: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None
    times: RequestTimes | None = None  # with the finishing output


class SchedulerStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_remote_kvs: int = 0
    num_preempted_total: int = 0
    num_remote_prefills_total: int = 0  # requests whose prompt KV came from a prefill instance
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_kernel_compilations_after_ready: int = 0  # Triton JIT variants first met while serving (rank 0)
