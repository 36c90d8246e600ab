"""The nixl transport on CPU (NIXL over DRAM, UCX backend): two transports in one process move
blocks of a KV cache [2, layers, blocks, block_size, kv_heads, head_dim] by READ and by
layer-wise WRITE. Reference: the source cache's blocks, compared bitwise."""
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tandem.connectors.nixl import block_runs, region_descs

SHAPE = (2, 3, 24, 4, 2, 8)  # [2, layers, blocks, block_size, kv_heads, head_dim]


def test_block_runs_coalesce_only_where_both_sides_are_consecutive():
    runs = block_runs([3, 4, 5, 9, 10, 2], [7, 8, 1, 2, 3, 4])
    assert runs.tolist() == [[3, 7, 2], [5, 1, 1], [9, 2, 2], [2, 4, 1]]
    assert block_runs([], []).shape == (0, 3)
    with pytest.raises(ValueError):
        block_runs([1], [1, 2])


def test_region_descs_address_the_blocks_of_each_kv_and_layer():
    cache = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)
    bb = cache[0, 0, 0].numel() * cache.element_size()
    descs = region_descs(cache.data_ptr(), SHAPE[1], SHAPE[2], bb, 0, range(1, 3), np.array([5, 20]), np.array([3, 1]))
    expected = [(cache[kv, layer, s].data_ptr(), n * bb) for kv in (0, 1) for layer in (1, 2) for s, n in ((5, 3), (20, 1))]
    assert [(int(a), int(n)) for a, n, _ in descs] == expected


@pytest.fixture(scope="module")
def pair():
    pytest.importorskip("nixl._api", reason="the nixl extra is not installed")
    from tandem.connectors.nixl import NixlTransport

    gen = torch.Generator().manual_seed(0)
    src_cache = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
    dst_cache = torch.zeros(SHAPE[:2] + (SHAPE[2] + 8,) + SHAPE[3:], dtype=torch.bfloat16)  # more blocks than src
    src, dst = NixlTransport(src_cache, "test-src", timeout_s=10), NixlTransport(dst_cache, "test-dst", timeout_s=10)
    src.attach("dst:1", dst.local_info())
    dst.attach("src:1", src.local_info())
    yield src, dst
    src.close()
    dst.close()


def test_read_pulls_blocks_bitwise(pair):
    src, dst = pair
    dst.kv_cache.zero_()
    remote, local = [0, 1, 2, 7, 11, 12, 23], [30, 31, 4, 5, 6, 19, 0]
    dst.read("src:1", "r0", remote, local)
    assert torch.equal(dst.kv_cache[:, :, local].view(torch.int16), src.kv_cache[:, :, remote].view(torch.int16))
    untouched = [b for b in range(dst.kv_cache.shape[2]) if b not in local]
    assert not dst.kv_cache[:, :, untouched].any()


def test_write_pushes_each_layer_bitwise(pair):
    src, dst = pair
    dst.kv_cache.zero_()
    local, remote = [3, 4, 5, 6, 20], [10, 11, 12, 2, 31]
    for layer in range(src.num_layers):
        src.write_layer("dst:1", "t0", layer, src.stage_layer(layer, local), remote)
    src.flush("dst:1")
    assert not src.pending
    assert torch.equal(dst.kv_cache[:, :, remote].view(torch.int16), src.kv_cache[:, :, local].view(torch.int16))


def test_rewriting_a_block_of_a_layer_lands_last(pair):
    """Chunked prefill pushes a partial block again once it is full: the later push must win."""
    src, dst = pair
    dst.kv_cache.zero_()
    saved = src.kv_cache[:, :, 8].clone()
    src.kv_cache[:, :, 8] = 0
    src.write_layer("dst:1", "t1", 0, src.stage_layer(0, [8]), [9])
    src.kv_cache[:, :, 8] = saved
    src.write_layer("dst:1", "t1", 0, src.stage_layer(0, [8]), [9])
    src.flush("dst:1")
    assert torch.equal(dst.kv_cache[:, 0, 9].view(torch.int16), saved[:, 0].view(torch.int16))


