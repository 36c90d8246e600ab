"""Host staging of KV blocks for the tcp transport: cache slices <-> bytes.

The cache is [2 (k|v), layers, blocks, block_size, kv_heads, head_dim]; a payload is the
contiguous bytes of cache[:, layers, blocks, :, head:head + num_heads].
"""
import torch


def _index(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int], layer: int = -1, head: int = 0,
                  num_heads: int | None = None) -> bytes:
    """Bytes of heads [head, head + num_heads) of block_ids, all layers (layer < 0) or one."""
    num_heads = kv_cache.shape[4] - head if num_heads is None else num_heads
    layers = slice(None) if layer < 0 else slice(layer, layer + 1)
    part = kv_cache[:, layers][:, :, _index(kv_cache, block_ids), :, head:head + num_heads]
    return part.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], payload: bytes | memoryview, layer: int = -1,
                   head: int = 0, num_heads: int | None = None) -> None:
    """The inverse of gather_blocks: write payload into those heads of block_ids."""
    num_heads = kv_cache.shape[4] - head if num_heads is None else num_heads
    num_layers = kv_cache.shape[1] if layer < 0 else 1
    shape = (2, num_layers, len(block_ids), kv_cache.shape[3], num_heads, kv_cache.shape[5])
    expected = kv_cache.element_size() * torch.Size(shape).numel()
    if len(payload) != expected:
        raise ValueError(f"KV payload has {len(payload)} bytes, expected {expected} for {len(block_ids)} blocks")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(kv_cache.dtype).view(shape)
    data = data.to(kv_cache.device, non_blocking=False)
    layers = slice(None) if layer < 0 else slice(layer, layer + 1)
    idx = _index(kv_cache, block_ids)
    kv_cache[:, layers, :, :, head:head + num_heads][:, :, idx] = data  # (a view: writes through)
