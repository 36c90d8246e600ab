"""Attention over a paged KV cache (layout: kernels/kv_cache.py).

One call serves prefill, chunked prefill and decode: a batch is a flat run of
query tokens, sequence s owning q[query_start_loc[s]:query_start_loc[s+1]],
which are the *last* tokens of its seq_lens[s] tokens of context (causal).
"""
import dataclasses
from dataclasses import dataclass

import torch

from tandem.kernels.backend import use_triton
from tandem.kernels.config import DEFAULT_KERNELS, KernelConfig
from tandem.kernels.linear import SplitPartials
from tandem.kernels.rotary import rotary_store_kvcache


@dataclass
class NewTokens:
    """What rotary_store_kvcache would do before attention, left to paged_attention: the new
    tokens' raw k, v [T, Hk, D], their positions [T] and slots [T], the [cos | sin] cache, and
    (q weight, k weight, eps) when q and k heads are RMS-normalized first (Qwen3)."""
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
    max_query_len: int | None = None, max_seq_len: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; block_tables: [S, max_blocks] int32; seq_lens: [S]; query_start_loc: [S+1].

    Returns out: [T, Hq, D] in q.dtype. Softmax in float32. GQA when Hq > Hk.
    """
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, ctx_len in enumerate(lens):
        q_s = q[starts[s]:starts[s + 1]]
        q_len = q_s.shape[0]
        if q_len == 0:
            continue
        num_blocks = -(-ctx_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx_len].float()
        v = v_cache[blocks].flatten(0, 1)[:ctx_len].float()
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_s.float(), k) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[starts[s]:starts[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def _wgmma_supports(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int | None) -> bool:
    from tandem.kernels.triton.attention_wgmma import supports
    return supports(q, k_cache, max_query_len)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
    max_query_len: int | None = None, max_seq_len: int | None = None,
    dense_kv: tuple[torch.Tensor, torch.Tensor] | None = None, rope: NewTokens | None = None,
    config: KernelConfig = DEFAULT_KERNELS, quant: tuple[torch.dtype, int] | None = None, early: bool = False,
    partials: bool = False,
) -> "torch.Tensor | QuantRows | SplitPartials":
    """See module docstring. max_query_len / max_seq_len are upper bounds the GPU path may use
    for launch grids; they must not be exceeded by the data. dense_kv = (new keys, new values)
    as stored, when every sequence of more than one new token starts at position 0: the GPU
    path then reads a prefill's keys from them instead of gathering them through the block table.
    rope: q is raw and the new tokens still to normalize, rotate and store; on the GPU a decode
    batch (max_query_len 1) has that done by the attention launch (config.fuse_rope), else it runs
    first. quant = (fp8 dtype, head_dim): the output [T, Hq * D] comes quantized for the FP8 o
    projection after (kernels.fp8.QuantRows, one scale a token's head), written so by the GPU kernel. early: the
    GPU kernel's split merge lets the next launch in before its own PDL wait (kernels.fp8.tma_early). partials:
    where the GPU launch splits K over one token, its SplitPartials instead of the merged output (merged(): the
    rows [1, Hq * D], or with quant their QuantRows); where it does not split, the output as without it."""
    gpu_decode = use_triton(q) and max_query_len == 1 and dense_kv is None
    wgmma = config.fp8_attention_wgmma and gpu_decode and _wgmma_supports(q, k_cache, max_query_len)
    if rope is not None and not (config.fuse_rope and gpu_decode):
        q = rotary_store_kvcache(rope.positions, q, rope.k, rope.v, rope.cos_sin_cache, k_cache, v_cache,
                                 rope.slot_mapping, rope.qk_norm, config=config)
        rope = None
    from tandem.kernels.fp8 import QuantRows, quantize_rows
    if wgmma:
        from tandem.kernels.triton.attention_wgmma import decode_attention_wgmma
        out = decode_attention_wgmma(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, quant,
                                     config.pdl, rope=rope)
        return QuantRows(*out, quant[1], q.dtype) if quant else out
    if use_triton(q):
        from tandem.kernels.triton.attention import paged_attention_triton
        out = paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     max_query_len, max_seq_len, dense_kv, rope, config.pdl, config.fp8_int_convert,
                                     quant, config.fp8_kv_f16, early,
                                     config.attention_kv_early, partials)
        if isinstance(out, SplitPartials):  # merged(): what the o projection takes without partials
            merged = out.merged
            return dataclasses.replace(out, merged=lambda: QuantRows(*merged(), quant[1], q.dtype) if quant else merged())
        return QuantRows(*out, quant[1], q.dtype) if quant else out
    out = paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    return QuantRows(*quantize_rows(out.flatten(1), *quant), quant[1], q.dtype) if quant else out
