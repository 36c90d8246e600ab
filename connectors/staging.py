"""Host staging of KV blocks for the tcp transport: cache slices <-> bytes.

The cache is [2 (k|v), layers, blocks, block_size, kv_heads, head_dim]; a payload
is the contiguous bytes of cache[:, layers, blocks].
"""
import torch


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int], layer: int = -1) -> bytes:
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    part = kv_cache[:, :, idx] if layer < 0 else kv_cache[:, layer:layer + 1, idx]
    return part.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], payload: bytes | memoryview,
                   layer: int = -1) -> None:
    num_layers = kv_cache.shape[1] if layer < 0 else 1
    shape = (2, num_layers, len(block_ids), *kv_cache.shape[3:])
    expected = kv_cache.element_size() * torch.Size(shape).numel()
    if len(payload) != expected:
        raise ValueError(f"KV payload has {len(payload)} bytes, expected {expected} for {len(block_ids)} blocks")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(kv_cache.dtype).view(shape)
    data = data.to(kv_cache.device, non_blocking=False)
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    if layer < 0:
        kv_cache[:, :, idx] = data
    else:
        kv_cache[:, layer:layer + 1, idx] = data
