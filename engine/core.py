"""EngineCore: the in-process engine (scheduler + KV blocks + model runner), driven by step().

The offline LLM and the server's engine-core process both wrap this class.
"""
import logging
import time

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.loader import eos_token_ids, load_hf_config
from engine.model_runner import ModelRunner
from engine.protocol import EngineRequest, RequestOutput, SchedulerStats
from engine.request import Request
from engine.parallel import init_tensor_parallel
from engine.scheduler import Scheduler
from engine.worker import Workers, broadcast_step, init_distributed, local_device

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
    return min(config.model.max_model_len or max_pos, max_pos)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.hf_config = load_hf_config(config.model.model)
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(config.model.model, self.hf_config)
        self.tokenizer_path = config.model.tokenizer or config.model.model
        self.workers, self._broadcast = None, None
        device = None
        if config.parallel.tensor_parallel_size > 1:
            if config.kv_transfer.enabled:
                raise ValueError("PD disaggregation (--kv-transfer-config) with --tensor-parallel-size > 1 "
                                 "is not supported yet")
            if config.parallel.node_rank != 0:
                raise ValueError("the engine core runs on node 0; other nodes run only workers")
            self.workers = Workers(config, self.max_model_len, include_rank0=False)
            group = init_distributed(config, 0)
            self._broadcast = lambda inputs: broadcast_step(group, inputs)
            device = local_device(config, 0)
        self.runner = ModelRunner(config, self.hf_config, self.max_model_len, device)
        self.blocks = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len, self.eos_token_ids)
        self.connector = None
        if config.kv_transfer.enabled:
            from connectors import build_connector
            self.set_connector(build_connector(config.kv_transfer, self.runner))
        logger.info("engine ready: %s, max_model_len=%d, %d KV blocks", type(self.runner.model).__name__,
                    self.max_model_len, self.blocks.num_blocks)

    def set_connector(self, connector) -> None:
        """Attach a KV connector's scheduler side (PD disaggregation)."""
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
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, req.sampling_params, req.arrival_time or time.time(),
            req.kv_transfer_params, max_tokens, device=str(self.runner.device)))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        sampled, prompt_logprobs = {}, {}
        if out.scheduled:
            hook = self.connector.layer_hook(out.scheduled) if self.connector is not None else None
            sampled, prompt_logprobs = self.runner.execute(out, self.eos_token_ids, hook, self._broadcast)
        outputs = self.scheduler.update(out, sampled, prompt_logprobs)
        if not out.scheduled and not outputs:
            time.sleep(0.001)  # only KV transfers in flight: poll them without spinning a core
        return outputs

    def has_unfinished_requests(self) -> bool:
        """True while requests run or wait, or KV blocks are held for a transfer (they are freed
        by the steps that poll the connector)."""
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.sending)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.scheduler.abort_requests(list(self.scheduler.requests))
        if self.connector is not None:
            self.connector.close()
        if self.workers is not None:
            self._broadcast(None)
            # Tear down together with the workers (NCCL's teardown waits for every rank).
            torch.distributed.destroy_process_group()
            self.workers.join()
            init_tensor_parallel(None)
            self.workers = None
