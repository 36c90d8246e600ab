"""Program clocks for benchmarks.program_trace (CUDA): a kernel compiled with its TRACE constexpr stamps the GPU's
nanosecond clock (%globaltimer) at points of its choosing into its program's row of 8 int64, and its SM's id
(%smid) into column SM with the first stamp. Off (TRACE False) a kernel compiles as if this file did not exist.
The Gluon TMA GEMM has its own copy of `stamp` (kernels/triton/fp8_tma.py _stamp: Gluon kernels call Gluon
functions), with the same row layout."""
import torch
import triton
import triton.language as tl

# the columns every traced kernel uses (WEIGHT_IN: the GEMMs'; ISSUED: the ring's, its first stages requested)
START, RELEASED, WEIGHT_IN, END, SM, ISSUED = range(6)
ROW = 8


@triton.jit
def stamp(trace_ptr, slot: tl.constexpr):
    """The clock into column `slot` of this program's row (programs numbered over a grid of up to three axes, the
    last fastest); with slot 0 (START) the SM too, and every other column but SM's set to 0, so that a program
    returning before its other stamps leaves 0 there whatever the row held."""
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    row = trace_ptr + pid.to(tl.int64) * 8
    if slot == 0:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(row + 4, sm.to(tl.int64))
        for col in tl.static_range(1, 8):
            if col != 4:  # (SM)
                tl.store(row + col, 0)
    tl.store(row + slot, tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                                   is_pure=False, pack=1))


class Trace(list):
    """A trace list (trace_args) whose buffers are cut from one arena allocated before a CUDA graph capture, outside
    the graph's memory pool: buffers allocated inside a decode step's capture came back holding other bytes after
    its replays (benchmarks/RESULTS.md, forty-first session)."""

    def __init__(self, rows: int, device: torch.device):
        super().__init__()
        self.arena = torch.zeros(rows, ROW, device=device, dtype=torch.int64)
        self.used = 0

    def take(self, programs: int) -> torch.Tensor:
        if self.used + programs > self.arena.shape[0]:
            raise RuntimeError(f"trace arena of {self.arena.shape[0]} rows is full ({self.used} used, {programs} more)")
        self.used += programs
        return self.arena[self.used - programs:self.used]


def trace_args(trace: list | None, name: str, programs: int, device: torch.device) -> dict:
    """A traced launch's keyword arguments: a buffer of [programs, ROW] int64 appended to trace as (name, buffer)
    and TRACE on; none without a trace list. The buffer is cut from a Trace's arena, else allocated empty (a fill
    would put a memset between this launch and the one ahead in a graph); each program's first stamp clears its
    row's other clock columns."""
    if trace is None:
        return {}
    buf = trace.take(programs) if isinstance(trace, Trace) else torch.empty(programs, ROW, device=device,
                                                                            dtype=torch.int64)
    trace.append((name, buf))
    return dict(trace_ptr=buf, TRACE=True)
