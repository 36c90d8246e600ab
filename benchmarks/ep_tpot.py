"""Decode TPOT of an expert-parallel MoE model per dispatch/combine backend.

Each of the N GPUs runs one data-parallel engine (--data-parallel-size N
--enable-expert-parallel): attention local, experts sharded, tokens moved by the backend.
Every rank decodes `batch` sequences of ~`context` tokens; TPOT is the median wall time of a
lockstep decode step (all ranks), with dummy weights of a Hugging Face-shaped config.

Floor: the bytes one rank reads per step (its non-expert weights, its KV, and its share of the
distinct experts the step's N * batch tokens pick, expected under uniform top-k routing) over
the device-to-device copy bandwidth measured by that rank in the same run.

  python -m benchmarks.ep_tpot --backends ipc a2a naive --batch 1 32 --out tpot.json
"""
import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.roofline import MODELS, copy_bandwidth, kv_bytes, param_bytes, time_decode


def _rank(rank: int, world: int, model_dir: str, backend: str, batches: list[int], context: int, steps: int,
          port: int, results, async_scheduling: bool = False) -> None:
    from tandem.engine.config import EngineConfig
    from tandem.engine.core import EngineCore

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(name)s: %(message)s")
    config = EngineConfig.create(
        model=model_dir, load_format="dummy", dtype="bfloat16", data_parallel_size=world,
        enable_expert_parallel=True, all2all_backend=backend, master_port=port, max_model_len=4096,
        max_num_seqs=max(batches), max_num_batched_tokens=2048, cuda_graph_sizes=tuple(sorted(set(batches))),
        gpu_memory_utilization=0.85, async_scheduling=async_scheduling)
    torch.cuda.set_device(rank)
    bw = copy_bandwidth()
    core = EngineCore(config, dp_rank=rank)
    hf = MODELS[Path(model_dir).name]
    out = {}
    for batch in batches:
        experts = expected_distinct_experts(hf["num_experts"], hf["num_experts_per_tok"], world * batch) / world
        floor = (param_bytes(core.runner, experts) + kv_bytes(core.runner, batch, context)) / bw
        out[batch] = (time_decode(core, batch, context, steps), floor, bw)
    results[(backend, rank)] = out
    core.shutdown()


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts that `tokens` tokens pick when each picks top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def _run_backend(backend: str, args, model_dir: str, port: int, results) -> bool:
    """Run one backend's ranks; True when every rank reported. Ranks that reported but do not
    exit within 30 s (a stalled teardown) are killed, so one backend cannot keep the others
    from running."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, args.gpus, model_dir, backend, args.batch, args.context,
                                             args.steps, port, results, args.async_scheduling))
             for r in range(args.gpus)]
    for p in procs:
        p.start()
    deadline = time.time() + args.timeout

    def reported() -> bool:
        return all((backend, r) in results for r in range(args.gpus))

    while time.time() < deadline and not reported() and all(p.exitcode in (None, 0) for p in procs):
        time.sleep(1)
    for p in procs:
        p.join(30 if reported() else 0)
        if p.is_alive():
            p.kill()
            p.join()
            print(f"{backend}: rank process {p.pid} killed ({'teardown stalled' if reported() else 'no result'})",
                  flush=True)
    if not reported():
        print(f"{backend}: failed (exit codes {[p.exitcode for p in procs]})", flush=True)
    return reported()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=[m for m in MODELS if "moe" in MODELS[m]["model_type"]])
    ap.add_argument("--backends", nargs="+", default=["ipc", "a2a", "naive"])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="sequences per rank")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600, help="seconds a backend may take, start-up included")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                    help="the engines' --async-scheduling (off here unless asked, so runs compare like for like)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from tests.ports import free_port

    d = Path(tempfile.mkdtemp()) / args.model
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MODELS[args.model]))
    results = mp.Manager().dict()
    rows = []
    for backend in args.backends:
        t0 = time.time()
        if not _run_backend(backend, args, str(d), free_port(), results):
            continue
        for batch in args.batch:
            tpot = max(results[(backend, r)][batch][0] for r in range(args.gpus))
            floor = max(results[(backend, r)][batch][1] for r in range(args.gpus))
            bw = min(results[(backend, r)][batch][2] for r in range(args.gpus))
            rows.append(dict(backend=backend, ep=args.gpus, batch_per_rank=batch, async_scheduling=args.async_scheduling,
                             tpot_ms=tpot * 1e3, floor_ms=floor * 1e3, of_floor=floor / tpot, copy_gbps=bw / 1e9))
            print("measured:", rows[-1], f"({time.time() - t0:.0f} s with start-up)", flush=True)
    base = {r["batch_per_rank"]: r["tpot_ms"] for r in rows if r["backend"] == "naive"}
    print(f"{'backend':<8} {'EP':>3} {'batch/rank':>10} {'TPOT ms':>8} {'floor ms':>9} {'of floor':>9} {'vs naive':>9}")
    for r in rows:
        r["speedup_vs_naive"] = base.get(r["batch_per_rank"], float("nan")) / r["tpot_ms"]
        print(f"{r['backend']:<8} {r['ep']:>3} {r['batch_per_rank']:>10} {r['tpot_ms']:>8.2f} {r['floor_ms']:>9.2f} "
              f"{r['of_floor']:>9.0%} {r['speedup_vs_naive']:>8.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), gpus=args.gpus,
                                                  date=time.strftime("%Y-%m-%d"), model=args.model,
                                                  context=args.context, rows=rows), indent=1))


if __name__ == "__main__":
    main()
