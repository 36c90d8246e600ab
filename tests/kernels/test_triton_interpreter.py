"""The Triton kernels' logic on CPU, in Triton's interpreter: the decode-path kernels the engine
runs on a GPU by default (argmax, the decode GEMM with its split-K tickets and the RMSNorm it
carries to the next GEMM, routing and that norm inside the expert GEMMs and the fused top-k sum,
the grouping of MoE pairs by expert, paged attention with split-K and its plans over an fp8 cache)
against their torch
references, so CI without a GPU checks them too. Timing, PDL and tile scheduling are a GPU's;
tests/kernels/test_triton.py checks those there.

One child process runs every case (TRITON_INTERPRET is read when the kernels are defined, so it
must be set before they are imported). Inputs are fp16/fp32 only: the interpreter's bf16 dot
multiplies raw bits (Triton 3.9).
"""
import json

import pytest
import torch

from tests.interpreter import run_under_interpreter

CASES = ["argmax", "argmax_split_ties_nan", "skinny_gemm", "skinny_gemm_split", "skinny_gemm_pending_norm",
         "topk_routing", "route_token", "routed_experts_decode", "routed_experts_pending_norm", "routed_experts_no_local_expert",
         "paged_attention_split", "paged_attention_rope", "paged_attention_prefill_scalar_table",
         "paged_attention_kv_ahead", "paged_attention_quant_out", "paged_attention_partials",
         "paged_attention_fp8_mid_grid", "moe_align"]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _paged_batches():
    """Two batches over one half-precision paged cache (4-key pages of a shuffled table, 2 KV heads of
    32, 4 query heads): three decodes whose contexts end inside a 16-key tile, then a chunk behind its
    context and a fresh prompt. Yields _paged_attention's arguments up to its bounds (q, caches, table,
    seq_lens, query_start_loc, scale 0.2, max_query_len, max_seq_len 76)."""
    page, hq, hk, d = 4, 4, 2, 32
    kc, vc = torch.randn(60, page, hk, d).half(), torch.randn(60, page, hk, d).half()
    bt = torch.randperm(60, dtype=torch.int32)[:57].view(3, 19)
    for seq_lens, qsl, max_q in (([70, 37, 5], [0, 1, 2, 3], 1), ([70, 37], [0, 20, 57], 37)):
        seq_lens, qsl = torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32)
        q = torch.randn(int(qsl[-1]), hq, d).half()
        yield q, kc, vc, bt[:len(seq_lens)], seq_lens, qsl, 0.2, max_q, 76