def test_out_of_range_blocks_are_refused(pair):
    src, dst = pair
    with pytest.raises(ValueError, match="out of range"):
        dst.read("src:1", "r1", [24], [0])  # src has 24 blocks
    with pytest.raises(ValueError, match="out of range"):
        src.write_layer("dst:1", "t2", 0, src.stage_layer(0, [0]), [32])
    with pytest.raises(RuntimeError, match="out of range"):  # the push it belonged to has not landed
        src.flush("dst:1")
    src.flush("dst:1")  # reported once


def test_one_transport_serves_several_peers_bitwise():
    """2P2D: each prefill's transport pushes to two decodes (one peer's flush leaves the other's
    pushes pending, then lands them too) and each decode's transport reads from two prefills."""
    pytest.importorskip("nixl._api", reason="the nixl extra is not installed")
    from tandem.connectors.nixl import NixlTransport

    gen = torch.Generator().manual_seed(2)
    prefills = {f"p{i}:1": NixlTransport(torch.randn(SHAPE, generator=gen), f"test-multi-p{i}", timeout_s=10)
                for i in range(2)}
    decodes = {f"d{i}:1": NixlTransport(torch.zeros(SHAPE), f"test-multi-d{i}", timeout_s=10) for i in range(2)}
    try:
        for p_name, p in prefills.items():
            for d_name, d in decodes.items():
                p.attach(d_name, d.local_info())
                d.attach(p_name, p.local_info())
        (p0, p1), (d0, d1) = prefills.values(), decodes.values()
        for layer in range(p0.num_layers):  # p0 -> d0 and p0 -> d1, interleaved
            p0.write_layer("d0:1", "t0", layer, p0.stage_layer(layer, [0, 1]), [2, 3])
            p0.write_layer("d1:1", "t1", layer, p0.stage_layer(layer, [4]), [5])
        p0.flush("d0:1")
        assert list(p0.pending) == ["d1:1"]
        p0.flush("d1:1")
        assert not p0.pending
        d0.read("p1:1", "r0", [6, 7], [8, 9])  # d0 <- p1 (and d0 <- p0 above)
        d1.read("p1:1", "r1", [10], [11])  # d1 <- p1 (and d1 <- p0 above)
        i16 = lambda t: t.view(torch.int16)  # noqa: E731
        assert torch.equal(i16(d0.kv_cache[:, :, [2, 3]]), i16(p0.kv_cache[:, :, [0, 1]]))
        assert torch.equal(i16(d1.kv_cache[:, :, 5]), i16(p0.kv_cache[:, :, 4]))
        assert torch.equal(i16(d0.kv_cache[:, :, [8, 9]]), i16(p1.kv_cache[:, :, [6, 7]]))
        assert torch.equal(i16(d1.kv_cache[:, :, 11]), i16(p1.kv_cache[:, :, 10]))
        for d, written in ((d0, [2, 3, 8, 9]), (d1, [5, 11])):
            assert not d.kv_cache[:, :, [b for b in range(SHAPE[2]) if b not in written]].any()
    finally:
        for t in [*prefills.values(), *decodes.values()]:
            t.close()


