"""Per-device facts and scratch that several of our kernels share."""
import functools

import torch

MAX_TICKETS = 1 << 16


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of a GPU; 132 (an H100) for a CPU tensor, which only
    the Triton interpreter runs (tests), so launch plans there match a real GPU's."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def tickets(device: torch.device) -> torch.Tensor:
    """MAX_TICKETS int32 counters, zero between launches: a kernel whose programs combine their
    partial results takes one counter per group of programs, and the group's last program (the
    one that drew count - 1) combines them and puts the counter back to 0. Launches on one
    stream run one after another, so every such kernel may use the same counters."""
    return torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)
