"""Paged attention and KV-cache store in Triton (CUDA and ROCm).

Same contract as `kernels.attention`: k_cache/v_cache are [num_blocks, block_size, Hk, D], one
flat batch of query tokens serves prefill, chunked prefill and decode. One kernel does all three:
a program owns a tile of BLOCK_Q query tokens x all GROUP query heads of one kv head (the K/V
tiles are read once for the whole GQA group) and walks the context with an online softmax.
When the grid would be too small to fill the GPU (decode, short batches) the context is split
into NUM_SPLITS chunks whose partial results a second kernel merges (split-K / flash-decoding).
A batch that may hold prefills is launched twice, narrow tiles for the decode-like sequences and
wide (256-row in bf16/fp16) tiles for the rest (`_launch_plans`). Launches derive from tensor shapes and python
bounds only (no host sync, graph-capturable); wrong bounds cost speed, never correctness.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import num_sms
from tandem.kernels.triton.e4m3 import E4M3_BF16_UNIT, e4m3_to_bf16_scaled, e4m3_to_f16, fast_cvt
from tandem.kernels.triton.fp8_skinny import _quant_tile
from tandem.kernels.triton.pdl import launch_args, wait_previous
from tandem.kernels.triton.trace import stamp, trace_args


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    num_kv_heads, head_dim,
    PAGE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block, off = slot // PAGE, slot % PAGE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + off * stride_kco + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + off * stride_vco + h * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, pdl: bool = True,
) -> None:
    """key, value: [T, Hk, D]; slot_mapping: [T] int (negative = padding, not stored)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError(f"store_kvcache needs a unit stride on head_dim, got strides {t.stride()}")
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        PAGE=k_cache.shape[1], H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), num_warps=4, **launch_args(key, pdl),
    )