def run_case(name: str) -> None:
    """Raises AssertionError when the kernel disagrees with its reference."""
    torch.manual_seed(0)
    if name.startswith("argmax"):
        from tandem.kernels.triton.argmax import argmax_triton
        x = torch.randn(3, 1000) if name == "argmax" else torch.randn(4, 9000)  # 9000: 3 chunks + ticket
        if name != "argmax":
            x[0, 8999] = x[0, 10] = x[0].max() + 1  # tie across chunks: the first wins
            x[1, 5000] = float("nan")
            x[2] = float("-inf")
        for _ in range(2):  # the second call sees the tickets the first put back
            assert torch.equal(argmax_triton(x), x.argmax(-1)), (argmax_triton(x), x.argmax(-1))
    elif name in ("skinny_gemm", "skinny_gemm_split"):
        from tandem.kernels.triton.linear import skinny_linear_triton
        m, n, k = (1, 64, 512) if name == "skinny_gemm" else (3, 40, 4096)  # 40 x 4096: K split in 16
        w = (torch.randn(n, k) / k**0.5).half()
        for _ in range(2):
            x = torch.randn(m, k).half()
            assert _rel(skinny_linear_triton(x, w), x.double() @ w.double().t()) < 5e-3
    elif name == "skinny_gemm_pending_norm":
        # o_proj-like GEMM + residual with the norm left pending, then the next GEMM applies it;
        # (40, 4096) and (64, 512) split K (the ticket program adds and sums), (48, 384) does not
        from tandem.kernels.norm import rms_norm_ref
        from tandem.kernels.triton.linear import skinny_linear_add_norm_triton, skinny_linear_normed_triton
        for m, k1, n, n2 in [(1, 4096, 40, 48), (3, 384, 48, 64), (2, 512, 64, 40)]:
            w1, w2 = (torch.randn(n, k1) / k1**0.5).half(), (torch.randn(n2, n) / n**0.5).half()
            g = (1 + 0.3 * torch.randn(n)).half()
            for _ in range(2):
                x, res = torch.randn(m, k1).half(), torch.randn(m, n).half()
                s, sg, ss = skinny_linear_add_norm_triton(x, w1, res, g)
                s_ref = (x.float() @ w1.float().t()).half() + res
                h_ref = rms_norm_ref(s_ref, g, 1e-6)
                assert _rel(s, s_ref) < 1e-3 and _rel(sg, s_ref * g) < 1e-3, (m, k1, n)
                y = skinny_linear_normed_triton(sg, w2, ss, 1e-6)
                assert _rel(y, h_ref.double() @ w2.double().t()) < 5e-3, (m, k1, n)
    elif name == "topk_routing":
        from tandem.kernels.moe import topk_routing_ref
        from tandem.kernels.triton.routing import topk_routing_triton
        logits = torch.randn(5, 16)
        logits[0, 3] = logits[0, 9] = logits[0].max() + 1
        for scoring, renorm in [("softmax", True), ("sigmoid", False)]:
            w, ids = topk_routing_triton(logits, 4, renorm, scoring)
            w_ref, ids_ref = topk_routing_ref(logits, 4, renorm, scoring)
            assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6), (scoring, ids, ids_ref)
    elif name == "route_token":  # one token's router GEMM, top-k and quantized row in one launch
        from tandem.kernels.fp8 import quantize_rows
        from tandem.kernels.moe import topk_routing_ref
        from tandem.kernels.triton.routing import route_token_triton
        x, gate = torch.randn(1, 512).half(), (torch.randn(40, 512) / 8).half()  # 40 experts: 2 programs, a ticket
        ss = torch.zeros(16, 4)
        ss[0] = torch.rand(4) * 512
        for norm_in in (None, (ss, 1e-6)):
            for _ in range(2):  # the second call sees the ticket the first put back
                # q in fp16: the interpreter's float -> e4m3 cast rounds some values wrongly (124.3 -> 64)
                w, ids, q, qs = route_token_triton(x, gate, 4, True, "softmax", torch.float16, norm_in)
                logits = x.float() @ gate.float().t()
                if norm_in is not None:
                    logits = logits * torch.rsqrt(ss[0].sum() / 512 + 1e-6)
                w_ref, ids_ref = topk_routing_ref(logits.half(), 4, True)
                q_ref, qs_ref = quantize_rows(x, torch.float16, 128)
                assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6), (ids, ids_ref)
                assert torch.equal(q.float(), q_ref.float()) and torch.allclose(qs, qs_ref, rtol=1e-6)
            # rank False: the logits only, rounded to x's dtype (the experts' kernels rank them)
            lg, none, q, qs = route_token_triton(x, gate, 4, True, "softmax", torch.float16, norm_in, rank=False)
            assert none is None and torch.equal(lg, lg.half().float())
            assert torch.allclose(lg, logits[0], rtol=2e-3, atol=1e-3)
            assert torch.equal(q.float(), q_ref.float()) and torch.allclose(qs, qs_ref, rtol=1e-6)
        # Qwen3-30B-A3B's 128 experts and top 8 (16 router programs), sigmoid scores unnormalized
        gate = (torch.randn(128, 512) / 8).half()
        w_ref, ids_ref = topk_routing_ref((x.float() @ gate.float().t()).half(), 8, False, "sigmoid")
        w, ids, _, _ = route_token_triton(x, gate, 8, False, "sigmoid", torch.float16)
        assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6), (ids, ids_ref)
        # a ROUTE_PLANS entry: 1 expert a program (128 router programs, one ticket), 1 warp
        from tandem.kernels.triton import routing
        routing.ROUTE_PLANS[(128, 512)] = {"ELEMENTS": 512, "num_warps": 1}
        try:
            w, ids, _, _ = route_token_triton(x, gate, 8, False, "sigmoid", torch.float16)
        finally:
            routing.ROUTE_PLANS.pop((128, 512))
        assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6), (ids, ids_ref)
    elif name.startswith("routed_experts"):
        from tandem.kernels.moe import fused_experts_ref, topk_routing_ref
        from tandem.kernels.triton import moe
        from tandem.kernels.triton.routing import topk_routing_triton
        E, k, H, inter = 16, 4, 64, 32
        w13 = (torch.randn(E, 2 * inter, H) / H**0.5).half()
        w2 = (torch.randn(E, H, inter) / inter**0.5).half()
        if name == "routed_experts_decode":  # routing in the first GEMM, sum in the second
            for tokens, scoring in [(1, "softmax"), (3, "sigmoid")]:
                x, logits = torch.randn(tokens, H).half(), torch.randn(tokens, E).half()
                # experts 1 and 2 tie for the last slot: the lower id takes it
                logits[0] = -1.0 - torch.rand(E)
                logits[0, E - k + 1:] = 2.0 + torch.arange(k - 1)
                logits[0, 1] = logits[0, 2] = 1.0
                out = moe.routed_experts_triton(x, logits, w13, w2, k, True, scoring)
                w, ids = topk_routing_ref(logits, k, True, scoring)
                assert _rel(out, fused_experts_ref(x, w13, w2, w, ids)) < 5e-3, tokens
                # the same bits as the routing launch, then the experts with the sum launch
                w_t, ids_t = topk_routing_triton(logits, k, True, scoring)
                separate = moe._fused_experts(x, w13, w2, w_t, ids_t,
                                              cfg=dict(moe._config(tokens * k, E, x.dtype), FUSED_SUM=False))
                assert torch.equal(out, separate), tokens
        elif name == "routed_experts_pending_norm":  # rows s * g, the norm's 1/rms in the first GEMM
            from tandem.kernels.norm import rms_norm_ref
            from tandem.kernels.triton.linear import skinny_linear_add_norm_triton, skinny_linear_normed_triton
            g = (1 + 0.3 * torch.randn(H)).half()
            w_o = (torch.randn(H, 96) / 96**0.5).half()
            for tokens in (1, 5):  # 5 x 4 pairs: grouped, the routing launch
                x, res, logits = torch.randn(tokens, 96).half(), torch.randn(tokens, H).half(), torch.randn(tokens, E).half()
                s, sg, ss = skinny_linear_add_norm_triton(x, w_o, res, g)
                out = moe.routed_experts_triton(sg, logits, w13, w2, k, True, "softmax", (ss, 1e-6))
                w, ids = topk_routing_ref(logits, k, True)
                ref = fused_experts_ref(rms_norm_ref(s, g, 1e-6), w13, w2, w, ids)
                assert _rel(out, ref) < 5e-3, tokens
                # and the experts' output plus the residual with the next norm left pending (the
                # fused sum at 1 token, the sum launch at 5), applied by the next GEMM
                g2, w_q = (1 + 0.3 * torch.randn(H)).half(), (torch.randn(80, H) / H**0.5).half()
                s2, sg2, ss2 = moe.routed_experts_triton(sg, logits, w13, w2, k, True, "softmax", (ss, 1e-6), (s, g2))
                assert _rel(s2, ref + s) < 5e-3 and _rel(sg2, (ref + s) * g2) < 5e-3, tokens
                q = skinny_linear_normed_triton(sg2, w_q, ss2, 1e-6)
                assert _rel(q, rms_norm_ref(s2, g2, 1e-6).double() @ w_q.double().t()) < 5e-3, tokens
        else:  # expert parallel: a token with no expert held here gets a zero row from the fused sum
            x = torch.randn(3, H).half()
            w, ids = topk_routing_ref(torch.randn(3, E), k, True)
            ids[0, 1] = -1
            ids[2, :] = -1
            out = moe.fused_experts_triton(x, w13, w2, w, ids)
            assert _rel(out, fused_experts_ref(x, w13, w2, w, ids)) < 5e-3 and torch.all(out[2] == 0)
    elif name == "paged_attention_split":
        from tandem.kernels.attention import paged_attention_ref
        from tandem.kernels.triton.attention import paged_attention_triton
        bs, hq, hk, d = 16, 4, 2, 32
        kc, vc = torch.randn(12, bs, hk, d).half(), torch.randn(12, bs, hk, d).half()
        bt = torch.tensor([[3, 5, 7, 0, 9], [1, 2, 0, 0, 0]], dtype=torch.int32)
        q = torch.randn(2, hq, d).half()
        seq_lens = torch.tensor([70, 17], dtype=torch.int32)
        qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
        out = paged_attention_triton(q, kc, vc, bt, seq_lens, qsl, 0.2, 1, 80)
        ref = paged_attention_ref(q, kc, vc, bt, seq_lens, qsl, 0.2)
        assert _rel(out, ref) < 5e-3
        # (the rule gives these bounds one split) 8 splits of 16 keys, 5 and 2 of them with keys, and the merge
        from tandem.kernels.triton.attention import _paged_attention
        plan = dict(BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=8, num_warps=4, num_stages=1)
        assert _rel(_paged_attention(q, kc, vc, bt, seq_lens, qsl, 0.2, 1, 80, plan=plan), ref) < 5e-3
    elif name == "paged_attention_rope":
        # a decode batch whose q/k norm, rotation (half the dims) and KV store the attention
        # programs do: output and cache against the rotary-store reference, then attention
        from tandem.kernels.attention import NewTokens, paged_attention_ref
        from tandem.kernels.rotary import build_cos_sin_cache, rotary_store_kvcache_ref
        from tandem.kernels.triton.attention import paged_attention_triton
        bs, hq, hk, d = 16, 4, 2, 64
        kc, vc = torch.randn(24, bs, hk, d).half(), torch.randn(24, bs, hk, d).half()
        bt = torch.randperm(24, dtype=torch.int32)[:20].repeat(2, 1)
        seq_lens = torch.tensor([300, 17], dtype=torch.int32)
        qkv = torch.randn(2, hq + 2 * hk, d).half()
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
        positions = seq_lens.long() - 1
        slots = bt[[0, 1], positions // bs].long() * bs + positions % bs
        cache = build_cos_sin_cache(1.0 / (1e4 ** (torch.arange(0, 32, 2).float() / 32)), 512)
        norm = ((1 + 0.1 * torch.randn(d)).half(), (1 + 0.1 * torch.randn(d)).half(), 1e-6)
        qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q_ref = rotary_store_kvcache_ref(positions, q.clone(), k.clone(), v.clone(), cache, kc_ref, vc_ref, slots,
                                         norm)
        ref = paged_attention_ref(q_ref, kc_ref, vc_ref, bt, seq_lens, qsl, 0.2)
        for bound in (4096, 320):  # 16 splits, 4
            kc2, vc2 = kc.clone(), vc.clone()
            out = paged_attention_triton(q, kc2, vc2, bt, seq_lens, qsl, 0.2, 1, bound,
                                         rope=NewTokens(positions, k, v, cache, slots, norm))
            assert _rel(out, ref) < 5e-3 and _rel(kc2, kc_ref) < 2e-3 and torch.equal(vc2, vc_ref), bound
        # KV_EARLY (each program's last tile read before the wait, the new key and value put in from registers),
        # 16-key tiles: programs of many tiles, the new keys at 299 (inside a ragged last tile) and 16 (a tile's
        # first key), with and without the hand-pipelined loop; KV_READBACK: that key read back from the cache
        # into the early tile, which goes into the softmax first
        from tandem.kernels.triton.attention import _paged_attention
        for splits, ahead, readback in ((1, False, False), (2, False, False), (2, True, False), (1, False, True),
                                        (2, False, True), (2, True, True)):
            plan = dict(BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=splits, num_warps=4, num_stages=1, KV_AHEAD=ahead,
                        KV_EARLY=True, KV_READBACK=readback)
            kc2, vc2 = kc.clone(), vc.clone()
            out = _paged_attention(q, kc2, vc2, bt, seq_lens, qsl, 0.2, 1, 320, plan=plan,
                                   rope=NewTokens(positions, k, v, cache, slots, norm))
            assert _rel(out, ref) < 5e-3 and _rel(kc2, kc_ref) < 2e-3 and torch.equal(vc2, vc_ref), plan
    elif name == "paged_attention_prefill_scalar_table":
        # a chunk behind context and a fresh prompt, 16-key tiles over 4-key pages: the tile's
        # block-table entries read as 4 scalars (BT_SCALAR), a ragged last tile, a shuffled table
        from tandem.kernels.attention import paged_attention_ref
        from tandem.kernels.triton.attention import _paged_attention
        page, hq, hk, d = 4, 4, 2, 32
        kc, vc = torch.randn(40, page, hk, d).half(), torch.randn(40, page, hk, d).half()
        bt = torch.randperm(40, dtype=torch.int32)[:36].view(2, 18)
        seq_lens = torch.tensor([70, 37], dtype=torch.int32)
        qsl = torch.tensor([0, 20, 57], dtype=torch.int32)
        q = torch.randn(57, hq, d).half()
        ref = paged_attention_ref(q, kc, vc, bt, seq_lens, qsl, 0.2)
        for scalar in (True, False):
            plan = dict(BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=1, num_warps=4, num_stages=2, BT_SCALAR=scalar)
            out = _paged_attention(q, kc, vc, bt, seq_lens, qsl, 0.2, 37, 72, plan=plan)
            assert _rel(out, ref) < 5e-3, scalar
    elif name == "paged_attention_kv_ahead":
        # KV_AHEAD (the next tile's K/V and the block-table entries two tiles ahead loaded before the
        # tile's dots): decodes whose contexts end inside a tile, split or not, a chunk behind its
        # context and a fresh prompt; 16-key tiles over 4-key pages of a shuffled table
        from tandem.kernels.attention import paged_attention_ref
        from tandem.kernels.triton.attention import _paged_attention
        for args in _paged_batches():
            ref = paged_attention_ref(*args[:7])
            max_q = args[7]
            for scalar in (True, False):
                for splits in ((1, 2) if max_q == 1 else (1,)):
                    plan = dict(BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=splits, num_warps=4, num_stages=1,
                                BT_SCALAR=scalar, KV_AHEAD=True)
                    out = _paged_attention(*args, plan=plan)
                    assert _rel(out, ref) < 5e-3, (max_q, scalar, splits)
    elif name == "paged_attention_quant_out":
        # the output written as the FP8 o projection's input (kernels.fp8.QuantRows, one scale a token's
        # head), split or not: the same values as the unquantized launch's output through quantize_rows
        # (scales exactly; the interpreter's e4m3 cast misrounds, so the values within 10%)
        from tandem.kernels.fp8 import E4M3, quantize_rows
        from tandem.kernels.triton.attention import _paged_attention
        for args in _paged_batches():
            q, max_q, (hq, d) = args[0], args[7], args[0].shape[1:]
            for splits in ((1, 2) if max_q == 1 else (1,)):
                plan = dict(BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=splits, num_warps=4, num_stages=1)
                ref_q, ref_s = quantize_rows(_paged_attention(*args, plan=plan).flatten(1), E4M3, d)
                got_q, got_s = _paged_attention(*args, plan=plan, quant=(E4M3, d))
                assert got_q.shape == ref_q.shape and got_s.shape == ref_s.shape == (len(q), hq)
                assert torch.equal(got_s, ref_s), (max_q, splits)
                assert _rel(got_q.float(), ref_q.float()) < 0.1, (max_q, splits)
    elif name == "paged_attention_partials":
        # partials (the FP8 o projection's TMA GEMM merging them): one token whose launch splits K hands over its
        # split-K partials, whose merged() is the merge launch's output, as rows or (quant) as the QuantRows the o
        # projection takes without partials; a launch that does not split returns its output as without them
        from tandem.kernels import attention
        from tandem.kernels.fp8 import E4M3, QuantRows
        from tandem.kernels.linear import SplitPartials
        from tandem.kernels.triton.attention import _paged_attention
        qs, kc, vc, bt, _, _, scale, _, bound = next(_paged_batches())
        q, seq_lens, qsl, d = qs[:1], torch.tensor([70], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 32
        args = (q, kc, vc, bt[:1], seq_lens, qsl, scale, 1, bound)
        for splits, quant in ((2, None), (2, (E4M3, d)), (1, (E4M3, d)), (1, None)):
            plan = dict(BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=splits, num_warps=4, num_stages=1)
            want = _paged_attention(*args, plan=plan, quant=quant)
            got = _paged_attention(*args, plan=plan, quant=quant, partials=True)
            if splits == 1:
                assert not isinstance(got, SplitPartials)
            else:
                assert isinstance(got, SplitPartials) and got.acc.shape == (1, 4, splits, d) and got.block_n == 16
                assert tuple(got.rows.shape) == (1, 4 * d) and got.rows.dtype == q.dtype
                got = got.merged()
                want = want if quant else want.flatten(1)
            for a, b in zip(got if quant else [got], want if quant else [want]):
                assert torch.equal(a, b), (splits, quant)
        # paged_attention (what the engine calls; the Triton path on the 2-split plan) wraps the merged quantized
        # rows as QuantRows
        plan = dict(BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=2, num_warps=4, num_stages=1)
        from tandem.kernels.triton import attention as triton_attention
        plans, use = triton_attention._launch_plans, attention.use_triton
        triton_attention._launch_plans = lambda *a: [dict(plan, Q_RANGE=triton_attention._ALL_Q)]
        attention.use_triton = lambda t: True
        try:
            parts = attention.paged_attention(*args, quant=(E4M3, d), partials=True)
        finally:
            triton_attention._launch_plans, attention.use_triton = plans, use
        rows = parts.merged()
        want = _paged_attention(*args, plan=plan, quant=(E4M3, d))
        assert isinstance(rows, QuantRows) and torch.equal(rows.q, want[0]) and torch.equal(rows.s, want[1])
        assert rows.group == d and rows.dtype == q.dtype
    elif name == "paged_attention_fp8_mid_grid":
        # the rule's plans over an e4m3 cache (4-key pages, a shuffled table) around the mid-grid bound: 8
        # decodes x 2 KV heads (16 programs: the batch-of-one split plan, KV_AHEAD), and those with a 40-token
        # prompt (18 programs: the mid-grid narrow launch, 2 splits, beside the wide launch for the prompt)
        from tandem.kernels.attention import paged_attention_ref
        from tandem.kernels.triton.attention import _launch_plans, _paged_attention
        page, hq, hk, d, seqs = 4, 4, 2, 32, 9
        lens = torch.randint(3, 300, (seqs,), dtype=torch.int32)
        lens[-1] = 40
        pages = (lens + page - 1) // page
        kc = torch.randn(int(pages.sum()), page, hk, d).to(torch.float8_e4m3fn)
        vc = torch.randn(int(pages.sum()), page, hk, d).to(torch.float8_e4m3fn)
        perm, bt = torch.randperm(int(pages.sum()), dtype=torch.int32), torch.zeros(seqs, int(pages.max()),
                                                                                   dtype=torch.int32)
        for s_, (lo, n) in enumerate(zip((pages.cumsum(0) - pages).tolist(), pages.tolist())):
            bt[s_, :n] = perm[lo:lo + n]
        qsl = torch.tensor([0] + list(range(1, seqs)) + [seqs - 1 + 40], dtype=torch.int32)
        q = torch.randn(seqs - 1 + 40, hq, d).half()
        for n, max_q in ((seqs - 1, 1), (seqs, 40)):
            args = (q[:int(qsl[n])], kc, vc, bt[:n], lens[:n], qsl[:n + 1], 0.2)
            plans = _launch_plans(args[0], hq // hk, n, hk, max_q, 320, kv_bytes=1)
            narrow = plans[0]
            assert (narrow["num_warps"], narrow["NUM_SPLITS"], len(plans)) == ((8, 2, 1) if n == 8 else (4, 2, 2)), plans
            out = _paged_attention(*args, max_q, 320)
            assert _rel(out, paged_attention_ref(*args)) < 5e-3, n
    elif name == "moe_align":
        # grouping (token, slot) pairs by expert: the one-program kernel (atomic ranks) and the three-launch
        # path; each expert's blocks hold exactly its pairs (in any order), ids out of range left out; the
        # one-program kernel puts its counters back to zero (a second call sees them so)
        from tandem.kernels.triton.device import tickets
        from tandem.kernels.triton.moe_align import _align
        for pairs, experts, block_m in ((24, 8, 16), (256, 128, 16), (1000, 64, 32), (1500, 128, 16)):
            ids = torch.randint(0, experts, (pairs,), dtype=torch.int32)
            ids[::7] = -1
            ids[3] = experts  # (another rank's expert, as a local id past the range)
            max_blocks = -(-pairs // block_m) + min(experts, pairs)
            for _ in range(2):
                rows, block_expert, block_rows = _align(ids, experts, block_m, max_blocks, pdl=False)
                assert int(tickets(ids.device)[:experts].abs().sum()) == 0, pairs
                got = {}
                for b in range(max_blocks):
                    e, n = int(block_expert[b]), int(block_rows[b])
                    assert (e == -1) == (n == 0) and 0 <= n <= block_m, (pairs, b, e, n)
                    if e >= 0:
                        got.setdefault(e, []).extend(rows[b * block_m:b * block_m + n].tolist())
                want = {e: sorted(torch.nonzero(ids == e).flatten().tolist()) for e in range(experts)}
                assert {e: sorted(v) for e, v in got.items()} == {e: v for e, v in want.items() if v}, pairs
                used = [int(e) for e in block_expert if e >= 0]
                assert used == sorted(used), pairs  # experts' runs in expert order
    else:
        raise ValueError(f"unknown case {name}")


def _main() -> None:
    for name in CASES:
        try:
            run_case(name)
            error = ""
        except AssertionError as e:
            error = f"mismatch: {e}"
        print(json.dumps({"case": name, "error": error}), flush=True)


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    stdout = run_under_interpreter("tests.kernels.test_triton_interpreter", timeout=900)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r["error"] for r in map(json.loads, lines)}


@pytest.mark.parametrize("case", CASES)
def test_kernel_in_interpreter(results, case):
    assert case in results, f"{case} did not run"
    assert results[case] == "", results[case]


if __name__ == "__main__":
    _main()
