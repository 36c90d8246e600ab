"""The FP8 GEMMs against torch._scaled_mm (row-wise scales, cuBLASLt) on the same fp8 operands and
shapes, for benchmarks/roofline.py (--fp8-kernels, --fp8-sweep).

Ours is timed from the bf16 activations (its activation quantization included, in the GEMM or as
the launch ahead of it); _scaled_mm from activations already in fp8, so the ratio is a little
unfair to ours. Shapes: the Llama-3-8B projections at decode rows (1, 16, 32, 64: the decode
tile's row buckets) and at 4096 prefill rows, block [128, 128] and per-channel weights.

The sweep checks and times every candidate decode-tile plan (strip width x split count, and the
activation quantization in the GEMM or ahead of it) and the prefill tiles, and prints the best
per shape: the data for kernels/triton/fp8_skinny.py's PLANS and fp8.gemm_config.
"""
import itertools

import torch

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B qkv, o, gate_up, down
SHAPES_30B = [(5120, 2048), (2048, 4096)]  # Qwen3-30B-A3B qkv, o (its experts take the MoE kernel)
ROWS = (1, 16, 32, 64, 4096)


def _operands(m: int, n: int, k: int, block):
    from tandem.kernels.fp8 import fp8_dtype, quantize_weight
    dt = fp8_dtype("cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda") * 0.02
    wq, ws = quantize_weight(w, dt, block)
    return x, wq, ws


def _scaled_mm_ms(m: int, n: int, k: int) -> float:
    from triton.testing import do_bench

    from tandem.kernels.fp8 import fp8_dtype
    dt = fp8_dtype("cuda")
    xq = torch.randn(m, k, device="cuda").to(dt)
    wq = torch.randn(n, k, device="cuda").to(dt)
    sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return do_bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))


def _row(m, n, k, block, ms, ref_ms, plan) -> dict:
    row = dict(model="fp8-gemm", what=f"{m}x{n}x{k} {'block' if block else 'channel'}", ms=ms, floor_ms=ref_ms,
               of_floor=ref_ms / ms, plan=plan)
    print("measured:", row, flush=True)
    return row


def kernel_rows() -> list[dict]:
    """Each shape and weight layout with the plan the kernels pick, vs torch._scaled_mm."""
    from triton.testing import do_bench

    from tandem.kernels.triton.fp8 import fp8_linear_triton, gemm_config
    from tandem.kernels.triton.fp8_skinny import MAX_ROWS, plan
    rows = []
    for m in ROWS:
        for n, k in SHAPES:
            ref_ms = _scaled_mm_ms(m, n, k)
            for block in ((128, 128), None):
                x, wq, ws = _operands(m, n, k, block)
                bk = block[1] if block else None
                chosen = plan(m, n, k, bk) if m <= MAX_ROWS else gemm_config(m, n, bk)
                ms = do_bench(lambda: fp8_linear_triton(x, wq, ws, block))
                rows.append(_row(m, n, k, block, ms, ref_ms, chosen))
                if block and m > MAX_ROWS:
                    rows += _blockwise_scaled_mm_row(x, wq, ws, ref_ms)
    return rows