@triton.jit
def _tile_blocks(bt_row, start, hi, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BT_SCALAR: tl.constexpr,
                 MASKED: tl.constexpr):
    """The block-table entry of each key of the tile at `start` [BLOCK_N] (MASKED: 0 for keys at or
    past hi). BT_SCALAR (PAGE divides BLOCK_N): read as BLOCK_N // PAGE scalars and spread over
    the tile's rows in registers, not as a vector of one entry per row (a vector load of the table
    makes Triton's pipeliner wait for every copy in flight at each tile)."""
    n = start + tl.arange(0, BLOCK_N)
    if BT_SCALAR:
        page_in_tile = (n - start) // PAGE
        block = tl.zeros([BLOCK_N], dtype=tl.int32)
        for i in tl.static_range(BLOCK_N // PAGE):
            if MASKED:
                b = tl.load(bt_row + start // PAGE + i, mask=start + i * PAGE < hi, other=0)
            else:
                b = tl.load(bt_row + start // PAGE + i)
            block = tl.where(page_in_tile == i, b, block)
    elif MASKED:
        block = tl.load(bt_row + n // PAGE, mask=n < hi, other=0)
    else:
        block = tl.load(bt_row + n // PAGE)
    return block


@triton.jit
def _paged_ptrs(k_base, v_base, block, n, d_off, stride_kb, stride_ko, stride_vb, stride_vo,
                PAGE: tl.constexpr, OFFS_32: tl.constexpr):
    """K and V pointers [BLOCK_N, D_PAD] of keys n, whose block-table entries are `block`."""
    if OFFS_32:
        off = n % PAGE
    else:
        block = block.to(tl.int64)
        off = (n % PAGE).to(tl.int64)
    return (k_base + block[:, None] * stride_kb + off[:, None] * stride_ko + d_off[None, :],
            v_base + block[:, None] * stride_vb + off[:, None] * stride_vo + d_off[None, :])


@triton.jit
def _kv_tile(k_base, v_base, block, n, hi, d_off, d_mask, stride_kb, stride_ko, stride_vb, stride_vo,
             PAGE: tl.constexpr, OFFS_32: tl.constexpr):
    """The K and V tiles [BLOCK_N, D_PAD] of keys n (block-table entries `block`); keys at or past hi
    and head_dim padding read as 0."""
    k_ptrs, v_ptrs = _paged_ptrs(k_base, v_base, block, n, d_off, stride_kb, stride_ko, stride_vb, stride_vo,
                                 PAGE, OFFS_32)
    mask = (n < hi)[:, None] & d_mask[None, :]
    return tl.load(k_ptrs, mask=mask, other=0.0), tl.load(v_ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_update(acc, l_i, m_i, q, k, v, n, in_range, q_pos, qk_scale, MASKED: tl.constexpr,
                 FAST_CVT: tl.constexpr, PIN_K: tl.constexpr, PIN_V: tl.constexpr):
    """One key tile k, v [BLOCK_N, D_PAD] (keys n) into the online softmax (acc, l_i, m_i); MASKED:
    keys past q_pos (causal) or outside in_range count as -inf. FAST_CVT (an e4m3 cache): 1, K and V
    by e4m3_to_bf16_scaled; 2, by e4m3_to_f16 (q is f16 then). PIN_K / PIN_V: that tile's conversion
    stays in the load's layout (the helpers' PINNED). With bf16, V pinned pays in the plans without
    splits only (64 decodes over an fp8 cache, Llama-3-8B at 1k on an H200, 57.0 -> 55.5 us a layer;
    a split plan at b=1 lost 0.4%)."""
    if FAST_CVT == 2:
        k = e4m3_to_f16(k, PIN_K)
        v = e4m3_to_f16(v, PIN_V)
    elif FAST_CVT == 1:
        k = e4m3_to_bf16_scaled(k, PIN_K)
        v = e4m3_to_bf16_scaled(v, PIN_V)
    s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if MASKED:
        s = tl.where((n[None, :] <= q_pos[:, None]) & in_range[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_safe = m_new
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_base, v_base, bt_row, d_off, d_mask, q_pos, lo, hi,
    stride_kb, stride_ko, stride_vb, stride_vo, qk_scale,
    MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    OFFS_32: tl.constexpr, DENSE: tl.constexpr, BT_SCALAR: tl.constexpr, FAST_CVT: tl.constexpr,
    PIN_K: tl.constexpr, PIN_V: tl.constexpr,
):
    """Online softmax over keys [lo, hi); MASKED applies the causal and the hi bound, else
    every tile is full and loads go unpredicated (EVEN_D: no head_dim padding either).
    OFFS_32: cache offsets fit 32 bits (cheaper address arithmetic). DENSE: key n is row n
    from k_base / v_base (row strides stride_ko / stride_vo), no block table. BT_SCALAR: see
    _tile_blocks. FAST_CVT 1 (an e4m3 cache, bf16 q): keys and values are converted by
    e4m3_to_bf16_scaled, so the scores and acc come out in units of 1 / E4M3_BF16_UNIT (the
    caller's qk_scale and epilogue scale them back); 2: by e4m3_to_f16, q in f16, no units."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < hi
        if MASKED:
            kv_mask = in_range[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        if DENSE:
            row = n if OFFS_32 else n.to(tl.int64)
            k_ptrs = k_base + row[:, None] * stride_ko + d_off[None, :]
            v_ptrs = v_base + row[:, None] * stride_vo + d_off[None, :]
        else:
            block = _tile_blocks(bt_row, start, hi, PAGE, BLOCK_N, BT_SCALAR, MASKED)
            k_ptrs, v_ptrs = _paged_ptrs(k_base, v_base, block, n, d_off, stride_kb, stride_ko, stride_vb, stride_vo,
                                         PAGE, OFFS_32)
        if EVEN_D and not MASKED:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        acc, l_i, m_i = _tile_update(acc, l_i, m_i, q, k, v, n, in_range, q_pos, qk_scale, MASKED, FAST_CVT, PIN_K,
                                     PIN_V)
    return acc, l_i, m_i


@triton.jit
def _attend_tiles_ahead(
    acc, l_i, m_i, q, k_base, v_base, bt_row, d_off, d_mask, q_pos, lo, hi,
    stride_kb, stride_ko, stride_vb, stride_vo, qk_scale,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, OFFS_32: tl.constexpr, BT_SCALAR: tl.constexpr,
    FAST_CVT: tl.constexpr, PIN_K: tl.constexpr, PIN_V: tl.constexpr,
):
    """_attend_tiles over the full paged tiles [lo, hi), pipelined by hand (KV_AHEAD; for plans of
    one stage, which Triton leaves alone): each iteration issues the next tile's K/V loads into
    registers, and the block-table entries of the tile after it, before the dots of its own tile, so
    their latency overlaps that work. (Triton's 2-stage pipelining issues the next tile's copies
    after the dots, behind a block-table load in the same iteration: sm_90 TTGIR.) Loads past hi
    read zeros and are never used."""
    k, v = _kv_tile(k_base, v_base, _tile_blocks(bt_row, lo, hi, PAGE, BLOCK_N, BT_SCALAR, True),
                    lo + tl.arange(0, BLOCK_N), hi, d_off, d_mask, stride_kb, stride_ko, stride_vb, stride_vo,
                    PAGE, OFFS_32)
    block = _tile_blocks(bt_row, lo + BLOCK_N, hi, PAGE, BLOCK_N, BT_SCALAR, True)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        k_next, v_next = _kv_tile(k_base, v_base, block, n + BLOCK_N, hi, d_off, d_mask, stride_kb, stride_ko,
                                  stride_vb, stride_vo, PAGE, OFFS_32)
        block = _tile_blocks(bt_row, start + 2 * BLOCK_N, hi, PAGE, BLOCK_N, BT_SCALAR, True)
        acc, l_i, m_i = _tile_update(acc, l_i, m_i, q, k, v, n, n < hi, q_pos, qk_scale, False, FAST_CVT, PIN_K,
                                     PIN_V)
        k = k_next
        v = v_next
    return acc, l_i, m_i


@triton.jit
def _prefetch_l2(ptrs):
    """Each pointer's line into L2 (prefetch.global.L2; CUDA only): nothing is read into registers, nothing waits."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _norm_rotate(rows, mask, d_off, partner, cos, sin, w_ptr, eps, NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows [R, D_PAD] at rows + d_off, RMS-normalized over HEAD_DIM with w (NORM; rounded as
    rms_norm_ref rounds) and rotated NeoX-style: x * cos + x[partner] * sin, where partner is
    the feature d pairs with and sin carries the sign (cos 1, sin 0 past the rotary dims).
    Returns float32."""
    x = tl.load(rows + d_off[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        ty = rows.dtype.element_ty
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d_off, mask=d_off < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=partner < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
        x = ((x * rstd).to(ty).to(tl.float32) * w).to(ty).to(tl.float32)
        xp = ((xp * rstd).to(ty).to(tl.float32) * wp).to(ty).to(tl.float32)
    return x * cos[None, :] + xp * sin[None, :]


@triton.jit
def _new_key_value(k_row, v_row, d_off, d_mask, partner, cos, sin, kw_ptr, eps, k_cache_ptr, v_cache_ptr,
                   QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The new token's key (normalized, rotated) and value [1, D_PAD] of one KV head, in the cache's dtype."""
    k = _norm_rotate(k_row, d_mask[None, :], d_off, partner, cos, sin, kw_ptr, eps, QK_NORM, HEAD_DIM)
    v = tl.load(v_row + d_off[None, :], mask=d_mask[None, :])
    return k.to(k_cache_ptr.dtype.element_ty), v.to(v_cache_ptr.dtype.element_ty)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, num_seqs, min_q_len, max_q_len,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh,
    pos_ptr, cos_sin_ptr, stride_cs, slot_ptr, qw_ptr, kw_ptr, eps,
    q8_ptr, q8s_ptr, stride_q8t, stride_q8st, fp8_max,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, OFFS_32: tl.constexpr, DENSE: tl.constexpr, BT_SCALAR: tl.constexpr,
    ROPE: tl.constexpr, QK_NORM: tl.constexpr, ROT: tl.constexpr, FAST_CVT: tl.constexpr, PDL: tl.constexpr,
    KV_AHEAD: tl.constexpr = False, QUANT_OUT: tl.constexpr = False, PIN_K: tl.constexpr = False,
    KV_EARLY: tl.constexpr = False, KV_PREFETCH: tl.constexpr = False, KV_READBACK: tl.constexpr = False,
    trace_ptr=None, TRACE: tl.constexpr = False,
):
    # Up to the wait only sequence metadata is read (query_start_loc, seq_lens), which no kernel
    # of the step writes: the dependent loads that place this program run while the kernel ahead
    # finishes. q and K/V come after it; KV_EARLY (with ROPE): the program's last K/V tile too, all but the
    # new key (an earlier step wrote them), which is put into that tile from registers after the wait.
    # KV_PREFETCH (CUDA): that tile's rows only prefetched into L2 before the wait, read after it as the others are,
    # so no tile is held in registers across the wait (KV_EARLY takes 254 registers a thread at 8 warps, the
    # whole register file, and leaves no room on its SM for the next kernel's programs to get in early).
    # KV_READBACK (with KV_EARLY): the new key's row read back into the early tile from the cache after this
    # program stores it, and that tile taken first. Put in from registers, the new key and value take the tile's
    # layout, which is where the 254 registers come from; read back, the 8B plan takes 128 (Triton 3.6 / ptxas
    # 12.8; 114 without KV_EARLY), so two o programs fit beside it.
    # TRACE (benchmarks.program_trace): the program's start, the release of its wait and its end (kernels/triton/
    # trace.py); a program with no keys returns after its start stamp.
    if TRACE:
        stamp(trace_ptr, 0)
    if HEAVY_FIRST:
        # grid (kv heads, q blocks): the last q blocks (most keys under the causal mask) start
        # first, for every head, so the short ones fill the tail
        kv_head = tl.program_id(0)
        q_block_global = tl.num_programs(1) - 1 - tl.program_id(1)
        num_heads = tl.num_programs(0) * GROUP
    else:
        q_block_global = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_heads = tl.num_programs(1) * GROUP
    split = tl.program_id(2)

    # Sequence s owns q blocks [start_s // BLOCK_Q + s, ...): binary search for ours.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if (q_block * BLOCK_Q >= q_len) | (q_len < min_q_len) | (q_len > max_q_len):
        return  # past the sequence's queries, or the sequence belongs to the other launch
    ctx_len = tl.load(seq_lens_ptr + seq)
    ctx_offset = ctx_len - q_len  # context position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_offset + tok
    tok_idx = (q_start + tok).to(tl.int64)
    d_off = tl.arange(0, D_PAD)
    d_mask = d_off < HEAD_DIM

    # Keys this tile can see: [0, kv_end); all of its rows see [0, first_pos].
    kv_end = tl.minimum(ctx_len, ctx_offset + tl.minimum(q_len, (q_block + 1) * BLOCK_Q))
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        if split * chunk >= kv_end:
            return  # no keys for this split: the merge reads only the first cdiv(kv_end, chunk)
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_lo + chunk, kv_end)
    first_pos = ctx_offset + q_block * BLOCK_Q
    full_hi = tl.maximum(kv_lo, kv_lo + (tl.minimum(kv_hi, first_pos + 1) - kv_lo) // BLOCK_N * BLOCK_N)
    q_rows = q_ptr + tok_idx[:, None] * stride_qt + head[:, None] * stride_qh
    if ROPE:  # a decode batch whose q and new keys are still to normalize, rotate (and store)
        half = ROT // 2
        rot = d_off < ROT
        partner = tl.where(rot, tl.where(d_off < half, d_off + half, d_off - half), d_off)
        pos = tl.load(pos_ptr + q_start).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + partner % half, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + half + partner % half, mask=rot, other=0.0).to(tl.float32)
        sin = tl.where(d_off < half, -sin, sin)
        slot = tl.load(slot_ptr + q_start).to(tl.int64)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if DENSE:  # the whole context is this step's new tokens (a prefill from position 0): read them
        k_base = k_new_ptr + q_start.to(tl.int64) * stride_knt + kv_head * stride_knh
        v_base = v_new_ptr + q_start.to(tl.int64) * stride_vnt + kv_head * stride_vnh
        stride_ko, stride_vo = stride_knt, stride_vnt
    else:
        k_base = k_cache_ptr + kv_head * stride_kh
        v_base = v_cache_ptr + kv_head * stride_vh
    last_lo = kv_lo + (kv_hi - 1 - kv_lo) // BLOCK_N * BLOCK_N  # the program's last tile (KV_EARLY, KV_PREFETCH)
    if KV_EARLY:  # keys [last_lo, kv_hi), the new one (at ctx_len - 1) read as 0 and put in below
        n_last = last_lo + tl.arange(0, BLOCK_N)
        k_last, v_last = _kv_tile(k_base, v_base, _tile_blocks(bt_row, last_lo, kv_hi, PAGE, BLOCK_N, BT_SCALAR, True),
                                  n_last, tl.minimum(kv_hi, ctx_len - 1), d_off, d_mask, stride_kb, stride_ko,
                                  stride_vb, stride_vo, PAGE, OFFS_32)
    if KV_PREFETCH:  # each 128-byte line of the last tile's K and V rows (one a row for an fp8 head of 128)
        BITS: tl.constexpr = k_cache_ptr.dtype.element_ty.primitive_bitwidth
        lines = tl.arange(0, (D_PAD * BITS + 1023) // 1024) * (1024 // BITS)  # each line's first element
        k_pf, v_pf = _paged_ptrs(k_base, v_base, _tile_blocks(bt_row, last_lo, kv_hi, PAGE, BLOCK_N, BT_SCALAR, True),
                                 last_lo + tl.arange(0, BLOCK_N), lines, stride_kb, stride_ko, stride_vb, stride_vo,
                                 PAGE, OFFS_32)
        _prefetch_l2(k_pf)
        _prefetch_l2(v_pf)
    wait_previous(PDL)
    if TRACE:
        stamp(trace_ptr, 1)
    if ROPE:
        q = _norm_rotate(q_rows, row_mask[:, None] & d_mask[None, :], d_off, partner, cos, sin, qw_ptr, eps,
                         QK_NORM, HEAD_DIM).to(q_ptr.dtype.element_ty)
        holds_new = kv_hi == ctx_len  # this program's keys end with the new one
        k_row = k_new_ptr + q_start.to(tl.int64) * stride_knt + kv_head * stride_knh + tl.zeros([1, 1], tl.int64)
        v_row = v_new_ptr + q_start.to(tl.int64) * stride_vnt + kv_head * stride_vnh + tl.zeros([1, 1], tl.int64)
        k_slot = k_cache_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ko + kv_head * stride_kh
        v_slot = v_cache_ptr + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vo + kv_head * stride_vh
        if KV_EARLY and not KV_READBACK:
            k, v = _new_key_value(k_row, v_row, d_off, d_mask, partner, cos, sin, kw_ptr, eps, k_cache_ptr,
                                  v_cache_ptr, QK_NORM, HEAD_DIM)
            new_row = (n_last == ctx_len - 1)[:, None] & holds_new
            k_last = tl.where(new_row, k, k_last)
            v_last = tl.where(new_row, v, v_last)
            if holds_new & (slot >= 0):
                tl.store(k_slot + d_off[None, :], k, mask=d_mask[None, :])
                tl.store(v_slot + d_off[None, :], v, mask=d_mask[None, :])
        else:
            stores_new = holds_new & (slot >= 0)  # this program writes the new key and value into the cache
            if stores_new:
                k, v = _new_key_value(k_row, v_row, d_off, d_mask, partner, cos, sin, kw_ptr, eps, k_cache_ptr,
                                      v_cache_ptr, QK_NORM, HEAD_DIM)
                tl.store(k_slot + d_off[None, :], k, mask=d_mask[None, :])
                tl.store(v_slot + d_off[None, :], v, mask=d_mask[None, :])
            tl.debug_barrier()  # the key and value stored above are read back with the tiles below
            if KV_EARLY:  # (KV_READBACK) the early tile's row for the new key, as the store above left it
                new_row = (n_last == tl.where(stores_new, ctx_len - 1, -1))[:, None] & d_mask[None, :]
                k_last = tl.load(k_slot + d_off[None, :] + tl.zeros([BLOCK_N, 1], tl.int32), mask=new_row,
                                 other=k_last)
                v_last = tl.load(v_slot + d_off[None, :] + tl.zeros([BLOCK_N, 1], tl.int32), mask=new_row,
                                 other=v_last)
    else:
        q = tl.load(q_rows + d_off[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if FAST_CVT == 2:
        q = q.to(tl.float16)  # (exact for 2^-14 <= |q| <= 65504: 3 more mantissa bits, 3 fewer exponent)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    # (_tile_update) V pinned: the bf16 form gains without splits only; the f16 form's pinned cvt reads
    # V from 16-byte loads in every plan but KV_AHEAD's, whose tiles come through registers
    PIN_V = (NUM_SPLITS == 1) | ((FAST_CVT == 2) & (not KV_AHEAD))
    if KV_EARLY:  # (one query a sequence: every tile before the last is full and below it)
        unmasked_hi = last_lo
    else:
        unmasked_hi = full_hi
    if KV_EARLY and KV_READBACK:  # first: its registers are free before the loop's tiles come in
        acc, l_i, m_i = _tile_update(acc, l_i, m_i, q, k_last, v_last, n_last, n_last < kv_hi, q_pos, qk_scale,
                                     True, FAST_CVT, PIN_K, PIN_V)
    if KV_AHEAD and not DENSE:
        acc, l_i, m_i = _attend_tiles_ahead(acc, l_i, m_i, q, k_base, v_base, bt_row, d_off, d_mask, q_pos,
                                            kv_lo, unmasked_hi, stride_kb, stride_ko, stride_vb, stride_vo,
                                            qk_scale, PAGE, BLOCK_N, OFFS_32, BT_SCALAR, FAST_CVT, PIN_K, PIN_V)
    else:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, d_off, d_mask, q_pos,
                                      kv_lo, unmasked_hi, stride_kb, stride_ko, stride_vb, stride_vo,
                                      qk_scale, False, PAGE, BLOCK_N, HEAD_DIM == D_PAD, OFFS_32, DENSE, BT_SCALAR,
                                      FAST_CVT, PIN_K, PIN_V)
    if KV_EARLY and not KV_READBACK:
        acc, l_i, m_i = _tile_update(acc, l_i, m_i, q, k_last, v_last, n_last, n_last < kv_hi, q_pos, qk_scale,
                                     True, FAST_CVT, PIN_K, PIN_V)
    elif not KV_EARLY:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, d_off, d_mask, q_pos,
                                      full_hi, kv_hi, stride_kb, stride_ko, stride_vb, stride_vo,
                                      qk_scale, True, PAGE, BLOCK_N, HEAD_DIM == D_PAD, OFFS_32, DENSE, BT_SCALAR,
                                      FAST_CVT, PIN_K, PIN_V)
    if FAST_CVT == 1:
        acc *= E4M3_BF16_UNIT

    if NUM_SPLITS == 1:
        out = (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(out_ptr.dtype.element_ty)
        if QUANT_OUT:  # the o projection's fp8 input instead: one scale a (token, head) row
            q8_rows = q8_ptr + tok_idx[:, None] * stride_q8t + head[:, None] * HEAD_DIM
            _store_head_quantized(out, q8_rows + d_off[None, :], q8s_ptr + tok_idx * stride_q8st + head, row_mask,
                                  d_mask, fp8_max)
        else:
            tl.store(out_ptr + tok_idx[:, None] * stride_ot + head[:, None] * stride_oh + d_off[None, :], out,
                     mask=row_mask[:, None] & d_mask[None, :])
    else:
        # partials: acc [T, Hq, NUM_SPLITS, D_PAD], (m, l) [T, Hq, NUM_SPLITS, 2], all float32
        part = (tok_idx * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d_off[None, :], acc, mask=row_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)
    if TRACE:
        stamp(trace_ptr, 3)


@triton.jit
def _store_head_quantized(out, q_ptrs, s_ptrs, row_mask, d_mask, fp8_max):
    """out [rows, D_PAD] (each a token's head, rounded to the output dtype) -> fp8 at q_ptrs and one
    float32 scale a row at s_ptrs: kernels.fp8.quantize_rows of [T, Hq * D] in groups of D."""
    q, scale = _quant_tile(tl.where(d_mask[None, :], out.to(tl.float32), 0.0), fp8_max, q_ptrs.dtype.element_ty)
    tl.store(q_ptrs, q, mask=row_mask[:, None] & d_mask[None, :])
    tl.store(s_ptrs, scale, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, max_q_len, head_dim,
    stride_ot, stride_oh, q8_ptr, q8s_ptr, stride_q8t, stride_q8st, fp8_max,
    NUM_SPLITS: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr, QUANT_OUT: tl.constexpr = False, EARLY: tl.constexpr = False,
    trace_ptr=None, TRACE: tl.constexpr = False,
):
    """EARLY: the next launch is let in first, before this one waits (its programs then wait for this whole
    grid, which waits for the attention: the order of effects stays the stream's). TRACE: start, wait released
    and end stamped (kernels/triton/trace.py; benchmarks.program_trace)."""
    if EARLY and PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if TRACE:  # (after the let-in: the next launch's programs come in no later for it)
        stamp(trace_ptr, 0)
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(query_start_loc_ptr + num_seqs):  # padding token: nothing was computed
        return
    lo = 0
    hi = num_seqs
    while lo < hi:  # the token's sequence: the last s with query_start_loc[s] <= t
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= t:
            lo = mid + 1
        else:
            hi = mid
    q_start = tl.load(query_start_loc_ptr + lo - 1)
    q_len = tl.load(query_start_loc_ptr + lo) - q_start
    if q_len > max_q_len:
        return  # computed by the prefill launch, which wrote it directly
    # the splits that had keys, as the attention program of this token's q block cut them
    ctx_len = tl.load(seq_lens_ptr + lo - 1)
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + tl.minimum(q_len, ((t - q_start) // BLOCK_Q + 1) * BLOCK_Q))
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    base = (t.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS
    sp = tl.arange(0, NUM_SPLITS)
    live = sp * chunk < kv_end
    wait_previous(PDL)  # the partials come from the kernel ahead; the metadata above does not
    if TRACE:
        stamp(trace_ptr, 1)
    # all three loads before any reduction: one round trip to L2, not two (the acc load issued after the (m, l)
    # reductions' barriers waits for them)
    d_off = tl.arange(0, D_PAD)
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=live, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=live, other=0.0)
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * D_PAD + d_off[None, :], mask=live[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    denom = tl.sum(w * l, axis=0)
    out = (tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)).to(out_ptr.dtype.element_ty)
    if QUANT_OUT:
        _store_head_quantized(out[None, :], q8_ptr + t.to(tl.int64) * stride_q8t + h * head_dim + d_off[None, :],
                              q8s_ptr + t.to(tl.int64) * stride_q8st + h + tl.zeros([1], tl.int32),
                              tl.full([1], True, tl.int1), d_off < head_dim, fp8_max)
    else:
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d_off, out, mask=d_off < head_dim)
    if TRACE:
        stamp(trace_ptr, 3)


_ALL_Q = (0, 2**31 - 1)
FEW_PROGRAMS = 16  # a decode grid of up to this many (sequence, KV head) programs takes the split-K plans of batch 1


def _launch_plans(q: torch.Tensor, group: int, num_seqs: int, num_kv_heads: int,
                  max_query_len: int | None, kv_bound: int, dense: bool = False, kv_bytes: int = 2) -> list[dict]:
    """Launches (tile shapes, split count, q_len range each serves) from python bounds only.

    A batch that may hold prefills gets two launches: narrow tiles (split-K where the grid is
    small) for sequences whose queries fit one narrow tile, and wide tiles for the rest; each
    launch's programs skip the other's sequences, so decodes never run on 128-row tiles.
    dense: the wide launch reads keys from the new tokens (DENSE); 128 x 64 tiles, 8 warps, 3
    stages measured best for that (the paged plan's 256 x 64 tiles are slower there).
    kv_bytes: the cache's element size; the narrow tiles over an fp8 cache (1) keep 3 tiles in flight,
    not 2 (64 decodes at 1k / 4k context on an H200: 6% / 6% faster; a bf16 cache: 1% slower).
    """
    num_tokens, num_heads, head_dim = q.shape
    d_pad = triton.next_power_of_2(head_dim)
    small = d_pad * q.element_size() <= 256  # 128-row K/V tiles fit shared memory, pipelined
    block_m = max(16, triton.next_power_of_2(group))
    block_q = block_m // group
    q_bound = min(num_tokens, max_query_len) if max_query_len is not None else num_tokens
    narrow_only = q_bound <= block_q or q_bound * group < 64
    if not narrow_only and num_seqs == 1:
        programs = 0  # no narrow launch
    elif narrow_only:
        programs = max(num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_heads
    else:
        programs = num_seqs * num_kv_heads  # the narrow launch serves one q tile per sequence
    block_n = 128 if small else 64
    splits = 1
    sms = num_sms(q.device)
    # a mid-sized grid over an fp8 cache (more programs than a batch of one or two takes, fewer than two an SM)
    mid = kv_bytes == 1 and FEW_PROGRAMS < programs < 2 * sms
    if 0 < programs < 2 * sms:
        if mid:  # at most two programs an SM, not the next power of two past it
            splits = 2 ** ((2 * sms // programs).bit_length() - 1)
        else:
            splits = triton.next_power_of_2(triton.cdiv(2 * sms, programs))
        max_by_memory = 2**26 // (num_tokens * num_heads * d_pad * 4)  # partials under 64 MiB
        splits = min(splits, 64, triton.next_power_of_2(max(1, kv_bound // block_n)))
        splits = max(1, min(splits, 2 ** (max(1, max_by_memory).bit_length() - 1)))
    narrow = dict(BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits, num_warps=4,
                  num_stages=3 if kv_bytes == 1 else 2)
    if mid:
        # 4 warps a program, 2 stages, the tiles as wide as the head size allows, split or not: against the
        # plans below (made for one or two sequences, and for a full grid), kernel-level on an H200 over an
        # fp8 cache (2026-11-29, 56 plans a shape, `benchmarks.kernels --sweep --only decode --kv-dtype fp8
        # --mid`): 32 sequences x 1k keys, 4 KV heads 51.2 -> 26.9 us, 8 KV heads 45.3 -> 38.0; 64 x 1k, 4 KV
        # heads 75.6 -> 38.0; 16 x 4k, 8 KV heads 75.6 -> 66.2. The b=32 step: Qwen3-30B-A3B 10.52 -> 9.05 ms,
        # Llama-3-8B 4.83 -> 4.66 (RESULTS.md, nineteenth session)
        narrow.update(num_stages=2)
    elif kv_bytes == 1 and splits > 1:
        # split-K over an fp8 cache (a small grid, a tile or two a program: latency): 8 warps share
        # each tile's loads and e4m3 conversion. Decode b=1 graph replay on an H200, chosen in the step
        # (benchmarks/plan_tune.py, 2026-11-28): Qwen3-30B-A3B 2783 -> 2583 us, Llama-3-8B 2888 -> 2825;
        # with K/V read into f16, 2 stages (2026-11-29): Llama-3-8B 2791 -> 2772, Qwen3-30B-A3B 2462 -> 2455
        narrow.update(num_warps=8, num_stages=2)
        # with rope (a decode batch) each program's last tile before its PDL wait (KV_EARLY; a tile or two a
        # program): H200 b=1 (2026-12-03) Qwen3-30B-A3B 2.076 -> 2.040 ms, Llama-3-8B 2.581 -> 2.557. (On the 8B's
        # b=64 full grid, whose programs are capped at 128 registers, it took the step from 5.094 to 6.039.)
        # KV_READBACK: the new key's row read back into that tile from the cache after its store, not put in
        # from registers (254 -> 128 registers a thread for the 8B, 214 -> 159 for the 30B, sm_90 ptxas 12.8).
        # H100 b=1, rounds interleaved (2026-12-07): Llama-3-8B 3.281 -> 3.258 ms; Qwen3-30B-A3B, two
        # one-variant processes each, 2.142 / 2.133 -> 2.101 / 2.102
        narrow.update(KV_EARLY=True, KV_READBACK=True)
        if num_kv_heads <= 4:
            # few KV heads: with 128-key tiles only heads x (context / 128) programs have keys (32 of
            # Qwen3-30B-A3B's at 1k); 64-key tiles double them, and KV_AHEAD issues each tile's loads
            # before the block-table reads of the next. Roofline on an H200 (2026-11-28, A/B in turns):
            # 30B-A3B b=1 2.583 / 2.587 -> 2.516 / 2.521 ms; Llama-3-8B (8 KV heads) 2.808 / 2.812 ->
            # 2.922 / 2.923 with the same plan, so it keeps 128-key tiles.
            narrow.update(BLOCK_N=64, KV_AHEAD=True)
        else:
            # one stage: at 1k context each live program holds one 128-key tile, so a second stage pipelines
            # nothing and takes 68 KB of shared memory against 36 (two o programs of 78 KB fit beside it either
            # way, barely at 2). H100 b=1, Llama-3-8B, four calls, rounds interleaved (2026-12-07), 2 -> 1 stage:
            # 3.258 -> 3.253, 3.263 -> 3.256, 3.255 -> 3.259, 3.263 -> 3.245 ms (a few us a step, near the spread)
            narrow.update(num_stages=1)
    if kv_bytes == 1 and splits == 1 and not mid and q.is_cuda and torch.version.cuda is not None:
        # a full grid over an fp8 cache: the 128-key tiles take 254 registers a thread (2 programs an
        # SM); 64-key tiles capped at 128 registers run 4, and 4 programs' loads in flight beat 2
        # (64 decodes at 1k / 4k context on an H100: 69.3 / 220.6 us against 74.4 / 236.4)
        narrow.update(BLOCK_N=64, num_stages=2, maxnreg=128)
    if narrow_only:
        return [dict(narrow, Q_RANGE=_ALL_Q)]
    if small and q.element_size() == 2 and dense:
        wide = dict(BLOCK_M=max(128, block_m), BLOCK_N=64, NUM_SPLITS=1, num_warps=8, num_stages=3)
    elif small and q.element_size() == 2 and triton.cdiv(num_tokens, 256 // group) * num_kv_heads <= sms // 2:
        # 256-row tiles would leave half the SMs idle (a 512-token chunk behind its context):
        # 64-row tiles, 4x the programs
        wide = dict(BLOCK_M=max(64, block_m), BLOCK_N=64, NUM_SPLITS=1, num_warps=4, num_stages=3)
    elif small and q.element_size() == 2:  # 256 x 64 tiles, 3 stages: 160 KB of shared memory
        wide = dict(BLOCK_M=max(256, block_m), BLOCK_N=64, NUM_SPLITS=1, num_warps=8, num_stages=3,
                    BT_SCALAR=True)
    else:
        wide = dict(BLOCK_M=max(128 if small else 64, block_m), BLOCK_N=block_n, NUM_SPLITS=1,
                    num_warps=8, num_stages=2)
    wide["DENSE"] = dense
    if num_seqs == 1:
        return [dict(wide, Q_RANGE=_ALL_Q)]
    return [dict(narrow, Q_RANGE=(0, block_q)), dict(wide, Q_RANGE=(block_q + 1, _ALL_Q[1]))]


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
    max_query_len: int | None = None, max_seq_len: int | None = None,
    dense_kv: tuple[torch.Tensor, torch.Tensor] | None = None, rope: "NewTokens | None" = None,
    pdl: bool = True, int_convert: bool = True, quant: tuple[torch.dtype, int] | None = None,
    kv_f16: bool = True, early: bool = False, kv_early: bool = True, partials: bool = False,
) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor] | SplitPartials":
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hk, D]; block_tables: [S, max_blocks] int32;
    seq_lens: [S] (context incl. the new tokens); query_start_loc: [S+1]. Returns [T, Hq, D].

    Tokens past query_start_loc[S] (graph padding) are left unwritten, as in the reference.
    dense_kv = (k, v), [T, Hk, D] each, the new tokens' keys (rotated) and values as the cache
    holds them: the caller's promise that every sequence of more than one new token starts at
    position 0, so the prefill launch reads its keys from them (rows, no block table).
    rope: a decode batch's new tokens (one a sequence; max_query_len 1) as the qkv GEMM left
    them: q (raw), k and v are normalized, rotated and stored by the attention programs, as
    kernels.rotary.rotary_store_kvcache would have done in a launch of its own.
    int_convert: an e4m3 cache is read into bf16 by integer ops (kernels/triton/e4m3.py) on CUDA.
    kv_f16: before that, an e4m3 cache under bf16 q is read into f16 by cvt (kernels/triton/e4m3.py
    e4m3_to_f16) on CUDA and the dots run in f16, q taken to f16 (exact for 2^-14 <= |q| <= 65504; below,
    f16 subnormals; a model whose q passes 65504 needs --no-fp8-kv-f16).
    quant = (fp8 dtype, D): the output is written as the o projection's FP8 input instead,
    (q [T, Hq * D] fp8, s [T, Hq] float32) as kernels.fp8.quantize_rows writes it in groups of D.
    early: the split merge lets the next launch in before its own PDL wait (kernels.fp8.tma_early).
    kv_early: with rope, where the launch plan has KV_EARLY (split-K over an fp8 cache), each program reads its
    last K/V tile before its PDL wait.
    partials: one token whose launch splits K: kernels.linear.SplitPartials, the merge not launched (its merged():
    the rows [1, Hq * D], or with quant what the launch returns, (q8, q8s)); else as without it.
    """
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                            max_query_len, max_seq_len, dense_kv=dense_kv, rope=rope, pdl=pdl,
                            int_convert=int_convert, quant=quant, kv_f16=kv_f16, early=early, kv_early=kv_early,
                            partials=partials)


def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                     max_query_len=None, max_seq_len=None, plan: dict | None = None,
                     dense_kv: tuple[torch.Tensor, torch.Tensor] | None = None, rope=None,
                     pdl: bool = True, int_convert: bool = True, quant=None, kv_f16: bool = True,
                     early: bool = False, kv_early: bool = True, partials: bool = False, trace: list | None = None):
    """paged_attention_triton with an optional explicit launch plan (benchmark sweeps). trace: a list each launch
    (the attention's, the split merge's) appends its (name, program clocks) to (kernels/triton/trace.py;
    benchmarks.program_trace)."""
    num_tokens, num_heads, head_dim = q.shape
    if quant is not None and quant[1] != head_dim:
        raise ValueError(f"attention: a quantized output takes groups of head_dim {head_dim}, not {quant[1]}")
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for t in (q, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_attention needs a unit stride on head_dim, got strides {t.stride()}")
    out = torch.empty_like(q)  # (its dtype only, with quant)
    q8 = torch.empty(num_tokens, num_heads * head_dim, device=q.device, dtype=quant[0]) if quant else out
    q8s = torch.empty(num_tokens, num_heads, device=q.device, dtype=torch.float32) if quant else out
    quant_args = (q8, q8s, q8.stride(0), q8s.stride(0), float(torch.finfo(q8.dtype).max) if quant else 1.0)
    result = (q8, q8s) if quant else out
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0:
        return result
    group = num_heads // num_kv_heads
    kv_bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
    if dense_kv is not None and (dense_kv[0].dtype != k_cache.dtype or dense_kv[1].dtype != v_cache.dtype
                                 or dense_kv[0].stride(-1) != 1 or dense_kv[1].stride(-1) != 1):
        dense_kv = None  # the cache holds something else (another dtype): read it instead
    plans = [dict(plan, Q_RANGE=_ALL_Q)] if plan else _launch_plans(
        q, group, num_seqs, num_kv_heads, max_query_len, kv_bound, dense_kv is not None, k_cache.element_size())
    k_new, v_new = dense_kv if dense_kv is not None else (k_cache[0], v_cache[0])  # [rows, Hk, D] either way
    rope_args = (q, q, 0, q, q, q, 0.0)  # unused without rope
    if rope is not None:
        if max_query_len != 1 or dense_kv is not None:
            raise ValueError("attention with rope takes decode batches (max_query_len 1) only")
        for t in (rope.k, rope.v, rope.cos_sin_cache):
            if t.stride(-1) != 1:
                raise ValueError(f"rope inputs need a unit stride on the last dim, got strides {t.stride()}")
        k_new, v_new = rope.k, rope.v  # the raw new keys and values, read through the dense pointers
        q_w, k_w, eps = rope.qk_norm if rope.qk_norm is not None else (q, q, 0.0)  # unused without norm
        rope_args = (rope.positions, rope.cos_sin_cache, rope.cos_sin_cache.stride(0), rope.slot_mapping,
                     q_w, k_w, eps)
    fast = fast_cvt(q, k_cache) and v_cache.dtype == k_cache.dtype
    fast = 2 if fast and kv_f16 else 1 if fast and int_convert else 0  # the kernel's FAST_CVT
    d_pad = triton.next_power_of_2(head_dim)
    offs_32 = max(k_cache.shape[0] * k_cache.stride(0), v_cache.shape[0] * v_cache.stride(0),
                  k_new.shape[0] * k_new.stride(0), v_new.shape[0] * v_new.stride(0)) < 2**31
    for p in plans:
        block_m, splits = p["BLOCK_M"], p["NUM_SPLITS"]
        block_q = block_m // group
        if splits > 1:
            part_acc = torch.empty(num_tokens, num_heads, splits, d_pad, device=q.device, dtype=torch.float32)
            part_ml = torch.empty(num_tokens, num_heads, splits, 2, device=q.device, dtype=torch.float32)
        else:
            part_acc = part_ml = out  # unused
        heavy_first = p.get("HEAVY_FIRST", True)
        early_tile = p.get("KV_EARLY", False) and kv_early and rope is not None
        prefetch = (p.get("KV_PREFETCH", False) and rope is not None and not early_tile and q.is_cuda
                    and torch.version.cuda is not None)  # (inline PTX)
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
        if heavy_first:
            grid = (num_kv_heads, grid[0], splits)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, part_acc, part_ml, block_tables, seq_lens, query_start_loc,
            scale * 1.4426950408889634 * (E4M3_BF16_UNIT if fast == 1 else 1.0), num_seqs, *p["Q_RANGE"],
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), *rope_args,
            *quant_args, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=p["BLOCK_N"], HEAD_DIM=head_dim,
            D_PAD=d_pad, PAGE=page, NUM_SPLITS=splits, HEAVY_FIRST=heavy_first,
            OFFS_32=p.get("OFFS_32", offs_32), DENSE=p.get("DENSE", False) and dense_kv is not None,
            BT_SCALAR=p.get("BT_SCALAR", False) and p["BLOCK_N"] % page == 0,
            KV_AHEAD=p.get("KV_AHEAD", False), PIN_K=p.get("PIN_K", False), QUANT_OUT=quant is not None,
            KV_EARLY=early_tile, KV_PREFETCH=prefetch, KV_READBACK=early_tile and p.get("KV_READBACK", False),
            ROPE=rope is not None, QK_NORM=rope is not None and rope.qk_norm is not None,
            ROT=rope.cos_sin_cache.shape[-1] if rope is not None else 0, FAST_CVT=fast,
            num_warps=p["num_warps"], num_stages=p["num_stages"], **launch_args(q, pdl),
            **({"maxnreg": p["maxnreg"]} if p.get("maxnreg") else {}),
            **trace_args(trace, "attention", grid[0] * grid[1] * grid[2], q.device),
        )
        if splits > 1:
            def merge(part_acc=part_acc, part_ml=part_ml, p=p, block_q=block_q, splits=splits, early=early):
                _merge_splits_kernel[(num_tokens, num_heads)](
                    out, part_acc, part_ml, query_start_loc, seq_lens, num_seqs, p["Q_RANGE"][1], head_dim,
                    out.stride(0), out.stride(1), *quant_args, NUM_SPLITS=splits, D_PAD=d_pad, BLOCK_Q=block_q,
                    BLOCK_N=p["BLOCK_N"], QUANT_OUT=quant is not None, EARLY=early, num_warps=4,
                    **launch_args(q, pdl), **trace_args(trace, "merge", num_tokens * num_heads, q.device))
                return result
            if partials and num_tokens == 1 and len(plans) == 1:
                from tandem.kernels.linear import SplitPartials
                return SplitPartials(part_acc, part_ml, seq_lens, p["BLOCK_N"], q.dtype,
                                     lambda: merge(early=False) if quant else merge(early=False).flatten(1))
            merge()
    return result
