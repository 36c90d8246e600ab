"""The FP8 decode GEMM (1-16 rows, (128, 128) block scales) fed by TMA, in Gluon, against the engine's Triton one.

Why: the Triton decode GEMM (kernels/triton/fp8_skinny.py) pipelines its weight tiles with cp.async, whose
addresses live in registers: the twenty-fourth session's single-launch MLP took 238-255 registers a thread for
paired 128-row tiles. TMA copies a whole tile from one descriptor and a coordinate into shared memory and signals
an mbarrier, so a program keeps many tiles in flight at ~60 registers. This measures what that alone gives one GEMM.

Kernel: out.T = w @ x.T for a strip of 128 weight rows (the wgmma's M side) over 1/SPLIT of K. Tiles of w
[128, 128] and x [16, 128] (fp8; TMA fills rows past M with zeros) land in STAGES shared-memory stages, one
mbarrier each; a stage is refilled with the tile STAGES ahead once its synchronous wgmma has read it. Each K
tile's product is scaled by the rows' x scales and the strip's weight scale. SPLIT > 1: float32 partials, a
ticket, the strip's last program sums them (as the Triton kernel). PDL: the first STAGES weight tiles are
requested before the wait (they depend on no kernel ahead), x's after it.

Gluon is Triton's experimental tile language (`triton.experimental.gluon`); the device image's Triton 3.6 and
this machine's 3.9 name two things differently (TMA_LOAD, CTA_BARRIER below).

  python -m benchmarks.gluon_gemv                 # the 8B shapes at 1 row, with and without PDL
  python -m benchmarks.gluon_gemv --rows 1 16 --out gemv.json

Each figure is us a GEMM: 8 distinct weights (none left in L2) chained in one CUDA graph, the median replay
(benchmarks.boundary.graph_us) / 8; the Gluon chain includes the activation quantization launch ahead of
each GEMM, the Triton chain runs each GEMM as the engine does (its plan quantizes in the GEMM or in a launch
ahead). The floor is the weight's bytes over the copy rate measured in the same run.
"""
import argparse
import json

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BN, BK, BM = 128, 128, 16
TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # 3.9 / 3.6
CTA_BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.9 / 3.6
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # Llama-3-8B: qkv, o, gate_up, down
PLANS = ((4, 4), (8, 4), (2, 8), (4, 8))  # (SPLIT, STAGES)