def _blockwise_scaled_mm_row(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, ref_ms: float) -> list[dict]:
    """torch's own block-scaled GEMM (F.scaled_mm, 1x128 activations x 128x128 weights; CUTLASS on
    sm_90) on the same operands, activation quantization included as in ours: whether prefill
    should go to it as bf16 prefill goes to cuBLAS. Reported and skipped where this torch or GPU
    lacks it."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from tandem.kernels.triton.fp8 import quantize_rows_triton
    m, k = x.shape
    n = wq.shape[0]

    def run():
        xq, xs = quantize_rows_triton(x, wq.dtype, 128)
        return F.scaled_mm(xq, wq.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128, ws.t(),
                           F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    try:
        from tandem.kernels.fp8 import fp8_linear_ref
        ref = fp8_linear_ref(x, wq, ws, (128, 128)).float()
        err = ((run().float() - ref).norm() / ref.norm()).item()
        ms = do_bench(run)
    except Exception as exc:  # not in this torch / on this GPU: say so
        print(f"torch blockwise scaled_mm {m}x{n}x{k}: {type(exc).__name__}: {exc}"[:300], flush=True)
        return []
    row = dict(model="fp8-gemm", what=f"{m}x{n}x{k} block torch", ms=ms, floor_ms=ref_ms, of_floor=ref_ms / ms,
               plan=f"F.scaled_mm blockwise, relative error {err:.2g}")
    print("measured:", row, flush=True)
    return [row]


def _skinny_candidates(m: int, n: int, k: int, block_k) -> list[dict]:
    from tandem.kernels.triton.fp8_skinny import row_bucket
    bucket = row_bucket(m)
    bk = block_k or {16: 512, 32: 256, 64: 128}[bucket]
    quants = (True, False) if bucket == 16 else (False,)
    out = []
    for bn, split, quant in itertools.product((16, 32, 64), (1, 2, 4, 8), quants):
        if k % (split * bk) == 0:
            warps = 4 if bucket == 64 or bn == 64 else 2
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, QUANT=quant, num_warps=warps, num_stages=4))
    return out


def _prefill_candidates(block_k) -> list[dict]:
    bk = block_k or 128
    tiles = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (64, 256, 4, 4)]
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def _timed_if_right(label: str, cand: dict, run, ref: torch.Tensor, time_it) -> float | None:
    """time_it() for a plan whose output run() (bf16) is within 2e-2 of the float32 reference `ref`;
    None, reported, for a plan that does not fit (shared memory) or computes something else."""
    try:
        err = ((run().float() - ref).norm() / ref.norm()).item()
        t = time_it()
    except Exception as exc:
        print(f"skipped {label} {cand}: {type(exc).__name__}: {exc}"[:300], flush=True)
        return None
    if not err < 2e-2:
        print(f"WRONG {label} {cand}: relative error {err:.3g}", flush=True)
        return None
    return t


def sweep_rows(rows_list=(1, 64, 4096)) -> list[dict]:
    """Every candidate plan per shape and layout; prints the best of each and returns all rows."""
    from triton.testing import do_bench

    from tandem.kernels.fp8 import fp8_linear_ref
    from tandem.kernels.triton.fp8 import fp8_linear_triton
    from tandem.kernels.triton.fp8_skinny import MAX_ROWS, row_bucket
    rows, best = [], []
    for m in rows_list:
        for n, k in SHAPES:
            ref_ms = _scaled_mm_ms(m, n, k)
            for block in ((128, 128), None):
                x, wq, ws = _operands(m, n, k, block)
                bk = block[1] if block else None
                cands = _skinny_candidates(m, n, k, bk) if m <= MAX_ROWS else _prefill_candidates(bk)
                timed = []
                ref = fp8_linear_ref(x, wq, ws, block).float()
                for cand in cands:
                    def run():
                        return fp8_linear_triton(x, wq, ws, block, cand)
                    ms = _timed_if_right(f"{m}x{n}x{k}", cand, run, ref, lambda: do_bench(run, warmup=5, rep=20))
                    if ms is None:
                        continue
                    timed.append((ms, cand))
                    rows.append(_row(m, n, k, block, ms, ref_ms, cand))
                if not timed:
                    continue
                ms, cand = min(timed, key=lambda t: t[0])
                key = (row_bucket(m) if m <= MAX_ROWS else m, n, k, bk)
                best.append(f"    {key}: {cand},  # {ms * 1e3:.1f} us, {ref_ms / ms:.0%} of _scaled_mm")
    print("best plan per shape (decode rows: fp8_skinny.PLANS entries):")
    print("\n".join(best))
    return rows


def _cold_candidates(m: int, n: int, k: int, block_k) -> list[dict]:
    """The decode-tile plans the cold sweep tries: strip width x split x warps x the activation
    quantization in the GEMM or ahead (at 16 rows, where the rule may do either)."""
    from tandem.kernels.triton.fp8_skinny import default_plan, row_bucket
    bucket = row_bucket(m)
    base = default_plan(bucket, n, k, block_k)
    out = []
    quants = (True, False) if bucket == 16 else (False,)
    # wider strips and more warps at 64 rows, where each strip re-reads the rows' activation tiles
    widths, warp_counts = ((16, 32, 64, 128), (2, 4, 8)) if bucket == 64 else ((16, 32, 64), (2, 4))
    for bn, split, warps, quant in itertools.product(widths, (1, 2, 4, 8, 16), warp_counts, quants):
        if k % (split * base["BLOCK_K"]) == 0 and k // split >= base["BLOCK_K"]:
            out.append(dict(base, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, QUANT=quant))
    return out


def _deep_candidates(m: int, n: int, k: int, block_k) -> list[dict]:
    """Plans at 17-64 rows over the pipeline depth: the 64-row tiles keep too few weight bytes in flight
    (ncu on an H200, 2026-11-29: the 8B o projection's 256 programs, ~2 an SM, each waiting on two 4 KB
    weight tiles, read DRAM at 25%), so strip width x split x stages, 4 warps, two tiles before the wait."""
    from tandem.kernels.triton.fp8_skinny import default_plan, row_bucket
    base = dict(default_plan(row_bucket(m), n, k, block_k), num_warps=4, PRELOAD=2)
    plans = [(bn, split, st) for bn in (32, 64) for split in (1, 2, 4) for st in (4, 6, 8, 10)]
    plans += [(128, split, st) for split in (1, 2, 4) for st in (3, 4, 5)]
    return [dict(base, BLOCK_N=bn, SPLIT_K=split, num_stages=st) for bn, split, st in plans
            if k % (split * base["BLOCK_K"]) == 0 and k // split >= 2 * base["BLOCK_K"]]


def _swap_candidates(m: int, n: int, k: int, block_k) -> list[dict]:
    """SWAP plans (the weight as the wgmma's M side): strip width x split x warps x K tile (per
    channel), plus the activation quantization in the GEMM at 16 rows."""
    from tandem.kernels.triton.fp8_skinny import row_bucket, swap_plan
    bucket = row_bucket(m)
    base = swap_plan(bucket, n, k, block_k)
    out = []
    quants = (True, False) if bucket == 16 else (False,)
    bks = (block_k,) if block_k else (128, 256, 512)
    for bn, split, warps, bk, st, quant in itertools.product((64, 128), (1, 2, 4, 8, 16), (4, 8), bks, (4,), quants):
        if k % (split * bk) == 0 and k // split >= bk and not (warps == 8 and bn == 64):
            out.append(dict(base, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, BLOCK_K=bk, num_stages=st,
                            QUANT=quant))
    return out


def _time_plans(label: str, rule: dict, cands: list[dict], ref: torch.Tensor, run, timer) -> tuple[list, float]:
    """([(us, plan)] of the rule's plan and each candidate that computes ref (_timed_if_right),
    the rule's us or nan): run(plan) -> output, timer(plan) -> us per call."""
    timed = []
    for cand in [rule] + cands:
        us = _timed_if_right(label, cand, lambda: run(cand), ref, lambda: timer(cand))
        if us is not None:
            timed.append((us, cand))
    return timed, timed[0][0] if timed and timed[0][1] is rule else float("nan")


def _cold_operands(m: int, n: int, k: int, block) -> dict:
    """Operands for timing on cold weights: x, the fp8 weight wq with its scales ws, `copies` clones
    of wq (together over 256 MiB, so that none is read from L2 on its next turn), `calls` per graph,
    nbytes (weight + scale bytes) and bf16_us: the bf16 skinny GEMM on the same shape, cold too."""
    from benchmarks.profile_decode import _in_graph_us
    from tandem.kernels.linear import linear
    x, wq, ws = _operands(m, n, k, block)
    nbytes = wq.numel() + ws.numel() * 4
    copies = max(2, -(-256 * 2**20 // nbytes))
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(-(-copies // 2))]
    bf16_us = _in_graph_us(lambda i: linear(x, w16[i]), len(w16), min(len(w16), 16))
    del w16
    return dict(x=x, wq=wq, ws=ws, wqs=[wq] + [wq.clone() for _ in range(copies - 1)], copies=copies,
                calls=min(copies, 16), nbytes=nbytes, bf16_us=bf16_us)


def _cold_cases(rows_list, layouts, shapes=None):
    """(m, n, k, layout, block, _cold_operands) for every row count, shape (default: the 8B's and the
    30B's) and layout; each case's weight copies are freed before the next."""
    for m in rows_list:
        for n, k in shapes or SHAPES + SHAPES_30B:
            for layout in layouts:
                block = (128, 128) if layout == "block" else None
                yield m, n, k, layout, block, _cold_operands(m, n, k, block)
                torch.cuda.empty_cache()


def _quant_variants(rule: dict) -> list[dict]:
    """The plan the kernels pick with the activation quantization moved into the GEMM (QUANT),
    over strip widths and splits around it: whether 17-64 rows can drop the quantization launch."""
    out = []
    for bn, split in itertools.product((32, 64, 128), (1, 2, 4)):
        out.append(dict(rule, BLOCK_N=bn, SPLIT_K=split, QUANT=True))
    return out


def cold_sweep_rows(rows_list=(1,), layouts=("block",), torch_only: bool = False,
                    quant_only: bool = False, swap: bool = False, deep: bool = False,
                    shapes=None) -> list[dict]:
    """Decode-tile plans timed as a decode step runs them: back to back inside a CUDA graph over
    weight copies that do not fit in L2 (do_bench on one weight reads it from L2). Each row's
    ceiling is the copy bandwidth measured now: of_floor = (weight + scale bytes) / time / bandwidth.
    Also, on the same shape: the bf16 skinny GEMM (twice the bytes), torch's FP8 GEMM (the one
    prefill rows take, its quantization launch included: the issue's 1.2x bar), and the plan the
    kernels pick (PLANS or the rule). torch_only: that plan and torch's GEMM only; quant_only:
    that plan and _quant_variants of it; swap: that plan and _swap_candidates; deep: that plan and
    _deep_candidates. shapes: [(N, K)] (default: the 8B's and the 30B's)."""
    from benchmarks.profile_decode import _in_graph_us
    from benchmarks.roofline import copy_bandwidth
    from tandem.kernels.fp8 import fp8_linear_ref
    from tandem.kernels.triton.fp8 import _torch_fp8_gemm, _torch_gemm, fp8_linear_triton
    from tandem.kernels.triton.fp8_skinny import plan, row_bucket
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    rows, best = [], []
    for m, n, k, layout, block, op in _cold_cases(rows_list, layouts, shapes):
        x, wq, ws, wqs, copies, calls, nbytes, bf16_us = (
            op[key] for key in ("x", "wq", "ws", "wqs", "copies", "calls", "nbytes", "bf16_us"))
        ref = fp8_linear_ref(x, wq, ws, block).float()
        print(f"{m}x{n}x{k} {layout}: bf16 skinny {bf16_us:.1f} us "
              f"({2 * n * k / (bf16_us * 1e-6) / bw:.0%} of copy bw)", flush=True)
        bk = block[1] if block else None
        rule = plan(m, n, k, bk)
        timed, us_rule = _time_plans(
            f"{m}x{n}x{k}", rule,
            [] if torch_only else _quant_variants(rule) if quant_only else _swap_candidates(m, n, k, bk) if swap
            else _deep_candidates(m, n, k, bk) if deep else _cold_candidates(m, n, k, bk), ref,
            lambda cand: fp8_linear_triton(x, wq, ws, block, cand),
            lambda cand: _in_graph_us(lambda i: fp8_linear_triton(x, wqs[i], ws, block, cand), copies, calls))
        rows += [dict(model="fp8-gemm-cold", what=f"{m}x{n}x{k} {layout}", us=us,
                      of_floor=nbytes / (us * 1e-6) / bw, plan=cand, rule=cand is rule) for us, cand in timed]
        torch_us = float("nan")
        if _torch_gemm(x, wq, block) and not quant_only:
            torch_us = _timed_if_right(
                f"torch {m}x{n}x{k}", {}, lambda: _torch_fp8_gemm(x, wq, ws, block), ref,
                lambda: _in_graph_us(lambda i: _torch_fp8_gemm(x, wqs[i], ws, block), copies, calls)) or torch_us
            rows.append(dict(model="fp8-gemm-cold", what=f"{m}x{n}x{k} {layout} torch", us=torch_us,
                             of_floor=nbytes / (torch_us * 1e-6) / bw, plan="torch"))
        us, cand = min(timed, key=lambda t: t[0])
        line = (f"    {(row_bucket(m), n, k, bk)}: {cand},  # {us:.1f} us, "
                f"{nbytes / (us * 1e-6) / bw:.0%} of copy bw; rule {us_rule:.1f} us, torch {torch_us:.1f} us")
        print(line, flush=True)
        best.append(line)
    print("best cold plan per shape (fp8_skinny.PLANS entries):")
    print("\n".join(best))
    return rows


def _ring_candidates(n: int, k: int) -> list[dict]:
    """Ring plans (kernels/triton/fp8_tma.py): K shares x stages whose stages fit one program's shared memory."""
    from tandem.kernels.triton.fp8_tma import BK, MAX_STAGES, SMEM_PER_SM, STAGE_SMEM
    tiles, stage = k // BK, STAGE_SMEM
    return [dict(SPLIT=split, STAGES=st) for split in (1, 2, 4, 8, 16) for st in (2, 4, 6, MAX_STAGES)
            if tiles % split == 0 and st <= tiles // split and st * stage < SMEM_PER_SM - 16384]


def ring_sweep_rows(rows_list=(1, 16), shapes=None) -> list[dict]:
    """The TMA GEMM's ring form against the Triton decode GEMM on the same rows quantized ahead, cold weights as
    cold_sweep_rows times them (block-scaled (128, 128), 1-16 rows; a Triton plan that quantizes in the GEMM is
    timed from the bf16 rows, as the step runs it, the ring without the quantization launch it needs ahead): the
    ring's rule, each _ring_candidates plan, and the Triton plan the kernels pick, each checked against
    kernels.fp8's reference."""
    from benchmarks.profile_decode import _in_graph_us
    from benchmarks.roofline import copy_bandwidth
    from tandem.kernels.fp8 import _quantized_linear_ref
    from tandem.kernels.triton.device import num_sms
    from tandem.kernels.triton.fp8 import fp8_linear_triton
    from tandem.kernels.triton.fp8_skinny import fp8_skinny_linear_triton, plan, quantize_rows_triton
    from tandem.kernels.triton.fp8_tma import fp8_tma_ring_linear, ring_plan
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    block, rows, best = (128, 128), [], []
    for m, n, k, _, _, op in _cold_cases(rows_list, ("block",), shapes):
        x, wq, ws, wqs, copies, calls, nbytes = (op[key] for key in ("x", "wq", "ws", "wqs", "copies", "calls",
                                                                     "nbytes"))
        xq, xs = quantize_rows_triton(x, wq.dtype, 128)
        ref = _quantized_linear_ref(xq, xs, wq, ws, block, None, torch.bfloat16).float()
        of = lambda us: nbytes / (us * 1e-6) / bw  # noqa: E731
        tri = plan(m, n, k, 128)
        if tri["QUANT"]:
            def tri_run(i):
                return fp8_linear_triton(x, wqs[i], ws, block)
        else:
            def tri_run(i):
                return fp8_skinny_linear_triton(xq, wqs[i], ws, block, quantized=xs, dtype=torch.bfloat16)
        tri_us = _timed_if_right(f"triton {m}x{n}x{k}", tri, lambda: tri_run(0), ref,
                                 lambda: _in_graph_us(tri_run, copies, calls))
        rule = dict(zip(("SPLIT", "STAGES"), ring_plan(n, k, num_sms(x.device))))
        timed, rule_us = _time_plans(
            f"ring {m}x{n}x{k}", rule, [c for c in _ring_candidates(n, k) if c != rule], ref,
            lambda cand: fp8_tma_ring_linear(xq, xs, wq, ws, torch.bfloat16, plan=(cand["SPLIT"], cand["STAGES"]))[0],
            lambda cand: _in_graph_us(lambda i: fp8_tma_ring_linear(
                xq, xs, wqs[i], ws, torch.bfloat16, plan=(cand["SPLIT"], cand["STAGES"]))[0], copies, calls))
        rows += [dict(model="fp8-ring-cold", what=f"{m}x{n}x{k}", us=us, of_floor=of(us), plan=cand,
                      rule=cand is rule) for us, cand in timed]
        rows.append(dict(model="fp8-ring-cold", what=f"{m}x{n}x{k} triton", us=tri_us,
                         of_floor=of(tri_us) if tri_us else None, plan=tri))
        us, cand = min(timed, key=lambda t: t[0])
        line = (f"    {m}x{n}x{k}: ring best {cand} {us:.1f} us ({of(us):.0%} of copy bw); ring rule {rule} "
                f"{rule_us:.1f} us; triton {tri_us or float('nan'):.1f} us"
                f"{f' ({of(tri_us):.0%})' if tri_us else ''}, plan {tri}")
        print(line, flush=True)
        best.append(line)
    print("ring form against the Triton decode GEMM per shape:")
    print("\n".join(best))
    return rows


def _w8a16_candidates(k: int, block_k) -> list[dict]:
    """W8A16 plans (kernels/triton/linear.py with fp8 weights): strip width x split x warps x
    K tile (within the K block when block-scaled)."""
    bks = (64, 128) if block_k else (128, 256)
    out = []
    for bn, split, warps, bk in itertools.product((16, 32, 64), (1, 2, 4, 8), (2, 4), bks):
        if k % (split * bk) == 0 and k // split >= 2 * bk:
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=4))
    return out


def w8a16_sweep_rows(rows_list=(1,), layouts=("block",), shapes=None) -> list[dict]:
    """The W8A16 decode path (fp8 weights read into the bf16 skinny GEMM, no activation
    quantization) on cold weights, as cold_sweep_rows times the W8A8 plans: its rule
    (w8a16_config) and every candidate, each checked against fp8_linear_w8a16_ref; beside them
    the W8A8 plan the FP8 GEMM picks and the bf16 skinny GEMM (twice the bytes), in the same run.
    shapes: as cold_sweep_rows."""
    from benchmarks.profile_decode import _in_graph_us
    from benchmarks.roofline import copy_bandwidth
    from tandem.kernels.fp8 import fp8_linear_w8a16_ref
    from tandem.kernels.triton.fp8 import fp8_linear_triton
    from tandem.kernels.triton.linear import num_sms, skinny_linear_triton, w8a16_config
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    rows, best = [], []
    for m, n, k, layout, block, op in _cold_cases(rows_list, layouts, shapes):
        x, wq, ws, wqs, copies, calls, nbytes, bf16_us = (
            op[key] for key in ("x", "wq", "ws", "wqs", "copies", "calls", "nbytes", "bf16_us"))
        w8a8_us = _in_graph_us(lambda i: fp8_linear_triton(x, wqs[i], ws, block), copies, calls)
        of = lambda us, b=nbytes: b / (us * 1e-6) / bw  # noqa: E731
        print(f"{m}x{n}x{k} {layout}: bf16 skinny {bf16_us:.1f} us ({of(bf16_us, 2 * n * k):.0%} of copy bw), "
              f"W8A8 {w8a8_us:.1f} us ({of(w8a8_us):.0%})", flush=True)
        rows.append(dict(model="fp8-gemm-cold", what=f"{m}x{n}x{k} {layout}", bf16_us=bf16_us,
                         w8a8_us=w8a8_us))
        ref = fp8_linear_w8a16_ref(x, wq, ws, block).float()
        rule = w8a16_config(n, k, block[1] if block else None, num_sms(x.device))
        timed, us_rule = _time_plans(
            f"w8a16 {m}x{n}x{k}", rule, _w8a16_candidates(k, block[1] if block else None), ref,
            lambda cand: skinny_linear_triton(x, wq, cand, w_scale=ws, block=block),
            lambda cand: _in_graph_us(lambda i: skinny_linear_triton(x, wqs[i], cand, w_scale=ws, block=block),
                                      copies, calls))
        rows += [dict(model="w8a16-cold", what=f"{m}x{n}x{k} {layout}", us=us, of_floor=of(us), plan=cand,
                      rule=cand is rule) for us, cand in timed]
        us, cand = min(timed, key=lambda t: t[0])
        line = (f"    {(n, k, block[1] if block else None)}: {cand},  # {us:.1f} us, {of(us):.0%} of copy bw; "
                f"rule {us_rule:.1f}, W8A8 {w8a8_us:.1f}, bf16 {bf16_us:.1f}")
        print(line, flush=True)
        best.append(line)
    print("best W8A16 plan per shape (linear.W8A16_PLANS entries):")
    print("\n".join(best))
    return rows


def chain_rows(rows_list=(1,), layers: int = 32, swap: bool = False) -> list[dict]:
    """The Llama-3-8B decode step's FP8 GEMMs alone (block-scaled): qkv, o, gate_up, down per layer,
    each the next's input, `layers` layers' weights (none read from L2 twice), back to back in one
    CUDA graph with PDL, with the plans the kernels pick: how near the copy bandwidth the GEMMs
    come without the step's other launches. of_floor = weight + scale bytes / time / copy
    bandwidth (same run). swap: fp8_skinny.swap_plan's plans at up to 32 rows instead."""
    from benchmarks.profile_decode import _in_graph_us
    from benchmarks.roofline import copy_bandwidth
    from tandem.kernels.fp8 import fp8_dtype
    from tandem.kernels.triton.fp8 import fp8_linear_triton
    from tandem.kernels.triton.fp8_skinny import plan, row_bucket, swap_plan
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    dt = fp8_dtype("cuda")
    weights = []
    for _ in range(layers):
        layer = []
        for n, k in SHAPES:
            w = (torch.randn(n, k, device="cuda") * 0.05).to(dt)
            layer.append((w, torch.rand(n // 128, k // 128, device="cuda") * 1e-2 + 1e-3))
        weights.append(layer)
    nbytes = sum(w.numel() + ws.numel() * 4 for layer in weights for w, ws in layer)
    rows = []
    for m in rows_list:
        x0 = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        plans = [swap_plan(row_bucket(m), n, k, 128) if swap and m <= 32 else plan(m, n, k, 128) for n, k in SHAPES]

        def step():
            x = x0
            for layer in weights:
                (wqkv, sqkv), (wo, so), (wgu, sgu), (wd, sd) = layer
                x = fp8_linear_triton(x, wqkv, sqkv, (128, 128), plans[0])[:, :4096]
                x = fp8_linear_triton(x, wo, so, (128, 128), plans[1])
                x = fp8_linear_triton(x, wgu, sgu, (128, 128), plans[2])[:, :14336]
                x = fp8_linear_triton(x, wd, sd, (128, 128), plans[3])
            return x
        us = _in_graph_us(lambda i: step(), 1, 1)
        what = f"{m} rows x {layers} layers{' swap' if swap and m <= 32 else ''}"
        row = dict(model="fp8-gemm-chain", what=what, us=us, of_floor=nbytes / (us * 1e-6) / bw)
        print(f"chain {what}: {us:.0f} us, {row['of_floor']:.1%} of copy bw", flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    import argparse
    import json
    import time
    from pathlib import Path
    ap = argparse.ArgumentParser(description="the decode-tile plan sweep on cold weights (cold_sweep_rows)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--layouts", nargs="+", choices=["block", "channel"], default=["block"])
    ap.add_argument("--w8a16", action="store_true", help="sweep the W8A16 decode path instead (w8a16_sweep_rows)")
    ap.add_argument("--vs-torch", action="store_true",
                    help="time only the plan the kernels pick and torch's FP8 GEMM")
    ap.add_argument("--chain", action="store_true",
                    help="the 8B step's FP8 GEMMs back to back in one graph (chain_rows)")
    ap.add_argument("--quant-variants", action="store_true",
                    help="time only the plan the kernels pick and its variants quantizing in the GEMM")
    ap.add_argument("--swap", action="store_true",
                    help="sweep SWAP plans (the weight as the wgmma's M side); with --chain: their rule")
    ap.add_argument("--deep", action="store_true",
                    help="sweep the pipeline depth (num_stages) with strip width and split (_deep_candidates)")
    ap.add_argument("--ring", action="store_true",
                    help="the TMA GEMM's ring form against the Triton decode GEMM on rows quantized ahead (ring_sweep_rows)")
    ap.add_argument("--shapes", nargs="+", default=None, help="N,K pairs (default: the 8B's and the 30B's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else None
    if args.chain:
        result = chain_rows(tuple(args.rows), swap=args.swap)
    elif args.ring:
        result = ring_sweep_rows(tuple(args.rows), shapes)
    elif args.w8a16:
        result = w8a16_sweep_rows(tuple(args.rows), tuple(args.layouts), shapes)
    else:
        result = cold_sweep_rows(tuple(args.rows), tuple(args.layouts), args.vs_torch, args.quant_variants, args.swap,
                                 args.deep, shapes)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                                                  rows=result), indent=1))
