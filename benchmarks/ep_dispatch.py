"""Expert-parallel dispatch and combine latency per backend, against raw NCCL all_to_all_single
of the same logical payload and the peer-copy ceiling measured in the same run.

One process per visible GPU (NCCL). Each rank routes T random tokens (hidden 7168, top-8 of 256
experts, bf16, linear placement) and times:
  nccl-a2a  all_to_all_single of the T * k (token, expert) rows, pre-sorted by destination, and
            back (the floor of a pair-wise exchange: no index work, exact splits)
  naive     all-gather / reduce-scatter (uniform_tokens: every rank passes the same T)
  a2a       the a2a backend, bf16 and fp8 (per-token scales)
  ipc       the ipc backend (Triton, GPU peer memory), built for max_tokens_per_rank = max T
Each is timed eagerly and, where it can be captured, as CUDA-graph replays. Latency is the
median over iterations (CUDA events around each call, after warm-up), the slowest rank's
median. combine = median(dispatch + combine) - median(dispatch), since ipc's combine consumes
what its dispatch wrote. GB/s = logical bytes / time, logical bytes = T * k * H * 2 (the bf16
rows of every (token, expert) pair, for every backend, fp8 included); "x nccl" = the NCCL row's
time / this row's time in the same mode (> 1: faster).

  python -m benchmarks.ep_dispatch --out results.json
"""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, TOP_K, EXPERTS = 7168, 8, 256


