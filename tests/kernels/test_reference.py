"""The torch reference kernels against naive math (CPU). Reference: plain SDPA, dense loops."""
import math

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.activation import silu_and_mul_ref
from tandem.kernels.attention import paged_attention_ref
from tandem.kernels.kv_cache import store_kvcache_ref
from tandem.kernels.moe import fused_experts_ref, topk_routing
from tandem.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from tandem.kernels.rotary import apply_rotary_ref, build_cos_sin_cache, rotary_store_kvcache_ref


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _paged_batch(g, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Random contiguous K/V per sequence scattered into a shuffled paged cache."""
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    block_tables = torch.zeros(len(ctx_lens), max(blocks_per_seq), dtype=torch.int32)
    ks, vs, used = [], [], 0
    for s, (c, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        block_tables[s, :nb] = perm[used:used + nb].int()
        used += nb
        k = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)
        slots = (block_tables[s, :nb].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:c]
        store_kvcache_ref(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0).int()
    return q, k_cache, v_cache, block_tables, torch.tensor(ctx_lens, dtype=torch.int32), qsl, ks, vs


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_paged_attention_ref_matches_sdpa(num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(0)
    q_lens, ctx_lens = [5, 1, 17, 1, 3], [5, 40, 33, 16, 70]  # prefill, decode, chunked prefill
    q, kc, vc, bt, seq_lens, qsl, ks, vs = _paged_batch(g, q_lens, ctx_lens, num_heads, num_kv_heads,
                                                         32, 16, torch.float64)
    scale = 1 / math.sqrt(32)
    out = paged_attention_ref(q, kc, vc, bt, seq_lens, qsl, scale)
    group = num_heads // num_kv_heads
    for s, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        qs = q[qsl[s]:qsl[s + 1]].transpose(0, 1)
        k = ks[s].repeat_interleave(group, 1).transpose(0, 1)
        v = vs[s].repeat_interleave(group, 1).transpose(0, 1)
        allowed = torch.arange(c)[None, :] <= torch.arange(c - ql, c)[:, None]
        ref = F.scaled_dot_product_attention(qs, k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
        assert _rel(out[qsl[s]:qsl[s + 1]], ref) < 1e-6  # the reference softmaxes in float32


def test_store_kvcache_ref_skips_negative_slots():
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(6, 4, 2, 8, generator=g)
    vc = torch.randn(6, 4, 2, 8, generator=g)
    kc0, vc0 = kc.clone(), vc.clone()
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, -1, 17, 22, -1])
    store_kvcache_ref(key, value, kc, vc, slots)
    expect_k, expect_v = kc0.view(-1, 2, 8).clone(), vc0.view(-1, 2, 8).clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot], expect_v[slot] = key[t], value[t]
    assert torch.equal(kc.view(-1, 2, 8), expect_k) and torch.equal(vc.view(-1, 2, 8), expect_v)


def test_fused_experts_ref_matches_dense_loop():
    g = torch.Generator().manual_seed(2)
    T, H, inter, E, k = 7, 16, 12, 5, 2
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w13 = torch.randn(E, 2 * inter, H, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, H, inter, generator=g, dtype=torch.float64)
    weights, ids = topk_routing(torch.randn(T, E, generator=g), k, renormalize=True)
    ids[1, 0] = -1  # expert owned elsewhere
    ids[4, :] = -1
    out = fused_experts_ref(x, w13, w2, weights, ids)
    ref = torch.zeros_like(x)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate, up = (w13[e] @ x[t]).chunk(2)
            ref[t] += weights[t, j].double() * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    assert _rel(out, ref) < 1e-6  # the reference accumulates in float32
    assert torch.all(out[4] == 0)


def test_topk_routing_renormalizes():
    logits = torch.randn(9, 6)
    w, ids = topk_routing(logits, 3, renormalize=True)
    assert ids.dtype == torch.int32 and torch.allclose(w.sum(-1), torch.ones(9))
    assert torch.equal(ids.long(), logits.topk(3, dim=-1).indices)


def test_rms_norm_refs_match_formula():
    x, r = torch.randn(3, 64, dtype=torch.float64), torch.randn(3, 64, dtype=torch.float64)
    w = torch.randn(64, dtype=torch.float64)
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    assert _rel(rms_norm_ref(x, w, 1e-6), expect) < 1e-6  # computed in float32
    normed, s = fused_add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and _rel(normed, rms_norm_ref(x + r, w, 1e-6)) < 1e-12


def test_rotary_ref_matches_complex_rotation():
    T, H, D, rot = 5, 3, 16, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).double() / rot))
    cache = build_cos_sin_cache(inv_freq, 64).double()
    pos = torch.tensor([0, 3, 7, 63, 1])
    q, k = torch.randn(T, H, D, dtype=torch.float64), torch.randn(T, 1, D, dtype=torch.float64)
    q_out, k_out = apply_rotary_ref(pos, q, k, cache)
    for x, out in ((q, q_out), (k, k_out)):
        z = torch.complex(x[..., :rot // 2], x[..., rot // 2:rot])
        angle = pos[:, None].double() * inv_freq
        zr = z * torch.polar(torch.ones_like(angle), angle)[:, None]
        expect = torch.cat([zr.real, zr.imag, x[..., rot:]], dim=-1)
        assert _rel(out, expect) < 1e-6  # cache is built in float32


def test_rotary_store_ref_rotate_k_writes_back_what_is_stored():
    T, Hq, Hk, D, page = 6, 4, 2, 16, 4
    cache = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 64)
    pos, slots = torch.arange(T), torch.tensor([3, 0, -1, 9, 10, 4])
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    k_before = k.clone()
    kc, vc = torch.zeros(3, page, Hk, D), torch.zeros(3, page, Hk, D)
    rotary_store_kvcache_ref(pos, q, k, v, cache, kc, vc, slots, None, rotate_k=True)
    stored = slots >= 0
    assert torch.equal(k[stored], kc.flatten(0, 1)[slots[stored]])
    assert torch.equal(k[~stored], k_before[~stored])  # padding rows left alone
    assert not torch.equal(k[1:2], k_before[1:2])  # position 1: rotated
    kc2 = torch.zeros_like(kc)
    k2 = k_before.clone()
    rotary_store_kvcache_ref(pos, q, k2, v, cache, kc2, vc, slots, None)
    assert torch.equal(k2, k_before) and torch.equal(kc2, kc)


def test_silu_and_mul_ref():
    x = torch.randn(4, 10, dtype=torch.float64)
    assert _rel(silu_and_mul_ref(x), x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:]) < 1e-12
