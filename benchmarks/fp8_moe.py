"""The FP8 fused MoE experts (kernels/triton/fp8.py fused_experts_fp8_triton) at decode token counts
on cold weights: the plan moe_config picks against a sweep of tile plans, for the Qwen3-30B-A3B
expert shape (hidden 2048, moe_intermediate 768, 128 experts, top 8), block [128, 128] and
per-channel weights; the data for moe_config's decode plans.

Every plan is checked against kernels.fp8.fused_experts_fp8_ref before it is timed; one that fails
(does not compile, does not fit) or computes something else is reported and not timed. Timing: back
to back inside a CUDA graph cycling over weight copies whose active experts overflow L2 several
times (a decode step reads each layer's experts from HBM; 8 active experts are ~38 MB of fp8 and
an H100's L2 is 50 MB). Floor: the active experts' fp8 weights + scales / the copy bandwidth
measured in the same run. Also the bf16 experts (fused_experts_triton) on the same routing.

Search: the two expert GEMMs are separate launches, so it goes one GEMM at a time: the w13
GEMM's (BLOCK_N1, num_warps1, num_stages1) with the w2 GEMM on the current plan, then the w2
GEMM's (BLOCK_N2, num_warps2, num_stages2) with w13 on its best. BLOCK_M stays the current plan's.

    python -m benchmarks.fp8_moe --tokens 1 16 --layouts block channel --out moe.json
"""
import math
import time

import torch

from benchmarks.fp8_gemm import _timed_if_right

QWEN3_30B_EXPERTS = dict(hidden=2048, inter=768, experts=128, top_k=8)
BLOCK_NS = (16, 32, 64, 128)
# warps per N tile (16 rows x BLOCK_N): a 16 x 16 tile holds 2 warps' mma tiles (4 only idle); on
# one warp ptxas (sm_90a) spills the 16 x 64 w13 tile (156 B) and the 16 x 128 one (1.6 KB)
WARPS = {16: (1, 2), 32: (1, 2, 4), 64: (2, 4), 128: (2, 4)}
STAGES = (2, 3, 4, 5)  # every tile here compiles for sm_90 within shared memory (74 KB at most)
GEMM_KEYS = ("BLOCK_N", "num_warps", "num_stages")


def gemm_candidates(block_ns=BLOCK_NS, warps: dict = WARPS, stages=STAGES) -> list[tuple[int, int, int]]:
    """(BLOCK_N, num_warps, num_stages) of one expert GEMM, the pruned grid."""
    return [(bn, w, s) for bn in block_ns for w in warps[bn] for s in stages]


def expert_weights(shape: dict, block: tuple[int, int] | None, device: str, act_dtype: torch.dtype,
                   seed: int = 0) -> dict:
    """Random experts in fp8 (lists of copies q13 [E, 2I, H], q2 [E, H, I]; scales s13, s2 shared)
    and the same dequantized in act_dtype (w13_16, w2_16: the bf16 comparison)."""
    from tandem.kernels.fp8 import dequantize_weight, fp8_dtype, quantize_weight
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    dt = fp8_dtype(torch.device(device).type)
    q13, s13 = quantize_weight(torch.randn(e, 2 * i, h, device=device, generator=g) * 0.02, dt, block)
    q2, s2 = quantize_weight(torch.randn(e, h, i, device=device, generator=g) * 0.02, dt, block)
    return dict(q13=[q13], s13=s13, q2=[q2], s2=s2, w13_16=[dequantize_weight(q13, s13, block).to(act_dtype)],
                w2_16=[dequantize_weight(q2, s2, block).to(act_dtype)])


def add_copies(weights: dict, copies: int) -> None:
    """Grow every weight list of `weights` to `copies` clones (cold weights: one per call in turn)."""
    for key in ("q13", "q2", "w13_16", "w2_16"):
        while len(weights[key]) < copies:
            weights[key].append(weights[key][0].clone())


def routing(tokens: int, shape: dict, device: str, act_dtype: torch.dtype, seed: int = 1):
    """x [T, H] act_dtype, topk_weights [T, k] float32, topk_ids [T, k] int32 (k distinct experts a token)."""
    g = torch.Generator().manual_seed(seed + tokens)
    e, k = shape["experts"], shape["top_k"]
    x = torch.randn(tokens, shape["hidden"], generator=g).to(act_dtype)
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).int()
    return x.to(device), weights.to(device), ids.to(device)


