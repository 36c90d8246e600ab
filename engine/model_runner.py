"""Owns the model and its KV cache on one device; turns a SchedulerOutput into sampled tokens.

Per step it flattens the scheduled requests into one batch (input ids, positions,
slot mapping, block tables), runs the model, computes logits only at the rows
that need them (the last token of a request that is due a new token, and prompt
positions whose logprobs were asked for) and samples.
"""
import contextlib
import gc
import logging
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import DecodeGraphs
from tandem.engine.forward_context import ForwardContext
from tandem.engine.loader import init_dummy_weights, load_weights
from tandem.engine.models import model_class
from tandem.engine.layers.fp8 import quantize_model
from tandem.engine.quantization import kv_cache_dtype
from tandem.engine.parallel import expert_parallel, tp_size
from tandem.engine.protocol import TokenLogprobs
from tandem.engine.sampler import SamplingBatch, sample, token_logprobs
from tandem.engine.scheduler import SampledToken, SchedulerOutput
from tandem.kernels.backend import triton_available

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    cfg_dtype = _DTYPES.get(cfg_dtype, cfg_dtype) if isinstance(cfg_dtype, str) else cfg_dtype
    return cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, device: str | None = None):
        self.config = config
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.device = resolve_device(device or config.model.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches on the current device
        self.dtype = resolve_dtype(config.model.dtype, hf_config, self.device)
        self.vocab_size = hf_config.vocab_size
        self.block_size = config.cache.block_size
        torch.manual_seed(config.model.seed)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = model_class(hf_config)(hf_config, config.parallel, config.kernel)
        quantize_model(self.model, hf_config, config.model.quantization)
        if config.model.load_format == "dummy":
            init_dummy_weights(self.model, config.model.seed)
        else:
            load_weights(self.model, config.model.model)
        for module in self.model.modules():  # kernels that want their own weight layout
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        self.model.eval()
        self.kv_worker = None  # the KV connector's worker side on this rank (PD), set by the engine
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        if self.device.type == "cuda" and triton_available() and config.compilation.compile_ahead:
            from tandem.engine.warmup import compile_ahead
            compile_ahead(self, self._graph_sizes())
        self.graphs = self._capture_graphs()

    # ---- KV cache ------------------------------------------------------------------------

    @property
    def attention_layers(self):
        return [m.self_attn.attn for m in self.model.model.layers]

    def kv_bytes_per_block(self) -> int:
        a = self.attention_layers[0]
        return 2 * len(self.attention_layers) * self.block_size * a.num_kv_heads * a.head_dim * self.kv_dtype.itemsize

    @property
    def kv_dtype(self) -> torch.dtype:
        return kv_cache_dtype(self.config.cache.kv_cache_dtype, self.dtype, self.device)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_memory()
        else:
            budget = 1 << 30
        num = budget // self.kv_bytes_per_block()
        if tp_size() > 1:  # every rank must agree on the block count
            t = torch.tensor([num], device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            num = int(t.item())
        if num <= 0:
            raise ValueError(f"no memory is left for the KV cache (budget {budget / 2**30:.2f} GiB; on a GPU, what "
                             f"the weights, a forward pass and other users of the device, e.g. another engine, "
                             f"leave): raise --gpu-memory-utilization / --kv-cache-memory-bytes or free the device")
        if num * self.block_size < self.max_model_len:
            raise ValueError(f"the KV cache holds {num * self.block_size} tokens, fewer than max_model_len="
                             f"{self.max_model_len}: raise --gpu-memory-utilization / --kv-cache-memory-bytes "
                             f"or lower --max-model-len")
        return int(num)

    def _profile_free_memory(self) -> int:
        """Bytes left for the KV cache after weights and a full-budget forward pass."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        self._dummy_forward(n)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory other processes (and the CUDA context) hold counts against us.
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization - others - peak)
        logger.info("GPU memory: %.1f GiB total, weights %.2f GiB, forward peak %.2f GiB, others %.2f GiB "
                    "-> %.2f GiB for the KV cache", total / 2**30, weights / 2**30, peak / 2**30, others / 2**30,
                    budget / 2**30)
        return budget

    def _dummy_forward(self, num_tokens: int) -> None:
        a = self.attention_layers[0]
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.zeros(
                -(-num_tokens // self.block_size), self.block_size, a.num_kv_heads, a.head_dim,
                dtype=self.dtype, device=self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        ctx = ForwardContext(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(-(-num_tokens // self.block_size), dtype=torch.int32,
                                      device=self.device)[None],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=num_tokens)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), ctx)
            self.model.compute_logits(hidden[-min(num_tokens, self.config.scheduler.max_num_seqs):])
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])

    def _allocate_kv_cache(self) -> None:
        a = self.attention_layers[0]
        # [k|v, layer, block, slot, kv head, head dim]: one tensor the KV connectors can register once.
        self.kv_cache = torch.zeros(2, len(self.attention_layers), self.num_blocks, self.block_size,
                                    a.num_kv_heads, a.head_dim, dtype=self.kv_dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s on %s)", self.num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_dtype.itemsize / 2**30, self.kv_dtype, self.device)

    def _graph_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes that get a CUDA graph; () when graphs are off."""
        comp = self.config.compilation
        if self.device.type != "cuda" or comp.enforce_eager or not triton_available():
            return ()
        ep = expert_parallel()
        if ep is not None and not ep.graph_safe:
            return ()
        limit = self.config.scheduler.max_num_seqs
        return tuple([s for s in comp.cuda_graph_sizes if s <= limit] or [limit])

    def _capture_graphs(self) -> DecodeGraphs | None:
        sizes = self._graph_sizes()
        if not sizes:
            ep = expert_parallel()
            if self.device.type == "cuda" and ep is not None and not ep.graph_safe:
                logger.info("CUDA graphs are off: the %s all2all backend syncs with the host", ep.backend)
            return None
        return DecodeGraphs(self.model, sizes, -(-self.max_model_len // self.block_size), self.max_model_len,
                            self.device)

    def close(self) -> None:
        """Drop the CUDA graphs (and the collectives captured in them)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
            gc.collect()
            torch.cuda.synchronize(self.device)

    # ---- one step ------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, pad_to: int = 0, ahead: int = 0) -> tuple["StepInputs", list, list]:
        """Flatten the scheduled requests into one batch. Returns the inputs (what every TP rank
        needs), the requests due a sampled token and the prompt-logprob spans, whose logits rows
        follow the sampled ones: (request, first target index, count). pad_to: append one-token
        padding sequences (slot -1: nothing stored; they attend to one slot of block 0) until
        the batch has that many tokens. ahead: the requests are that many tokens further on
        than the host knows (their tokens are still on the device; input ids are left 0)."""
        bs = self.block_size
        input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        sample_rows, sample_reqs, prompt_rows, prompt_spans = [], [], [], []
        from_start = True
        for req, n in out.scheduled:
            start = req.num_computed_tokens + ahead
            from_start &= n == 1 or start == 0
            row0 = len(input_ids)
            input_ids.extend(req.all_token_ids[start:start + n] if not ahead else [0] * n)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in pos)
            qsl.append(len(input_ids))
            seq_lens.append(start + n)
            if start + n == req.num_tokens + ahead:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
            if req.wants_prompt_logprobs:
                # Row r predicts token r + 1; fill the prompt positions not yet produced.
                first = max(len(req.prompt_logprobs), start + 1)
                last = min(start + n, req.num_prompt_tokens - 1)
                if last >= first:
                    prompt_rows.extend(range(row0 + first - 1 - start, row0 + last - start))
                    prompt_spans.append((req, first, last - first + 1))
        num_pad = max(0, pad_to - len(input_ids))
        input_ids.extend([0] * num_pad)
        positions.extend([0] * num_pad)
        slots.extend([-1] * num_pad)
        qsl.extend(range(qsl[-1] + 1, qsl[-1] + 1 + num_pad))
        seq_lens.extend([1] * num_pad)
        rows = [_block_row(r) for r, _ in out.scheduled]
        block_tables = np.zeros((len(rows) + num_pad, max([len(t) for t in rows] + [1])), dtype=np.int32)
        for i, row in enumerate(rows):
            block_tables[i, :len(row)] = row
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids), positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=torch.from_numpy(block_tables),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            max_query_len=max([n for _, n in out.scheduled] + [1]), logits_rows=sample_rows + prompt_rows,
            prefills_from_start=from_start)
        return inputs, sample_reqs, prompt_spans

    @torch.inference_mode()
    def forward_logits(self, x: "StepInputs") -> torch.Tensor:
        """Run the model on one batch; logits (float32) at x.logits_rows. Every TP rank calls this;
        the step's KV transfers (x.kv) start first, and pushes run after each layer's KV store."""
        dev = self.device
        on_layer_stored = None
        if x.kv is not None and self.kv_worker is not None:
            self.kv_worker.start(x.kv)
            on_layer_stored = self.kv_worker.layer_hook(x.kv)
        decode_only = x.input_ids.shape[0] == x.seq_lens.shape[0]
        if (self.graphs is not None and decode_only and on_layer_stored is None and not x.force_eager
                and self.graphs.padded_size(x.input_ids.shape[0]) is not None):
            hidden, logits = self.graphs.run(x.input_ids, x.positions, x.slot_mapping, x.block_tables, x.seq_lens)
            rows = x.logits_rows
            if logits is not None and rows == list(range(len(rows))):
                return logits[:len(rows)]  # the replay's LM head output: no eager launch, no host sync
        else:
            ctx = ForwardContext(
                slot_mapping=x.slot_mapping.to(dev), block_tables=x.block_tables.to(dev),
                seq_lens=x.seq_lens.to(dev), query_start_loc=x.query_start_loc.to(dev),
                max_query_len=x.max_query_len, max_seq_len=int(x.seq_lens.max()),
                prefills_from_start=x.prefills_from_start, on_layer_stored=on_layer_stored)
            hidden = self.model(x.input_ids.to(dev), x.positions.to(dev), ctx)
        return self.model.compute_logits(hidden[x.logits_rows]).float()

    def _forward(self, out: SchedulerOutput, pad_to: int, force_eager: bool, broadcast, kv_meta,
                 prev: "PendingStep | None" = None) -> tuple[torch.Tensor, list, list]:
        """Prepare `out`, hand it to the other TP ranks, run the forward pass (input ids from
        prev's device tokens when given, see launch): (logits, sampled requests, prompt spans)."""
        inputs, sample_reqs, prompt_spans = self.prepare(out, pad_to, ahead=1 if prev is not None else 0)
        inputs.force_eager = force_eager
        inputs.ids_on_rank0 = prev is not None
        inputs.kv = kv_meta
        if broadcast is not None:
            broadcast(inputs)
        if prev is not None:
            ids, pad = prev.tokens, inputs.input_ids.shape[0] - prev.tokens.shape[0]
            inputs.input_ids = torch.cat([ids, ids.new_zeros(pad)]) if pad else ids
            if broadcast is not None:
                torch.distributed.broadcast(inputs.input_ids, src=0)
        return self.forward_logits(inputs), sample_reqs, prompt_spans

    def execute(self, out: SchedulerOutput, eos_token_ids: set[int], kv_meta=None,
                broadcast=None, pad_to: int = 0, force_eager: bool = False
                ) -> tuple[dict[str, SampledToken], dict[str, list[TokenLogprobs]]]:
        """One step on rank 0. broadcast(inputs) hands the batch to the other TP ranks first;
        kv_meta: the step's KV transfers (connectors KVStepMeta), done by every rank's kv_worker
        (write-mode pushes go out as each layer's new KV lands in the cache). pad_to / force_eager: lockstep data-parallel ranks pad
        to the same token count and agree on eager vs. CUDA graph (see EngineCore.step)."""
        logits, sample_reqs, prompt_spans = self._forward(out, pad_to, force_eager, broadcast, kv_meta)
        sampled = {}
        if sample_reqs:
            batch = SamplingBatch.build(sample_reqs, self.vocab_size, self.device)
            tokens, logprobs = sample(logits[:len(sample_reqs)], batch, eos_token_ids, self.config.kernel)
            for i, (req, tok) in enumerate(zip(sample_reqs, tokens.tolist())):
                sampled[req.request_id] = SampledToken(tok, logprobs[i] if logprobs else None)
        prompt_logprobs, row = {}, len(sample_reqs)
        for req, first, count in prompt_spans:
            targets = torch.tensor(req.all_token_ids[first:first + count], device=self.device)
            prompt_logprobs[req.request_id] = token_logprobs(
                logits[row:row + count].log_softmax(dim=-1), targets, req.params.prompt_logprobs)
            row += count
        return sampled, prompt_logprobs

    def launch(self, out: SchedulerOutput, eos_token_ids: set[int], prev: "PendingStep | None" = None,
               pad_to: int = 0, force_eager: bool = False, broadcast=None, kv_meta=None) -> "PendingStep":
        """Queue one step (forward pass and sampling) without waiting for it; collect() gets its
        tokens. prev: the step before, still in flight: every request of `out` is one decode
        token past what the host knows, and its input token is prev's sampled token, read on
        the device (and sent to the other TP ranks from there). No request may ask for logprobs
        (they are read on the host). pad_to / force_eager / broadcast / kv_meta: as in
        execute()."""
        logits, sample_reqs, prompt_spans = self._forward(out, pad_to, force_eager, broadcast, kv_meta, prev)
        assert not prompt_spans
        if sample_reqs:
            batch = SamplingBatch.build(sample_reqs, self.vocab_size, self.device)
            tokens, _ = sample(logits[:len(sample_reqs)], batch, eos_token_ids, self.config.kernel)
        else:  # prompt chunks only
            tokens = torch.empty(0, dtype=torch.long, device=logits.device)
        host, ready = tokens, None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return PendingStep(out, sample_reqs, tokens, host, ready)

    @staticmethod
    def collect(step: "PendingStep") -> dict[str, SampledToken]:
        """Wait for a launched step's tokens."""
        if step.ready is not None:
            step.ready.synchronize()
        return {req.request_id: SampledToken(tok) for req, tok in zip(step.sample_reqs, step.host.tolist())}


def _block_row(req) -> np.ndarray:
    """req.block_ids as int32, converted once per new block instead of once per step (building
    a step's block table from Python lists cost milliseconds at 256 sequences x 256 blocks). Cached on
    the request with the list object it mirrors: block_ids only grows in place, and a freed or
    preempted request gets a new list."""
    ids, cached = req.block_ids, req.block_row
    if cached is None or cached[0] is not ids:
        arr, n = np.empty(max(16, 2 * len(ids)), dtype=np.int32), 0
    else:
        _, arr, n = cached
    if len(ids) > n:
        if len(ids) > len(arr):
            arr = np.concatenate([arr[:n], np.empty(2 * len(ids) - n, dtype=np.int32)])
        arr[n:len(ids)] = ids[n:]
        n = len(ids)
    req.block_row = (ids, arr, n)
    return arr[:n]


@dataclass
class PendingStep:
    """A launched step whose sampled tokens have not been read on the host yet."""

    out: SchedulerOutput
    sample_reqs: list
    tokens: torch.Tensor  # [n] int64 on the device, one per scheduled request
    host: torch.Tensor  # pinned copy of tokens, valid once `ready` completed (CPU: tokens itself)
    ready: "torch.cuda.Event | None"


@dataclass
class StepInputs:
    """One batch as CPU tensors (see ForwardContext for shapes); sent as is to other TP ranks."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    logits_rows: list[int]
    prefills_from_start: bool = False  # see ForwardContext
    force_eager: bool = False
    ids_on_rank0: bool = False  # input ids follow on the device from rank 0 (async scheduling)
    kv: object = None  # the step's KV transfers (connectors KVStepMeta), for every rank

    def receive_ids(self, device: torch.device) -> None:
        """Other TP ranks: take the input ids that rank 0 broadcasts from its device."""
        if self.ids_on_rank0:
            self.input_ids = torch.empty(self.input_ids.shape, dtype=torch.long, device=device)
            torch.distributed.broadcast(self.input_ids, src=0)
