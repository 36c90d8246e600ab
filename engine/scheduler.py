"""Continuous batching with one token budget per step.

Each step: running requests first (decodes before unfinished prefills), then
waiting ones, until `max_num_batched_tokens` or `max_num_seqs` is reached; long
prompts are chunked. When blocks run out, the newest running request is
preempted (blocks freed, recomputed later). A KV connector, when present, is
asked at fixed points: on admission (are prompt tokens coming from a remote
instance?), once per step (which transfers finished?), and on finish (hold the
blocks until a transfer completes?).
"""
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from tandem.connectors.stages import side_of, stamp
from tandem.engine.block_manager import BlockManager
from tandem.engine.config import SchedulerConfig
from tandem.engine.protocol import RequestOutput, SchedulerStats, TokenLogprobs
from tandem.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def _side(req: Request) -> str:
    """req's place in a PD pair, for stage stamps (a decode's params are dropped once its KV landed)."""
    return "decode" if req.remote_computed_tokens else side_of(req.kv_transfer_params)


class SchedulerConnector(Protocol):
    """A KV connector as the engine sees it (see connectors/)."""

    recompute_on_failure: bool  # a failed receive falls back to computing the prompt locally
    # a remote prefill's first token goes to the client with the request's first step here (True), or
    # as soon as it arrives (False: earlier, but the gap to the next token then holds the KV's wait too)
    first_token_at_step: bool

    def num_remote_tokens(self, req: Request, num_local_computed: int) -> int:
        """Prompt tokens past num_local_computed whose KV will arrive from a remote instance."""

    def on_blocks_allocated(self, req: Request, num_remote_tokens: int) -> None:
        """req now owns blocks for those tokens; start (or announce) the transfer."""

    def ready(self, req: Request) -> bool:
        """May req start computing now? (False: its transfer already ended; poll says why.)"""

    def poll(self) -> tuple[set[str], dict[str, str], set[str]]:
        """(ids whose remote KV landed, {id: error} for failed transfers of requests that wait or
        run, ids whose sends finished)."""

    def take_first_tokens(self) -> dict[str, tuple[int, list | None]]:
        """{id: (first output token, its logprobs as [token_ids, logprobs, rank] or None)} that
        remote prefills sampled for requests receiving their prompt KV, since the last call."""

    def on_request_finished(self, req: Request) -> tuple[bool, dict | None]:
        """(keep blocks until a send completes?, kv_transfer_params for the client)."""

    def build_meta(self, scheduled: list[tuple[Request, int]]):
        """What this step transfers (sent with the step to every rank's worker side), or None."""

    def wait(self, timeout_s: float) -> None:
        """Idle engine with transfers in flight: return after timeout_s, or as soon as a peer's
        message (block ids, a first token, a finished transfer) may let it make progress."""

    def close(self) -> None: ...