@gluon.jit
def gemv_tma_kernel(w_desc, x_desc, xs_ptr, ws_ptr, part_ptr, out_ptr, ticket_ptr, M, N, K, stride_xs, stride_ws,
                    SPLIT: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    BN_: gl.constexpr = w_desc.block_type.shape[0]
    BK_: gl.constexpr = w_desc.block_type.shape[1]
    BM_: gl.constexpr = x_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    per = K // BK_ // SPLIT  # K tiles a program (gemv_tma checks that they divide)
    kb0 = pid_k * per
    n0 = pid_n * BN_

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN_, BK_], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM_, BK_], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):  # the weights depend on no kernel ahead: requested before the PDL wait
        if i < per:
            mbarrier.expect(bars.index(i), nbytes)
            TMA_LOAD(w_desc, [n0, (kb0 + i) * BK_], bars.index(i), w_smem.index(i))
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for i in gl.static_range(STAGES):
        if i < per:
            TMA_LOAD(x_desc, [0, (kb0 + i) * BK_], bars.index(i), x_smem.index(i))

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BM_, 256 // w_desc.dtype.primitive_bitwidth])
    rm = gl.arange(0, BM_, layout=gl.SliceLayout(0, mma))
    rn = n0 + gl.arange(0, BN_, layout=gl.SliceLayout(1, mma))
    m_mask = rm < M
    acc = gl.zeros([BN_, BM_], gl.float32, mma)
    for t in range(per):
        s = t % STAGES
        mbarrier.wait(bars.index(s), (t // STAGES) & 1)
        d = warpgroup_mma(w_smem.index(s), x_smem.index(s).permute((1, 0)), acc, use_acc=False)
        kb = kb0 + t
        xs = gl.load(xs_ptr + rm * stride_xs + kb, mask=m_mask, other=0.0)
        acc += d * (xs * gl.load(ws_ptr + (n0 // BK_) * stride_ws + kb))[None, :]
        if t + STAGES < per:  # the wgmma above is synchronous: stage s is free again
            mbarrier.expect(bars.index(s), nbytes)
            TMA_LOAD(w_desc, [n0, (kb + STAGES) * BK_], bars.index(s), w_smem.index(s))
            TMA_LOAD(x_desc, [0, (kb + STAGES) * BK_], bars.index(s), x_smem.index(s))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    mask = m_mask[None, :] & (rn < N)[:, None]
    if SPLIT == 1:
        gl.store(out_ptr + rm[None, :] * N + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(part_ptr + (pid_k * BM_ + rm[None, :]) * N + rn[:, None], acc, mask=mask)
        CTA_BARRIER()  # every thread's partial is written before the ticket is taken
        if gl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = gl.zeros([BN_, BM_], gl.float32, mma)
            for sp in range(SPLIT):
                total += gl.load(part_ptr + (sp * BM_ + rm[None, :]) * N + rn[:, None], mask=mask, other=0.0,
                                 cache_modifier=".cg")
            gl.store(out_ptr + rm[None, :] * N + rn[:, None], total.to(out_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def layouts():
    """The shared-memory layouts of the w and x tiles (the TMA descriptors')."""
    return (gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv))


def gemv_tma(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, tickets: torch.Tensor,
             split: int = 4, stages: int = 4, pdl: bool = False) -> torch.Tensor:
    """kernels.fp8's quantized-rows GEMM: xq [M <= 16, K] e4m3 with xs [M, K / 128]; w [N, K] e4m3 with
    ws [N / 128, K / 128] -> [M, N] bf16. tickets: >= N / 128 int32 zeros (left zero)."""
    m, k = xq.shape
    n = w.shape[0]
    if not (m <= BM and k % (BK * split) == 0 and n % BN == 0 and tickets.numel() >= n // BN):
        raise ValueError(f"gluon gemv: x {tuple(xq.shape)}, w {tuple(w.shape)}, split {split}")
    wl, xl = layouts()
    out = torch.empty(m, n, device=w.device, dtype=torch.bfloat16)
    part = torch.empty(split, BM, n, device=w.device, dtype=torch.float32) if split > 1 else out
    gemv_tma_kernel[(n // BN, split)](
        TensorDescriptor.from_tensor(w, [BN, BK], wl), TensorDescriptor.from_tensor(xq, [BM, BK], xl), xs, ws, part,
        out, tickets, m, n, k, xs.stride(0), ws.stride(0), SPLIT=split, STAGES=stages, PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))
    return out


def measure(rows: list[int], layers: int = 8) -> dict:
    from benchmarks.boundary import graph_us
    from benchmarks.roofline import copy_bandwidth
    from tandem.kernels.fp8 import E4M3, fp8_linear_ref, quantize_weight
    from tandem.kernels.triton.fp8_skinny import fp8_skinny_linear_triton, quantize_rows_triton
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e9:.0f} GB/s; us a GEMM ({layers} weights chained in a graph)")
    g = torch.Generator(device="cuda").manual_seed(0)
    tickets = torch.zeros(1024, device="cuda", dtype=torch.int32)
    out = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": []}
    for n, k in SHAPES:
        weights = [quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05,
                                   block=(128, 128)) for _ in range(layers)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = fp8_linear_ref(x, *weights[0], (128, 128)).float()
            xq, xs = quantize_rows_triton(x, E4M3, 128)  # (the correctness checks' input)
            row = dict(n=n, k=k, m=m, floor_us=n * k / bw * 1e6)
            for pdl in (False, True):
                row[f"triton pdl={pdl}"] = graph_us(
                    lambda: [fp8_skinny_linear_triton(x, w, s, (128, 128), pdl=pdl) for w, s in weights]) / layers
                for split, stages in PLANS:
                    if k % (BK * split):
                        continue
                    got = gemv_tma(xq, xs, *weights[0], tickets, split, stages, pdl).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if err > 2e-2:
                        raise SystemExit(f"gluon gemv {n}x{k} m={m} split {split}: rel error {err:.1e}")

                    def chain():
                        for w, s in weights:
                            q, qs = quantize_rows_triton(x, E4M3, 128, pdl)
                            gemv_tma(q, qs, w, s, tickets, split, stages, pdl)
                    row[f"gluon s{split}/st{stages} pdl={pdl}"] = graph_us(chain) / layers
            out["rows"].append(row)
            print("  ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}" for key, v in row.items()),
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args()
    result = measure(args.rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
