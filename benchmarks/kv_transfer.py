"""KV transfer bandwidth between two instances' caches over a transport, against the
peer-copy ceiling measured in the same run (one large device-to-device copy between the
two GPUs; a copy within the GPU when both instances share one).

Two processes, as in a deployment: the source (prefill) side in a spawned child on --src-device,
the measuring (decode) side in this process on --dst-device, each with a KV cache of a
Llama-3-8B layout (32 layers, 8 kv heads, head dim 128, bf16, block 16 = 2 MiB a block),
joined by the real KV agents. Same-process ends would not be representative: CUDA IPC cannot
open a handle in the process that made it, so UCX (nixl) would fall back to a host path.
Read mode: the decode side pulls N blocks of all layers and times it. Write mode (ipc, nixl):
this side pushes N blocks layer by layer, as a prefill does, and times until flush() says they
landed. --order scattered (default) pairs the blocks in reverse so no two are adjacent on both
sides (one region per block, layer and k|v: the worst case); contiguous moves them as runs.
Both caches hold a pattern that names each value's (k|v, layer, block, slot), different on each
side, so the last move of every block count is checked where it landed (read: here; write: by the
source process), and a wrong block, layer or head fails the run.
--busy-peer keeps the source's GPU busy with matmuls while transfers are timed, as a prefill
instance's GPU is while decode pulls: a transport that launches work on the peer's GPU then
waits for that GPU's time slice between the two processes.

  python -m benchmarks.kv_transfer --transport ipc --blocks 64 256 1024
  python -m benchmarks.kv_transfer --transport nixl --src-device cuda:0 --dst-device cuda:0 --mode write

nixl: UCX picks its transports itself; UCX_PROTO_INFO=y prints the choice. UCX turns cuda_ipc
reads (GET) off where NVML shows no active NVLink (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y turns them on).
Host transports also run between CPU caches (--src-device cpu --dst-device cpu; the ceiling
is then a memcpy), e.g. to compare tcp and nixl over DRAM.
"""
import argparse
import json
import multiprocessing as mp
import os
import time

import torch

LAYOUT = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128)


SOURCE, DESTINATION = 0, 60  # pattern salts: each side's cache differs from the other's everywhere


def pattern(blocks, device: str, salt: int) -> torch.Tensor:
    """The cache content of `blocks` on a side with `salt`: [2, layers, len(blocks), block_size,
    heads, head_dim], integers below 256 (exact in bf16) from each value's slot, head and dim, its
    block id, and its k|v and layer."""
    L, bs, h, d = LAYOUT["num_layers"], LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"]
    block = (torch.as_tensor(blocks, device=device) % 101).to(torch.int16).view(1, 1, -1, 1, 1, 1)
    within = (torch.arange(bs * h * d, device=device) % 37).to(torch.int16).view(1, 1, 1, bs, h, d)
    kv_layer = (torch.arange(2 * L, device=device) % 53).to(torch.int16).view(2, L, 1, 1, 1, 1)
    return (within + block + kv_layer + salt).to(torch.bfloat16)


def _cache(num_blocks: int, device: str, salt: int) -> torch.Tensor:
    return pattern(range(num_blocks), device, salt)


def landed(cache: torch.Tensor, blocks: list[int], source_blocks: list[int], salt: int) -> str | None:
    """None when cache's `blocks` hold the pattern of `source_blocks` of the side with `salt`
    (what a move of source_blocks there into blocks here leaves), else what differs."""
    got = cache[:, :, torch.tensor(blocks, device=cache.device)]
    bad = (got != pattern(source_blocks, str(cache.device), salt)).nonzero()
    if bad.numel() == 0:
        return None
    return f"{bad.shape[0]} values differ, first at (k|v, layer, i, slot, head, dim) {bad[0].tolist()}"


def _worker(cache: torch.Tensor, transport: str, name: str):
    """One rank's worker side of the connector (TP 1), as an instance builds it."""
    from tandem.connectors.layout import KVLayout
    from tandem.connectors.worker import KVConnectorWorker

    return KVConnectorWorker(name, 0, cache, KVLayout(dtype="bfloat16", **LAYOUT), transport, "127.0.0.1", 30.0)


def _whole_rank():
    """Every head of rank 0 to rank 0 (the TP 1 <-> TP 1 pair)."""
    from tandem.connectors.layout import RankPair

    return RankPair(0, 0, 0, 0, LAYOUT["num_kv_heads"])


def _set_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)


def _sync(*devices: str) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def _prefill(transport: str, device: str, num_blocks: int, busy: bool, addr_q, stop_q) -> None:
    """The source side: serves its cache until told to stop; checks what a write left in it when
    asked ("check", blocks here, the writer's blocks); with `busy`, matmuls on its GPU meanwhile."""
    import queue
    _set_device(device)
    cache = _cache(num_blocks, device, SOURCE)
    worker = _worker(cache, transport, "prefill")
    addr_q.put(worker.address)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device) if busy else None
    while True:
        try:
            msg = stop_q.get(timeout=0.0 if busy else None)
        except queue.Empty:
            a @ a  # ~1.5 ms of an H200: the GPU never idles between launches
            continue
        if msg is None:
            break
        _, blocks, source_blocks = msg
        _sync(device)
        addr_q.put(landed(cache, blocks, source_blocks, DESTINATION))
    worker.close()