def active_bytes(weights: dict, ids: torch.Tensor) -> tuple[int, int]:
    """(active experts, their fp8 weight + scale bytes): what one call must read from HBM."""
    n = torch.unique(ids[ids >= 0]).numel()
    per = sum(t[0].numel() * t.element_size() for t in (weights["q13"][0], weights["s13"], weights["q2"][0],
                                                         weights["s2"]))
    return n, n * per


def _gemm_plan(plan: dict, gemm: int) -> tuple:
    return tuple(plan.get(f"{key}{gemm}", plan.get(key)) for key in GEMM_KEYS)


def plan_text(plan: dict) -> str:
    """'w13 BN/warps/stages | w2 BN/warps/stages' of an MoE plan."""
    return " | ".join(f"w{g} " + "/".join(map(str, _gemm_plan(plan, i))) for i, g in ((1, "13"), (2, "2")))


def measure(tokens: int, layout: str, shape: dict, weights: dict, timer, bw: float,
            cands: list[tuple[int, int, int]] | None = None, act_dtype: torch.dtype = torch.bfloat16,
            w8a16: bool = False) -> dict:
    """One token count and layout: the current plan, the one-GEMM-at-a-time sweep (module docstring)
    and the bf16 experts, each checked against its reference first. timer(run) -> microseconds of
    run(i), i the weight copy; bw: copy bandwidth (bytes/s) for the floor. Returns the summary with
    every plan's row under "rows" (us None: reported, not timed). w8a16: the plans are the bf16
    experts' reading the fp8 weights (kernels/triton/moe.py with scales), checked against the bf16
    reference on the dequantized weights."""
    from tandem.kernels.fp8 import fused_experts_fp8_ref
    from tandem.kernels.moe import fused_experts_ref
    from tandem.kernels.triton.fp8 import fused_experts_fp8_triton, moe_config
    from tandem.kernels.triton.moe import _config, _fused_experts, fused_experts_triton
    block = (128, 128) if layout == "block" else None
    device = weights["s13"].device
    x, tw, ids = routing(tokens, shape, device.type, act_dtype)
    q13s, s13, q2s, s2 = weights["q13"], weights["s13"], weights["q2"], weights["s2"]
    if w8a16:
        ref = fused_experts_ref(x, weights["w13_16"][0], weights["w2_16"][0], tw, ids).float()
    else:
        ref = fused_experts_fp8_ref(x, q13s[0], s13, q2s[0], s2, tw, ids, block).float()
    label = f"{'w8a16' if w8a16 else 'fp8'}-moe T={tokens} {layout}"
    rows = []

    def timed(plan: dict, stage: str) -> float | None:
        def run(i: int = 0) -> torch.Tensor:
            if w8a16:
                return _fused_experts(x, q13s[i], q2s[i], tw, ids, cfg=plan, scales=(s13, s2, block))
            return fused_experts_fp8_triton(x, q13s[i], s13, q2s[i], s2, tw, ids, block, plan)
        us = _timed_if_right(label, plan, run, ref, lambda: timer(run))
        rows.append(dict(stage=stage, plan=plan, us=us))
        return us

    if w8a16:
        current = _config(tokens * shape["top_k"], shape["experts"], act_dtype, fp8_weights=True)
    else:
        current = moe_config(tokens * shape["top_k"], shape["experts"], block[1] if block else None)
    current_us = timed(current, "current")
    pinned = {f"{key}{g}": current[key] for key in ("num_warps", "num_stages") for g in (1, 2)}
    best = dict(current, **pinned)
    for gemm in (1, 2):
        timed_here = []
        for bn, warps, stages in cands or gemm_candidates():
            plan = dict(best, **{f"BLOCK_N{gemm}": bn, f"num_warps{gemm}": warps, f"num_stages{gemm}": stages})
            us = timed(plan, f"w{'13' if gemm == 1 else '2'}")
            if us is not None:
                timed_here.append((us, plan))
        if timed_here:
            best = min(timed_here, key=lambda t: t[0])[1]
    best_row = min((r for r in rows if r["us"] is not None), key=lambda r: r["us"], default=None)

    def run16(i: int = 0) -> torch.Tensor:
        return fused_experts_triton(x, weights["w13_16"][i], weights["w2_16"][i], tw, ids)
    ref16 = fused_experts_ref(x, weights["w13_16"][0], weights["w2_16"][0], tw, ids).float()
    bf16_us = _timed_if_right(label + " bf16", {}, run16, ref16, lambda: timer(run16))
    n_active, nbytes = active_bytes(weights, ids)
    floor_us = nbytes / bw * 1e6
    bytes16 = n_active * sum(w[0][0].numel() * w[0].element_size() for w in (weights["w13_16"], weights["w2_16"]))
    pct = lambda us, floor=floor_us: floor / us if us else None  # noqa: E731
    return dict(model="w8a16-moe" if w8a16 else "fp8-moe", layout=layout, tokens=tokens, active_experts=n_active,
                bytes=nbytes,
                floor_us=floor_us, current_plan=current, current_us=current_us, current_of_floor=pct(current_us),
                best_plan=best_row and best_row["plan"], best_us=best_row and best_row["us"],
                best_of_floor=best_row and pct(best_row["us"]), bf16_us=bf16_us,
                bf16_of_floor=pct(bf16_us, bytes16 / bw * 1e6),
                not_timed=sum(r["us"] is None for r in rows), rows=rows)