@dataclass
class SchedulerOutput:
    """Requests to run this step and how many new tokens each; decodes first."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_model_len: int,
                 eos_token_ids: set[int], connector: SchedulerConnector | None = None):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.sending: dict[str, Request] = {}  # finished, blocks held for a KV send
        self.pending_outputs: list[RequestOutput] = []
        self.num_preempted_total = 0
        self.num_remote_prefills_total = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort_requests(self, request_ids) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, req: Request, message: str) -> None:
        req.error = message
        self._finish(req, RequestStatus.FINISHED_ERROR)

    def can_admit(self) -> bool:
        """A waiting request could start now (one not still waiting for its remote KV, and room
        for another sequence)."""
        return len(self.running) < self.config.max_num_seqs and any(
            r.status != RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.pending_outputs)

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs made without a forward pass since the last update (a PD decode's forwarded first
        token, aborts, failed transfers); update() would return them first otherwise."""
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Move req to a finished state, free (or hold for a send) its blocks, queue its output."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        del self.requests[req.request_id]
        kv_params = None
        hold = False
        if self.connector is not None:
            hold, kv_params = self.connector.on_request_finished(req)
        if hold:
            self.sending[req.request_id] = req
        else:
            self.blocks.free_blocks(req.block_ids)
            req.block_ids = []
        req.kv_transfer_params_out = kv_params
        # Stops and length limits are reported with their last token by update().
        if status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.pending_outputs.append(self._output(req, [], None, kv_params))

    # ---- scheduling ----------------------------------------------------------------------

    def _take_first_tokens(self) -> None:
        """PD decode: emit each prefill's first output token as this request's first output; once
        the KV of the whole prompt is in, the request's first step decodes it."""
        for rid, (token_id, logprobs) in self.connector.take_first_tokens().items():
            req = self.requests.get(rid)
            if req is None or req.num_output_tokens:
                continue
            lp = None if logprobs is None else TokenLogprobs(*logprobs)
            stamp(logger, "decode", "core.first_token_fwd", rid)
            req.all_token_ids.append(token_id)
            req.first_token_logprobs = lp
            req.skipped_draws = 1  # the prefill drew from the request's seeded generator once
            status = self._check_stop(req, token_id)
            if not self._grammar_accepts(req, token_id):  # the prefill's grammar should have masked it
                req.all_token_ids.pop()
                self.fail_request(req, f"the prefill's first token {token_id} is not accepted by the request's "
                                       "output grammar (do both sides run the same model and tokenizer?)")
                continue
            if status is not None:
                self._finish(req, status)
            output = self._output(req, [token_id], [lp] if lp else None, req.kv_transfer_params_out)
            if status is None and self.connector.first_token_at_step and req.status != RequestStatus.RUNNING:
                req.held_first_output = output  # out with the step that computes the next token (_admit)
            else:
                self.pending_outputs.append(output)

    def poll_connector(self) -> None:
        """PD: take forwarded first tokens, free blocks whose send is confirmed, end failed
        transfers' requests, and make requests whose KV landed schedulable (WAITING)."""
        self._take_first_tokens()
        landed, failed, sent = self.connector.poll()
        for rid in sent:
            req = self.sending.pop(rid, None)
            if req is not None:
                self.blocks.free_blocks(req.block_ids)
                req.block_ids = []
        for rid, error in failed.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and self.connector.recompute_on_failure:
                logger.warning("%s: %s; computing the prompt locally", rid, error)
                req.kv_done()
                self.blocks.free_blocks(req.block_ids)
                req.block_ids, req.num_computed_tokens = [], 0
                req.kv_transfer_params = None
                req.status = RequestStatus.WAITING
            else:  # (a write-mode prefill may be running: it computes while its transfer waits)
                self.fail_request(req, error)
        for req in list(self.waiting):
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.request_id in landed:
                stamp(logger, "decode", "core.kv_landed", req.request_id)
                req.kv_done()
                req.num_computed_tokens = req.remote_computed_tokens
                self.blocks.cache_full_blocks(req)
                req.status = RequestStatus.WAITING
                req.kv_transfer_params = None  # received; a preempted request recomputes locally

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free_blocks(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preempted_total += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        if self.connector is not None:
            self.poll_connector()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = False
        # Decodes first, then unfinished prefills (chunks), oldest first within each.
        self.running.sort(key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.arrival_time))
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.blocks.allocate(req, n):
                victim = max(self.running, key=lambda r: r.arrival_time)
                out.scheduled = [(r, k) for r, k in out.scheduled if r is not victim]
                budget = self.config.max_num_batched_tokens - out.num_tokens
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
        if preempted:
            return out
        skipped: list[Request] = []
        # Waiting requests that hold blocks (remote KV arriving or landed) count as sequences, so
        # blocks handed out for remote KV never exceed what max_num_seqs running requests hold.
        holders = sum(1 for r in self.waiting if r.block_ids)
        blocked = False  # a request without blocks could not start: only holders may pass it now
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            holds = bool(req.block_ids)
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS or (blocked and not holds):
                skipped.append(req)
                continue
            fresh = req.num_computed_tokens == 0
            if fresh and self.connector is not None and not self.connector.ready(req):
                skipped.append(req)
                continue
            if not holds and len(self.running) + holders >= self.config.max_num_seqs:
                skipped.append(req)
                blocked = True
                continue
            if not self._admit(req, budget, out):
                # A landed remote-KV request behind this one holds its blocks and needs none more
                # (_admit gave it one token's room): it must not wait behind, or nothing frees.
                skipped.append(req)
                blocked = True
                continue
            holders += (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS) - holds
            budget = self.config.max_num_batched_tokens - out.num_tokens
        self.waiting.extendleft(reversed(skipped))
        return out

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> bool:
        """Try to start req (False: not now). Remote-KV requests only get blocks this step."""
        fresh = req.num_computed_tokens == 0
        cached = self.blocks.find_cached_prefix(req) if fresh else []
        num_local = req.num_computed_tokens + len(cached) * self.blocks.block_size
        num_remote = 0
        if fresh and self.connector is not None:
            num_remote = self.connector.num_remote_tokens(req, num_local)
        if num_remote:  # room for the first output token too: once landed, it starts without new blocks
            if not self.blocks.allocate(req, num_remote + 1, cached):
                return False
            req.num_cached_tokens = len(cached) * self.blocks.block_size
            req.remote_computed_tokens = num_local + num_remote
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            req.wait_for_kv()
            self.num_remote_prefills_total += 1
            self.connector.on_blocks_allocated(req, num_remote)
            stamp(logger, "decode", "core.wait_kv", req.request_id)
            self.waiting.append(req)
            self._take_first_tokens()  # read mode: it came with the request
            return True
        n = req.num_tokens - num_local
        if n > budget and not self.config.enable_chunked_prefill:
            return False
        n = min(n, budget)
        if not self.blocks.allocate(req, n, cached):
            return False
        if fresh:
            req.num_cached_tokens = len(cached) * self.blocks.block_size
            stamp(logger, _side(req), "core.scheduled", req.request_id)
        req.status = RequestStatus.RUNNING
        if req.scheduled_at is None:  # (a preempted request keeps its first)
            req.scheduled_at = time.monotonic()
        if req.held_first_output is not None:  # a PD decode's first token: out before this step runs
            self.pending_outputs.append(req.held_first_output)
            req.held_first_output = None
        self.running.append(req)
        out.scheduled.append((req, n))
        return True

    # ---- results -------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken],
               prompt_logprobs: dict[str, list[TokenLogprobs | None]]) -> list[RequestOutput]:
        """Apply one step's results: advance, append sampled tokens, check stops, emit deltas."""
        outputs = self.take_pending_outputs()
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += n
            self.blocks.cache_full_blocks(req)
            if req.request_id in prompt_logprobs:
                req.prompt_logprobs.extend(prompt_logprobs[req.request_id])
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            send_prompt_logprobs = req.num_output_tokens == 0 and req.prompt_logprobs is not None
            req.all_token_ids.append(tok.token_id)
            req.last_token_at = time.monotonic()
            if req.first_token_at is None:
                req.first_token_at = req.last_token_at
            if req.num_output_tokens == 1:
                req.first_token_logprobs = tok.logprobs  # (a PD prefill hands it to the decode)
                stamp(logger, _side(req), "core.first_token", req.request_id)
            status = self._check_stop(req, tok.token_id)
            if not self._grammar_accepts(req, tok.token_id):
                req.error = f"token {tok.token_id} broke the request's output grammar"
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                self._finish(req, status)
            outputs.append(self._output(
                req, [tok.token_id], [tok.logprobs] if tok.logprobs else None, req.kv_transfer_params_out,
                req.prompt_logprobs if send_prompt_logprobs else None))
        return outputs

    @staticmethod
    def _grammar_accepts(req: Request, token: int) -> bool:
        """Advance req's grammar matcher (if any) with its newly appended output token; False
        when the grammar rejects it. Sampled and PD-forwarded first tokens both come through here."""
        grammar = req.grammar
        return grammar is None or grammar.is_terminated() or grammar.accept_token(token)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        # The sampler masks EOS and stop tokens until min_tokens, so no count check here.
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request, new_tokens: list[int], new_logprobs, kv_params,
                prompt_logprobs=None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_tokens, new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs, finished=req.status.finished,
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            kv_transfer_params=kv_params, error=req.error, times=req.times() if req.status.finished else None)

    def stats(self) -> SchedulerStats:
        remote = sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting) - remote,
            num_waiting_for_remote_kvs=remote, num_preempted_total=self.num_preempted_total,
            num_remote_prefills_total=self.num_remote_prefills_total,
            num_free_blocks=self.blocks.num_free_blocks, num_total_blocks=self.blocks.num_blocks,
            kv_cache_usage=self.blocks.usage, prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits)
