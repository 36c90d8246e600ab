"""Programmatic dependent launch (PDL; CUDA, compute capability 9.0 and up) for our Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
running, so it is resident when its predecessor ends instead of being launched then: that takes
the launch gap off the boundary (decode runs hundreds of small kernels a step). Every kernel of
ours calls `wait_previous(PDL)` before it touches anything a kernel ahead may write: it blocks
until the previous grid has completed and its writes are visible (`griddepcontrol.wait`), then
lets the next kernel be scheduled in turn, so the order of effects is the stream's. Only
reads of what no kernel of the step writes come before it: the decode GEMM's first weight
tile, and the step's metadata in attention, its split merge and rotary (query_start_loc,
seq_lens, positions, cos/sin, slots), whose dependent loads then overlap the kernel ahead. The
step's metadata is copied in before the forward starts. Kernels that are not ours (cuBLAS,
torch) are launched without PDL and wait for their predecessor as usual. Off with
KernelConfig.pdl false (`--no-pdl`), on ROCm and on GPUs before Hopper, where the kernels
compile without the two instructions.
"""
import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_args(t: torch.Tensor, pdl: bool) -> dict:
    """Keyword arguments for a launch of one of our kernels on t's device: the PDL flag the
    kernel passes to wait_previous, and Triton's launch_pdl where it is on (pdl: KernelConfig.pdl,
    and the GPU has it)."""
    on = pdl and t.is_cuda and _supported(t.device.index if t.device.index is not None else
                                          torch.cuda.current_device())
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def wait_previous(PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """EARLY: the next launch is let in before this one waits (its programs then wait for this whole grid, which
    waits for the one ahead: the order of effects stays the stream's), so its work ahead of its own wait (a TMA
    GEMM's weight stages) overlaps this kernel's wait and the kernel ahead."""
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not EARLY:
            tl.extra.cuda.gdc_launch_dependents()
