"""EngineCore: the in-process engine (scheduler + KV blocks + model runner), driven by step().

The offline LLM and the server's engine-core process both wrap this class.
"""
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tandem.connectors.params import parse_kv_transfer_params
from tandem.engine.block_manager import BlockManager
from tandem.engine.config import EngineConfig
from tandem.engine.hf_config import load_hf_config
from tandem.engine.loader import eos_token_ids, resolve_max_model_len
from tandem.engine.model_runner import ModelRunner, PendingStep
from tandem.engine.protocol import EngineRequest, RequestOutput, SchedulerStats
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.structured_output import GrammarCompiler
from tandem.engine.worker import (Workers, broadcast_step, data_parallel_device, init_data_parallel, init_distributed,
                           leave_distributed, local_device)
from tandem.kernels.compile_watch import WATCH

logger = logging.getLogger(__name__)


def _async_safe(req: Request) -> bool:
    """Can req's step be launched and its token read later? (Logprobs and penalties need the
    host while sampling; a grammar's next mask needs the token just sampled.)"""
    p = req.params
    return p.logprobs is None and p.prompt_logprobs is None and not p.needs_penalties and req.grammar is None


class EngineCore:
    """dp_rank: this engine's data-parallel rank (--data-parallel-size > 1). Each DP rank is an
    EngineCore of its own (own scheduler, KV cache and GPU); with expert parallelism the ranks
    step in lockstep (see `step`)."""

    def __init__(self, config: EngineConfig, dp_rank: int = 0):
        config.parallel.validate(config.kv_transfer.enabled)
        WATCH.install()  # before the model runner compiles anything (kernels/compile_watch.py)
        self.async_scheduling = config.scheduler.async_scheduling is not False  # None: on
        self.config = config
        self.dp_rank, self.dp_size = dp_rank, config.parallel.data_parallel_size
        self._dp_group = None  # gloo group of the lockstep DP ranks (expert parallel only)
        self._dp_busy = True  # any DP rank had work at the last step (unknown: step to find out)
        self.hf_config = load_hf_config(config.model.model)
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(config.model.model, self.hf_config)
        self.tokenizer_path = config.model.tokenizer or config.model.model
        self.workers, self._broadcast = None, None
        try:
            self._start(config, dp_rank)
        except BaseException:
            # a start that failed (a checkpoint this TP size cannot split, a port in use): the other
            # ranks go too, and their watchdog with them, which would otherwise take this process down
            # when they exit (an offline LLM's host: a test run, a notebook) after the error is handled
            if self.workers is not None:
                self.workers.abort()
                leave_distributed()
            raise
        if self.workers is not None:
            self.workers.arm()

    def _start(self, config: EngineConfig, dp_rank: int) -> None:
        device = None
        group = None
        if config.parallel.tensor_parallel_size > 1:
            if config.parallel.node_rank != 0:
                raise ValueError("the engine core runs on node 0; other nodes run only workers")
            self.workers = Workers(config, self.max_model_len, include_rank0=False)
            group = init_distributed(config, 0)
            self._broadcast = lambda inputs: broadcast_step(group, inputs)
            device = local_device(config, 0)
        elif self.dp_size > 1:
            device = data_parallel_device(config, dp_rank)
            if config.parallel.lockstep_dp:
                self._dp_group = init_data_parallel(config, dp_rank)
        self.runner = ModelRunner(config, self.hf_config, self.max_model_len, device)
        self.blocks = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len, self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer_path, self.vocab_size, self.eos_token_ids)
        self.connector = None  # the KV connector's scheduler side (PD disaggregation)
        self._inflight: PendingStep | None = None  # --async-scheduling: the step on the GPU now
        # Where outputs known before a forward pass go at once (the core process sends them to the
        # API process) instead of waiting for that pass; None: step() returns them (offline LLM).
        self.emit_early: Callable[[list[RequestOutput]], None] | None = None
        if config.kv_transfer.enabled:
            from tandem.connectors import build_connector
            connector, self.runner.kv_worker = build_connector(config, self.runner, self.hf_config, group)
            self.set_connector(connector)
        logger.info("engine ready: %s, max_model_len=%d, %d KV blocks, async scheduling %s",
                    type(self.runner.model).__name__, self.max_model_len, self.blocks.num_blocks,
                    "on" if self.async_scheduling else "off")
        WATCH.mark_ready()

    def set_connector(self, connector) -> None:
        """Attach a KV connector's scheduler side (PD disaggregation); its worker side is the
        runner's kv_worker on every rank."""
        assert self._inflight is None
        self.connector = connector
        self.scheduler.connector = connector

    def validate(self, req: EngineRequest) -> int:
        """Raise ValueError for a request the engine cannot serve; return its resolved max_tokens."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}")
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        max_tokens = req.sampling_params.max_tokens
        if n + (max_tokens or 1) > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"has {n} tokens and {max_tokens or 1} more were requested")
        if -(-(n + (max_tokens or 1)) // self.blocks.block_size) > self.blocks.num_blocks:
            raise ValueError(f"the request needs more KV cache blocks than the engine has ({self.blocks.num_blocks})")
        return max_tokens if max_tokens is not None else self.max_model_len - n

    def add_request(self, req: EngineRequest) -> None:
        max_tokens = self.validate(req)
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.arrival_time or time.time(),
                          parse_kv_transfer_params(req.kv_transfer_params), max_tokens, device=str(self.runner.device))
        if req.sampling_params.structured_outputs is not None:  # compiled once per grammar (cached): ms
            request.grammar = self.grammars.matcher(req.sampling_params.structured_outputs)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_async()
        return self._execute(self.scheduler.schedule(), [])

    def _execute(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Run `out` and wait for it (the synchronous step); returns `outputs` + its outputs."""
        sampled, prompt_logprobs = {}, {}
        if out.scheduled:
            outputs = self._emit_early(outputs)
        if self._dp_group is not None:
            sampled, prompt_logprobs = self._lockstep_execute(out)
        elif out.scheduled:
            sampled, prompt_logprobs = self.runner.execute(out, self.eos_token_ids, self._kv_meta(out),
                                                           self._broadcast)
        else:
            self._kv_only_step(self._kv_meta(out))
        outputs += self.scheduler.update(out, sampled, prompt_logprobs)
        if not out.scheduled and not outputs and self._dp_group is None:
            # only KV transfers in flight: poll them without spinning a core, woken by their news
            if self.connector is not None:
                self.connector.wait(0.001)
            else:
                time.sleep(0.001)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """--async-scheduling: keep the GPU busy while the host finishes the step before.

        A step is launched and its tokens are read one call later. When the step in flight is
        a plain decode of every running request (and nothing else could be scheduled), the next
        decode step is launched first, its input tokens read on the device, and only then are
        the in-flight tokens brought to the host and applied: the host's scheduling, input
        preparation, output handling and launch overlap the GPU's work. A request that stops
        on the in-flight token (EOS, a stop token) has one wasted step computed, whose token is
        dropped; its blocks are freed by then but stream order keeps their next owner's writes
        after it. Outputs are those of the synchronous engine, one call later. (The wasted step
        runs a batch one larger than the synchronous engine would; on a GPU a different GEMM
        shape may round differently, as any change of batch composition may.)"""
        prev, self._inflight = self._inflight, None
        if prev is not None and self._continues(prev):
            self._launch(SchedulerOutput([(req, 1) for req, _ in prev.out.scheduled]), prev)
            return self.scheduler.update(prev.out, self.runner.collect(prev), {})
        outputs = self.scheduler.update(prev.out, self.runner.collect(prev), {}) if prev is not None else []
        out = self.scheduler.schedule()
        # (lockstep ranks launch even with nothing scheduled: every step() agrees exactly once)
        if (out.scheduled or self._dp_group is not None) and all(_async_safe(req) for req, _ in out.scheduled):
            outputs = self._emit_early(outputs)
            self._launch(out)
            return outputs + self.scheduler.update(SchedulerOutput(), {}, {})  # aborts etc. now
        return self._execute(out, outputs)

    def _emit_early(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Before a forward pass: hand `outputs` and the scheduler's pending ones (a PD decode's
        forwarded first token: its TTFT) to emit_early now; returns what is left for step()."""
        if self.emit_early is None:
            return outputs
        outputs = outputs + self.scheduler.take_pending_outputs()
        if outputs:
            self.emit_early(outputs)
        return []

    def _kv_meta(self, out: SchedulerOutput):
        """What this step transfers (KVStepMeta, for every rank), or None."""
        return self.connector.build_meta(out.scheduled) if self.connector is not None else None

    def _kv_only_step(self, meta) -> None:
        """A step with transfers but no batch: hand them to every rank all the same."""
        if meta is None:
            return
        if self._broadcast is not None:
            self._broadcast(meta)
        self.runner.kv_worker.start(meta)

    def _launch(self, out: SchedulerOutput, prev: PendingStep | None = None) -> None:
        """Launch `out` (see _step_async); lockstep DP ranks first agree on its padded size."""
        pad_to, eager = 0, False
        if self._dp_group is not None:
            pad_to, eager = self._agree(out)
            if pad_to == 0:
                return
        self._inflight = self.runner.launch(out, self.eos_token_ids, prev, pad_to=pad_to, force_eager=eager,
                                            broadcast=self._broadcast, kv_meta=self._kv_meta(out))

    def _continues(self, prev: PendingStep) -> bool:
        """May the next decode step of prev's requests launch before prev's tokens are known?
        Only if it is exactly what the scheduler would pick (all running requests, one token
        each, nobody waiting who could get in), no request ends by length on prev's token (that
        one is known now) or still needs min_tokens masking (counted on the host), and each
        request gets the block for one more token. A PD decode's requests whose KV is still
        arriving cannot get in, so they do not stop it; the connector is polled first, so one
        whose KV has landed does (and a failed transfer is seen as soon as in a scheduled step)."""
        s = self.scheduler
        if s.sending:
            return False  # (blocks held for KV sends: take the path that polls the connector)
        if s.connector is not None:
            s.poll_connector()
        reqs = [req for req, _ in prev.out.scheduled]
        if (not reqs or len(reqs) != len(s.running) or s.can_admit()
                or len(reqs) > s.config.max_num_batched_tokens):
            return False
        for req, n in prev.out.scheduled:
            if (n != 1 or req.status != RequestStatus.RUNNING or req.num_computed_tokens + 1 != req.num_tokens
                    or req.num_output_tokens + 1 >= req.max_tokens or req.num_tokens + 1 >= self.max_model_len
                    or req.num_output_tokens + 1 < req.params.min_tokens or not _async_safe(req)):
                return False
        # blocks for the in-flight token and the next one (a failed allocation changes nothing)
        return all(self.blocks.allocate(req, 2) for req in reqs)

    def _lockstep_execute(self, out: SchedulerOutput):
        """Expert parallelism over DP ranks: every MoE layer is a collective over the ranks, so
        they run a forward pass together or not at all. They agree on the most tokens any rank
        scheduled and on whether any batch needs the eager path; each pads its batch to that
        many tokens (an idle rank runs a batch of padding only), so dispatch sees equal token
        counts and every rank replays the same CUDA graph."""
        max_tokens, eager = self._agree(out)
        if max_tokens == 0:
            return {}, {}
        return self.runner.execute(out, self.eos_token_ids, pad_to=max_tokens, force_eager=eager)

    def _agree(self, out: SchedulerOutput) -> tuple[int, bool]:
        """All lockstep ranks: (the most tokens any rank runs now, whether any needs eager);
        also learns whether any rank still has work."""
        num_tokens = sum(n for _, n in out.scheduled)
        eager = any(n != 1 for _, n in out.scheduled)
        local = torch.tensor([num_tokens, int(eager), int(self._has_local_work())], dtype=torch.long)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._dp_group)
        self._dp_busy = bool(local[2])
        return int(local[0]), bool(local[1])

    @property
    def dp_lockstep(self) -> bool:
        """This engine is one of several DP ranks that must step together (expert parallel)."""
        return self._dp_group is not None

    def _has_local_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.sending)

    def has_unfinished_requests(self) -> bool:
        """True while requests run or wait, or KV blocks are held for a transfer (they are freed
        by the steps that poll the connector). Lockstep DP ranks answer for all ranks, as of the
        last step, so that every rank takes the same number of steps: one keeps stepping (with
        padding-only batches) while any rank has work."""
        if self._dp_group is not None:
            return self._dp_busy
        return self._inflight is not None or self._has_local_work()

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.num_kernel_compilations_after_ready = WATCH.after_ready
        return stats

    def shutdown(self) -> None:
        self.scheduler.abort_requests(list(self.scheduler.requests))
        if self.connector is not None:
            self.connector.close()
        if self.runner.kv_worker is not None:
            self.runner.kv_worker.close()
        if self.workers is not None or self._dp_group is not None:
            self.runner.close()  # graphs may hold NCCL work: drop them before leaving the group
        if self.workers is not None:
            # Stop the workers, leave the group while they do the same and wait for us (see
            # leave_distributed), then let them go.
            self._broadcast(None)
            leave_distributed()
            self.workers.stopped.set()
            self.workers.join()
            self.workers = None
        elif self._dp_group is not None:
            leave_distributed()
            self._dp_group = None