def table(summaries: list[dict]) -> str:
    """The compact table: one line per layout and token count (times in us, % of the floor)."""
    def f(v, fmt: str) -> str:
        return format(v, fmt) if v is not None else "-"
    head = ("layout", "T", "exp", "MB", "floor", "current", "%", "best", "%", "bf16", "%", "bad")
    widths = (7, 3, 4, 6, 7, 8, 4, 7, 4, 7, 4, 3)
    lines = [" ".join(h.rjust(w) for h, w in zip(head, widths)) + "  best plan (w13 | w2: BLOCK_N/warps/stages)"]
    for s in summaries:
        cells = (s["layout"], s["tokens"], s["active_experts"], f"{s['bytes'] / 1e6:.1f}", f"{s['floor_us']:.1f}",
                 f(s["current_us"], ".1f"), f(s["current_of_floor"], ".0%"), f(s["best_us"], ".1f"),
                 f(s["best_of_floor"], ".0%"), f(s["bf16_us"], ".1f"), f(s["bf16_of_floor"], ".0%"), s["not_timed"])
        lines.append(" ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + "  "
                     + (plan_text(s["best_plan"]) if s["best_plan"] else "-"))
    return "\n".join(lines)


def run(tokens_list=(1, 16), layouts=("block", "channel"), shape: dict = QWEN3_30B_EXPERTS, w8a16: bool = False,
        cands: list[tuple[int, int, int]] | None = None) -> dict:
    """The sweep on this GPU (times in microseconds per call, cold weights; module docstring)."""
    from benchmarks.profile_decode import _in_graph_us
    from benchmarks.roofline import copy_bandwidth
    bw = copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + written), L2 {l2 / 2**20:.0f} MiB", flush=True)
    summaries = []
    for layout in layouts:
        weights = expert_weights(shape, (128, 128) if layout == "block" else None, "cuda", torch.bfloat16)
        for tokens in tokens_list:
            _, nbytes = active_bytes(weights, routing(tokens, shape, "cpu", torch.bfloat16)[2])
            copies = min(8, max(4, math.ceil(4 * l2 / nbytes)))  # each copy leaves L2 before its next turn
            add_copies(weights, copies)
            t0 = time.perf_counter()
            s = measure(tokens, layout, shape, weights, lambda fn, c=copies: _in_graph_us(fn, c, 2 * c), bw, cands,
                        w8a16=w8a16)
            s.update(copies=copies, seconds=time.perf_counter() - t0)
            summaries.append(s)
            print(table([s]).splitlines()[1], f"({s['seconds']:.0f} s)", flush=True)
        del weights
        torch.cuda.empty_cache()
    print(table(summaries))
    return dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_bw=bw, shape=shape,
                summaries=summaries)


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path
    ap = argparse.ArgumentParser(description="FP8 MoE experts: decode tile plan sweep on cold weights")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="token counts (decode batch) to sweep")
    ap.add_argument("--layouts", nargs="+", choices=["block", "channel"], default=["block", "channel"],
                    help="weight scales: block [128, 128] and/or per-channel")
    ap.add_argument("--w8a16", action="store_true",
                    help="sweep the W8A16 decode path (the bf16 expert kernels reading the fp8 weights)")
    ap.add_argument("--stages", type=int, nargs="+", default=list(STAGES), help="num_stages candidates")
    ap.add_argument("--out", default=None, help="write the summaries and every plan's row as JSON here")
    args = ap.parse_args()
    result = run(tuple(args.tokens), tuple(args.layouts), w8a16=args.w8a16,
                 cands=gemm_candidates(stages=tuple(args.stages)))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
