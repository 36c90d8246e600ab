"""Expert-parallel dispatch/combine on CPU (gloo, 2 and 4 ranks). Reference: fused_experts_ref
over every rank's tokens with all experts in one process."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.ep import make_dispatcher
from kernels.ep.placement import local_experts
from kernels.moe import fused_experts_ref
from tests.ports import free_port as _free_port

E, K, H, I = 8, 2, 32, 16


def _data(rank: int, counts: list[int]):
    g = torch.Generator().manual_seed(100 + rank)
    t = counts[rank]
    x = torch.randn(t, H, generator=g)
    w = torch.rand(t, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).int() if t else torch.zeros(0, K).int()
    return x, w, ids


def _weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2


def _worker(rank, size, port, backend, counts, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        w13, w2 = _weights()
        x, w, ids = _data(rank, counts)
        for placement in ("linear", "round_robin"):
            mine = local_experts(E, size, rank, placement)
            d = make_dispatcher(backend, dist.group.WORLD, E, placement)
            xd, wd, idsd, handle = d.dispatch(x, w, ids)
            results[(rank, placement)] = d.combine(fused_experts_ref(xd, w13[mine], w2[mine], wd, idsd), handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["naive", "a2a"])
@pytest.mark.parametrize("counts", [[0, 7], [3, 0, 11, 1]])  # uneven, with idle ranks
def test_dispatch_combine_matches_local_experts(backend, counts):
    size = len(counts)
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(size, _free_port(), backend, counts, results), nprocs=size)
    w13, w2 = _weights()
    for rank in range(size):
        x, w, ids = _data(rank, counts)
        ref = fused_experts_ref(x, w13, w2, w, ids)
        for placement in ("linear", "round_robin"):
            got = results[(rank, placement)]
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_placements():
    assert local_experts(8, 2, 1, "linear") == [4, 5, 6, 7]
    assert local_experts(8, 2, 1, "round_robin") == [1, 3, 5, 7]
    with pytest.raises(ValueError):
        local_experts(6, 4, 0, "linear")