def _median_ms(fn, iters: int, graph: bool) -> float:
    """Median of per-call CUDA-event times; fn captured in a CUDA graph first when graph."""
    run = fn
    if graph:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    t = torch.tensor([times[len(times) // 2]], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _routing(num_tokens: int, rank: int):
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.rand(num_tokens, EXPERTS, device="cuda", generator=g)
    w, ids = scores.topk(TOP_K, dim=1)
    return x, (w / w.sum(1, keepdim=True)).float(), ids.int()


def _nccl_pairs(x, ids, world: int):
    """The pair-wise payload and its splits, as an ideal a2a would send it."""
    dest = (ids.long() // (EXPERTS // world)).flatten()
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    rows = x[order // TOP_K].contiguous()
    return rows, send.tolist(), recv.tolist()


def _cases(T: int, rank: int, world: int, dispatchers: dict) -> list:
    """(name, dispatch fn, dispatch + combine fn, capturable) for every backend at T tokens."""
    x, w, ids = _routing(T, rank)
    pairs, send, recv = _nccl_pairs(x, ids, world)
    back = pairs.new_empty((sum(recv), HIDDEN))

    def nccl_dispatch():
        dist.all_to_all_single(back, pairs, recv, send)

    def nccl_roundtrip():
        dist.all_to_all_single(back, pairs, recv, send)
        dist.all_to_all_single(pairs, back, send, recv)

    cases = [("nccl-a2a", nccl_dispatch, nccl_roundtrip, True)]
    for name, d in dispatchers.items():
        y = d.dispatch(x, w, ids)[0].clone()  # a stand-in for the experts' output, same rows

        def dispatch(d=d):
            d.dispatch(x, w, ids)

        def roundtrip(d=d, y=y):
            d.combine(y, d.dispatch(x, w, ids)[3])

        cases.append((name, dispatch, roundtrip, name in ("naive", "ipc")))
    return cases


def _worker(rank: int, world: int, port: int, tokens: list[int], iters: dict, out_path: str) -> None:
    """All eager rows first, then the CUDA-graph ones; rank 0 rewrites out_path after every row,
    so a failure leaves the rows measured before it."""
    from tandem.kernels.ep import make_dispatcher

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    try:
        group = dist.group.WORLD
        dispatchers = {
            "naive": make_dispatcher("naive", group, EXPERTS, uniform_tokens=True),
            "a2a": make_dispatcher("a2a", group, EXPERTS),
            "a2a-fp8": make_dispatcher("a2a", group, EXPERTS, fp8=True),
            "ipc": make_dispatcher("ipc", group, EXPERTS, max_tokens_per_rank=max(tokens), hidden_size=HIDDEN,
                                   dtype=torch.bfloat16)}
        cases = {T: _cases(T, rank, world, dispatchers) for T in tokens}
        for graph in (False, True):
            for T in tokens:
                n = iters["small"] if T <= 128 else iters["large"]
                for name, dispatch, roundtrip, capturable in cases[T]:
                    if graph and not capturable:
                        continue
                    try:
                        t_d = _median_ms(dispatch, n, graph)
                        t_rt = _median_ms(roundtrip, n, graph)
                    except RuntimeError as e:  # a capture every rank fails alike: report it, go on
                        print(f"rank {rank}: {name} T={T} {'graph' if graph else 'eager'} failed: {e}", flush=True)
                        t_d = t_rt = float("nan")
                    rows.append(dict(backend=name, mode="graph" if graph else "eager", tokens=T,
                                     dispatch_us=t_d * 1e3, combine_us=(t_rt - t_d) * 1e3, roundtrip_us=t_rt * 1e3))
                    if rank == 0:
                        print(f"{name:9s} {rows[-1]['mode']:5s} T={T:5d} dispatch {t_d * 1e3:9.1f} us  "
                              f"round trip {t_rt * 1e3:9.1f} us", flush=True)
                        with open(out_path, "w") as f:
                            json.dump(rows, f)
        dispatchers["ipc"].close()
    finally:
        dist.destroy_process_group()


def _with_ratios(rows: list[dict]) -> list[dict]:
    nccl = {(r["mode"], r["tokens"]): r for r in rows if r["backend"] == "nccl-a2a"}
    for r in rows:
        nbytes = r["tokens"] * TOP_K * HIDDEN * 2
        ref = nccl.get((r["mode"], r["tokens"]))
        for phase in ("dispatch", "combine"):
            t = r[f"{phase}_us"]
            r[f"{phase}_gbps"] = nbytes / (t * 1e3) if t > 0 else float("nan")
            r[f"{phase}_x_nccl"] = ref[f"{phase}_us"] / t if ref and t > 0 else float("nan")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ep_dispatch.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 4096], help="tokens per rank")
    ap.add_argument("--iters", type=int, default=200, help="timed calls per row (T <= 128; a quarter above)")
    args = ap.parse_args()
    world = torch.cuda.device_count()
    ceiling = None
    if world >= 2:
        from benchmarks.kv_transfer import peer_copy_gbps
        ceiling = peer_copy_gbps("cuda:0", "cuda:1")
        print(f"peer copy cuda:0 -> cuda:1 (1 GiB): {ceiling:.1f} GB/s", flush=True)
        torch.cuda.empty_cache()
    from tests.ports import free_port
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        iters = {"small": args.iters, "large": max(10, args.iters // 4)}
        try:
            mp.spawn(_worker, args=(world, free_port(), args.tokens, iters, out_path), nprocs=world)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"a rank failed; reporting the rows measured before it:\n{e}", flush=True)
        rows = []
        if os.path.exists(out_path):
            with open(out_path) as f:
                rows = _with_ratios(json.load(f))
    device = f"{world}x {torch.cuda.get_device_name(0)}"
    print(f"\n{device}; hidden {HIDDEN}, top-{TOP_K} of {EXPERTS} experts, bf16 tokens; "
          f"GB/s = T * {TOP_K} * {HIDDEN} * 2 bytes / time; x nccl = nccl-a2a time / time (same mode)")
    print("| backend | mode | tokens/rank | dispatch us | GB/s | x nccl | combine us | GB/s | x nccl |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['mode']} | {r['tokens']} | {r['dispatch_us']:.1f} | {r['dispatch_gbps']:.1f} | "
              f"{r['dispatch_x_nccl']:.2f} | {r['combine_us']:.1f} | {r['combine_gbps']:.1f} | {r['combine_x_nccl']:.2f} |")
    if ceiling is not None:
        print(f"peer copy ceiling (cuda:0 -> cuda:1, same run): {ceiling:.1f} GB/s")
    with open(args.out, "w") as f:
        json.dump(dict(device=device, hidden=HIDDEN, top_k=TOP_K, experts=EXPERTS, peer_copy_gbps=ceiling,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