def test_rank_pairs_move_head_slices_bitwise():
    """Ranks of different TP sizes: prefill holds 4 KV heads, decode 2; a RankPair moves heads 2..3
    of prefill into heads 0..1 of decode (read), and heads 0..1 back into heads 1..2 (write)."""
    pytest.importorskip("nixl._api", reason="the nixl extra is not installed")
    from tandem.connectors.nixl import NixlTransport

    gen = torch.Generator().manual_seed(1)
    src_cache = torch.randn(2, 2, 6, 4, 4, 8, generator=gen)  # [2, layers, blocks, block_size, 4 heads, dim]
    dst_cache = torch.zeros(2, 2, 5, 4, 2, 8)
    src, dst = NixlTransport(src_cache, "test-tp-src"), NixlTransport(dst_cache, "test-tp-dst")
    try:
        src.attach("dst:1", dst.local_info())
        dst.attach("src:1", src.local_info())
        dst.read("src:1", "r", [1, 2, 5], [4, 0, 1], SimpleNamespace(src_head=2, dst_head=0, num_heads=2))
        assert torch.equal(dst_cache[:, :, [4, 0, 1]], src_cache[:, :, [1, 2, 5], :, 2:4])
        before = dst_cache.clone()
        src_cache.copy_(torch.randn(src_cache.shape, generator=gen))
        pair = SimpleNamespace(src_head=1, dst_head=0, num_heads=2)
        for layer in range(2):
            src.write_layer("dst:1", "t", layer, src.stage_layer(layer, [3], pair), [0], pair)
        src.flush("dst:1")
        assert torch.equal(src_cache[:, :, 3, :, 1:3], dst_cache[:, :, 0])
        assert torch.equal(dst_cache[:, :, 1:], before[:, :, 1:])  # no other block touched
        with pytest.raises(ValueError, match="KV heads differ"):
            dst.read("src:1", "r", [0], [0])
    finally:
        src.close()
        dst.close()


def test_missing_nixl_names_the_extra(monkeypatch):
    from tandem.connectors.nixl import NixlTransport

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # makes the import fail
    with pytest.raises(ValueError, match=r"pip install -e '\.\[nixl\]'"):
        NixlTransport(torch.zeros(SHAPE), "test-missing")


@pytest.mark.gpu
@pytest.mark.parametrize("src_device,dst_device", [
    ("cuda:0", "cuda:0"),
    pytest.param("cuda:0", "cuda:1", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"))])
def test_vram_caches_move_blocks_bitwise(src_device, dst_device):
    """VRAM registration (UCX cuda_copy / cuda_ipc): a read of scattered blocks and a layer-wise write
    of a run of blocks between two GPU KV caches. Reference: the source cache's blocks, bitwise."""
    pytest.importorskip("nixl._api", reason="the nixl extra is not installed")
    from tandem.connectors.nixl import NixlTransport

    shape = (2, 4, 64, 16, 8, 128)  # 8B-like blocks (256 KiB each in bf16), 64 of them, 4 layers
    gen = torch.Generator(device=src_device).manual_seed(0)
    src_cache = torch.randn(shape, generator=gen, device=src_device).to(torch.bfloat16)
    dst_cache = torch.zeros(shape, dtype=torch.bfloat16, device=dst_device)
    src, dst = NixlTransport(src_cache, "gpu-src", timeout_s=30), NixlTransport(dst_cache, "gpu-dst", timeout_s=30)
    try:
        assert src.mem_type == dst.mem_type == "VRAM"
        src.attach("dst:1", dst.local_info())
        dst.attach("src:1", src.local_info())
        remote, local = [0, 1, 2, 40, 63, 7], [10, 11, 12, 3, 0, 62]
        dst.read("src:1", "r", remote, local)
        torch.cuda.synchronize(dst_device)
        assert torch.equal(dst_cache[:, :, local].view(torch.int16).cpu(),
                           src_cache[:, :, remote].view(torch.int16).cpu())
        dst_cache.zero_()
        torch.cuda.synchronize(dst_device)
        local_w, remote_w = list(range(20, 52)), list(range(30, 62))
        for layer in range(shape[1]):
            src.write_layer("dst:1", "w", layer, src.stage_layer(layer, local_w), remote_w)
        src.flush("dst:1")
        torch.cuda.synchronize(dst_device)
        assert torch.equal(dst_cache[:, :, remote_w].view(torch.int16).cpu(),
                           src_cache[:, :, local_w].view(torch.int16).cpu())
        assert not dst_cache[:, :, :30].any()  # nothing outside the written blocks
    finally:
        src.close()
        dst.close()