def peer_copy_gbps(src: str, dst: str, nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    for _ in range(3):
        b.copy_(a)
    _sync(src, dst)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    _sync(src, dst)
    return 10 * nbytes / (time.perf_counter() - t) / 1e9


def _read(transport, peer: str, remote: list[int], local: list[int]) -> None:
    transport.read(peer, "bench", remote, local, _whole_rank())


def _write(transport, peer: str, remote: list[int], local: list[int]) -> None:
    for layer in range(LAYOUT["num_layers"]):
        pair = _whole_rank()
        transport.write_layer(peer, "bench", layer, transport.stage_layer(layer, local, pair), remote, pair)
    transport.flush(peer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="ipc", choices=["ipc", "tcp", "nixl"])
    ap.add_argument("--mode", default="read", choices=["read", "write"],
                    help="read: pull all layers at once; write: push layer by layer, then flush (ipc, nixl)")
    ap.add_argument("--src-device", default="cuda:0")
    ap.add_argument("--dst-device", default="cuda:1")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--order", default="scattered", choices=["scattered", "contiguous"],
                    help="scattered: local blocks in reverse of the remote ones (one region per block); "
                         "contiguous: the same ids on both sides (runs coalesce)")
    ap.add_argument("--busy-peer", action="store_true",
                    help="keep the source's GPU busy (back-to-back matmuls) while transfers are timed")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args()
    if args.mode == "write" and args.transport == "tcp":
        ap.error("--mode write needs a transport whose flush() waits for delivery (ipc, nixl)")
    num_blocks = max(args.blocks) + 8
    ctx = mp.get_context("spawn")
    addr_q, stop_q = ctx.Queue(), ctx.Queue()
    busy = args.busy_peer and args.src_device.startswith("cuda")
    proc = ctx.Process(target=_prefill, args=(args.transport, args.src_device, num_blocks, busy, addr_q, stop_q))
    proc.start()
    peer = addr_q.get(timeout=120)
    _set_device(args.dst_device)
    cache = _cache(num_blocks, args.dst_device, DESTINATION)
    worker = _worker(cache, args.transport, "decode")
    worker._session(peer)  # the data handshake: the transport attaches to the peer's cache
    cpu = "cpu" in (args.src_device, args.dst_device)
    ceiling = peer_copy_gbps(args.src_device, args.dst_device, 1 << (28 if cpu else 30))
    block_bytes = cache[:, :, 0].numel() * cache.element_size()
    rows = []
    for n in args.blocks:
        ids = list(range(n))
        local = ids[::-1] if args.order == "scattered" else ids
        move = _read if args.mode == "read" else _write
        move(worker.transport, peer, ids, ids)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            move(worker.transport, peer, ids, local)
            times.append(time.perf_counter() - t)
        med = sorted(times)[len(times) // 2]
        gbps = n * block_bytes / med / 1e9
        rows.append(dict(blocks=n, mib=n * block_bytes / 2**20, ms=med * 1e3, gbps=gbps, of_ceiling=gbps / ceiling))
        if args.mode == "read":  # our `local` blocks hold the source's `ids`
            error = landed(cache, local, ids, SOURCE)
        else:  # the source's `ids` hold our `local` blocks
            stop_q.put(("check", ids, local))
            error = addr_q.get(timeout=120)
        if error:
            stop_q.put(None)
            proc.join(30)
            raise SystemExit(f"kv_transfer: {n} blocks over {args.transport} ({args.mode}) landed wrong: {error}")
    stop_q.put(None)
    proc.join(30)
    worker.close()
    ends = dict(src_pid=proc.pid, dst_pid=os.getpid())
    ucx = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_"))
    print(f"transport={args.transport} mode={args.mode} {args.src_device}->{args.dst_device} "
          f"peer-copy ceiling {ceiling:.1f} GB/s (one way, {'256 MiB' if cpu else '1 GiB'} copy, same run); block = {block_bytes / 2**20:.1f} MiB (8B layout, bf16)")
    print(f"ends in two processes, as in a deployment: source (prefill) pid {ends['src_pid']} on {args.src_device}, "
          f"measuring (decode) pid {ends['dst_pid']} on {args.dst_device}; order {args.order}"
          + ("; the source's GPU busy with matmuls" if busy else "") + "; every move's blocks checked where they landed"
          + (f"; {ucx}" if ucx and args.transport == "nixl" else ""))
    print(f"{'blocks':>7} {'MiB':>8} {'ms':>8} {'GB/s':>8} {'of ceiling':>10}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['mib']:>8.0f} {r['ms']:>8.2f} {r['gbps']:>8.1f} {r['of_ceiling']:>10.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), ceiling_gbps=ceiling, rows=rows, ends=ends, date=time.strftime("%Y-%m-%d")), f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
