"""What a kernel boundary costs at decode, against a grid barrier inside one persistent launch.

A decode step at batch 1 is a chain of short launches, each streaming a weight and depending on the
one before. This measures that shape with no math in the way. Each stage streams its own slice of
bytes (int32 words summed; distinct bytes a stage, so nothing is left in L2) and takes one value that
another program wrote in the stage before. n stages run two ways:
  chain: n launches in a CUDA graph, with or without PDL; with EARLY, each program requests its slice
    before the PDL wait, while the launch ahead still runs (as the decode GEMM's first weight tile);
  persistent: one launch whose programs stay resident, a grid barrier between stages (a release add
    on one counter, acquire loads until it reaches the count); with EARLY, the next stage's slice is
    requested before the barrier.
us a stage = (T(40 stages) - T(8 stages)) / 32, median of 20 graph replays; the stages' results are
checked against a torch reference first. Every program must be resident at once for the barrier, so
grids are at most 4 programs an SM.

  python -m benchmarks.boundary --out boundary.json
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from tandem.kernels.triton.pdl import wait_previous

# (programs an SM, bytes a program a stage, warps): no bytes (the boundary alone), then a 4096 x 4096
# fp8 weight's worth of bytes a stage (17.3 MB on 132 SMs) cut four ways
SHAPES = [(2, 256, 4), (1, 256, 4), (2, 65536, 4), (2, 65536, 8), (1, 131072, 8), (4, 32768, 4)]
STAGES = (8, 40)


@triton.jit
def _stage_kernel(w_ptr, dep_in, dep_out, WORDS: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """One stage as a launch: dep_out[p] = sum of program p's WORDS words of w + dep_in[(p + 1) % programs]."""
    pid = tl.program_id(0)
    offs = tl.arange(0, WORDS)
    w = tl.zeros([WORDS], tl.int32)
    if EARLY:
        w = tl.load(w_ptr + pid * WORDS + offs)
    wait_previous(PDL)
    if not EARLY:
        w = tl.load(w_ptr + pid * WORDS + offs)
    d = tl.load(dep_in + (pid + 1) % tl.num_programs(0))
    tl.store(dep_out + pid, tl.sum(w, axis=0) + d)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _grid_barrier(count_ptr, target):
    """Every program's writes so far are visible to every program once the count reaches target."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = _load_acquire(count_ptr)
    while seen < target:
        seen = _load_acquire(count_ptr)
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(w_ptr, dep_ptr, count_ptr, n_stages, stage_words, WORDS: tl.constexpr, EARLY: tl.constexpr):
    """All stages in one launch: dep[s + 1, p] as _stage_kernel's dep_out of stage s, w [stages, programs *
    WORDS], dep [stages + 1, programs]; count_ptr a zeroed int32."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, WORDS)
    w = tl.load(w_ptr + pid * WORDS + offs)
    for s in range(n_stages):
        if not EARLY:
            w = tl.load(w_ptr + s * stage_words + pid * WORDS + offs)
        d = tl.load(dep_ptr + s * nprog + (pid + 1) % nprog)
        tl.store(dep_ptr + (s + 1) * nprog + pid, tl.sum(w, axis=0) + d)
        if EARLY:  # the next stage's slice (the last stage re-reads its own: nothing past the end)
            w = tl.load(w_ptr + tl.minimum(s + 1, n_stages - 1) * stage_words + pid * WORDS + offs)
        _grid_barrier(count_ptr, (s + 1) * nprog)


def stages_ref(w: torch.Tensor, dep0: torch.Tensor) -> torch.Tensor:
    """w [stages, programs * words] int32, dep0 [programs] -> dep [stages + 1, programs]."""
    n, p = w.shape[0], dep0.numel()
    dep = [dep0]
    sums = w.view(n, p, -1).sum(-1, dtype=torch.int64).to(torch.int32)
    for s in range(n):
        dep.append(sums[s] + dep[-1].roll(-1))
    return torch.stack(dep)


def chain(w: torch.Tensor, dep: torch.Tensor, n: int, early: bool, pdl: bool, warps: int) -> None:
    """Stages 0..n-1 of w as n launches, results into dep (as stages_ref)."""
    words = w.shape[1] // dep.shape[1]
    for s in range(n):
        _stage_kernel[(dep.shape[1],)](w[s], dep[s], dep[s + 1], WORDS=words, EARLY=early, PDL=pdl, num_warps=warps,
                                       **({"launch_pdl": True} if pdl else {}))


def persistent(w: torch.Tensor, dep: torch.Tensor, count: torch.Tensor, n: int, early: bool, warps: int) -> None:
    """The same in one launch (a GPU with every program resident; the interpreter runs programs one by one)."""
    count.zero_()
    _persistent_kernel[(dep.shape[1],)](w, dep, count, n, w.shape[1], WORDS=w.shape[1] // dep.shape[1], EARLY=early,
                                        num_warps=warps)


def graph_us(fn, reps: int = 20) -> float:
    """Median us of a CUDA graph replay of fn (benchmarks.profile_decode's event timing of the replay)."""
    from benchmarks.profile_decode import gpu_time_us
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(2):  # (gpu_time_us replays once more before it times: three warm-up replays)
        g.replay()
    return gpu_time_us(g.replay, reps)


def measure(per_sm: int, nbytes: int, warps: int, sms: int) -> dict:
    """us a stage of each way to run the stages, for per_sm * sms programs of nbytes each."""
    programs, words, n_max = per_sm * sms, nbytes // 4, STAGES[-1]
    w = torch.randint(0, 4, (n_max, programs * words), dtype=torch.int32, device="cuda")
    dep = torch.zeros(n_max + 1, programs, dtype=torch.int32, device="cuda")
    dep[0] = torch.arange(programs, dtype=torch.int32, device="cuda")
    ref = stages_ref(w, dep[0])
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    ways = {f"chain{' pdl' if pdl else ''}{' early' if early else ''}": (lambda n, e=early, p=pdl: chain(
        w, dep, n, e, p, warps)) for pdl in (False, True) for early in (False, True)}
    ways.update({f"persistent{' early' if early else ''}": (lambda n, e=early: persistent(w, dep, count, n, e, warps))
                 for early in (False, True)})
    out = {}
    for name, run in ways.items():
        dep[1:].zero_()
        run(n_max)
        torch.cuda.synchronize()
        if not torch.equal(dep, ref):
            raise SystemExit(f"{name}: stage results differ from the reference")
        lo, hi = (graph_us(lambda n=n: run(n)) for n in STAGES)
        out[name] = (hi - lo) / (STAGES[1] - STAGES[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args()
    from benchmarks.roofline import copy_bandwidth
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "triton": triton.__version__, "rows": []}
    print(f"{res['device']}: copy {bw / 1e9:.0f} GB/s, {sms} SMs, Triton {triton.__version__}")
    for per_sm, nbytes, warps in SHAPES:
        floor = per_sm * sms * nbytes / bw * 1e6
        row = dict(programs=per_sm * sms, bytes=nbytes, warps=warps, floor_us=floor,
                   us=measure(per_sm, nbytes, warps, sms))
        res["rows"].append(row)
        print(f"{row['programs']} programs x {nbytes} B, {warps} warps (floor {floor:.2f} us): " +
              ", ".join(f"{k} {v:.2f}" for k, v in row["us"].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
