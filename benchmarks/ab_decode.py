"""A/B of decode-path variants in one engine: per variant, switch module constants, recapture the
decode graphs, decode `--batch` sequences of `--context` tokens and time the steps.

One engine per model (dummy weights, --async-scheduling as roofline's headline figures), rounds
alternate the variants so that clock drift falls on all of them alike. Each step's time is set
against the HBM floor (weights + KV bytes / copy bandwidth measured in the same run), as in
benchmarks/roofline.py. The greedy tokens of each variant are compared with the first variant's
(same prompts): a variant that changes results shows up as a mismatch, not as a speed-up.

Variants are switch names joined by "+", "base" (every switch off) or "all" (every switch on,
what the engine runs by default). Switches (module constants of kernels/):
  argmax   kernels.sampling.TRITON_ARGMAX       one-launch Triton argmax for greedy sampling
  moesum   kernels.triton.moe.FUSED_SUM         top-k sum in the second expert GEMM (MoE only)
  lmhead   engine.layers.embedding.TRITON_LM_HEAD   LM head on the Triton GEMM at <= 16 rows
  route    kernels.triton.moe.FUSED_ROUTING     router top-k inside the first expert GEMM (MoE only)
  partial  kernels.triton.moe.PARTIAL_TOPK      that top-k only as far as each program's slot (MoE only)
  eexpert  kernels.triton.moe.EARLY_EXPERT      the second expert GEMM ranks its expert before the wait (MoE only)
  norm     kernels.linear.FOLD_NORM             the RMSNorm after o_proj carried by o_proj and the MLP's first GEMM
  inorm    kernels.linear.FOLD_INPUT_NORM       with norm: the input norm carried by the MLP ahead and qkv
  rope     kernels.attention.FUSED_ROPE         q/k norm, rotary and KV store done by the attention launch

  python -m benchmarks.ab_decode --models llama3-8b --variants base argmax moesum all
"""
import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.roofline import MODELS, build, copy_bandwidth, kv_bytes, param_bytes, step_times

SWITCHES = {
    "argmax": ("tandem.kernels.sampling", "TRITON_ARGMAX"),
    "moesum": ("tandem.kernels.triton.moe", "FUSED_SUM"),
    "lmhead": ("tandem.engine.layers.embedding", "TRITON_LM_HEAD"),
    "route": ("tandem.kernels.triton.moe", "FUSED_ROUTING"),
    "partial": ("tandem.kernels.triton.moe", "PARTIAL_TOPK"),
    "eexpert": ("tandem.kernels.triton.moe", "EARLY_EXPERT"),
    "norm": ("tandem.kernels.linear", "FOLD_NORM"),
    "inorm": ("tandem.kernels.linear", "FOLD_INPUT_NORM"),
    "rope": ("tandem.kernels.attention", "FUSED_ROPE"),
}
MOE_SWITCHES = {"moesum", "route", "partial", "eexpert"}


def apply(variant: str) -> None:
    """Variant names: "base" (all off), "all", or switch names joined by "+"."""
    import importlib
    on = set(SWITCHES) if variant == "all" else set() if variant == "base" else set(variant.split("+"))
    unknown = on - set(SWITCHES)
    if unknown:
        raise SystemExit(f"unknown switch(es) {sorted(unknown)}; known: {sorted(SWITCHES)}")
    for name, (module, attr) in SWITCHES.items():
        setattr(importlib.import_module(module), attr, name in on)


def recapture(runner, batch: int) -> None:
    from tandem.engine.cuda_graphs import DecodeGraphs

    torch.cuda.synchronize()
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner.model, [batch], -(-runner.max_model_len // runner.block_size),
                                 runner.max_model_len, runner.device, with_logits=True)


def decode(core, batch: int, context: int, steps: int, tag: str) -> tuple[list[float], list[list[int]]]:
    """Step times of `steps` decode steps and each sequence's greedy tokens."""
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest

    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        core.add_request(EngineRequest(rid, [(i * 7 + j) % 1000 + 1 for j in range(context)],
                                       SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0)))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    times = step_times(core, steps)
    tokens = [list(core.scheduler.requests[rid].output_token_ids) for rid in ids]
    core.abort_requests(list(core.scheduler.requests))
    while core.has_unfinished_requests():
        core.step()
    return times, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of greedy tokens equal up to each sequence's first difference (later ones follow it)."""
    same = total = 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        same, total = same + k, total + n
    return same / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=["base", "argmax", "moesum", "lmhead", "all"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for v in args.variants:
        apply(v)  # unknown names fail before any model is built
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"{dev}: copy bandwidth {bw / 1e9:.0f} GB/s (measured now)", flush=True)
    rows = []
    for name in args.models:
        moe = "moe" in MODELS[name]["model_type"]
        # the MoE switches change nothing in a dense model: variants of only those are left out
        variants = [v for v in args.variants if moe or not set(v.split("+")) <= MOE_SWITCHES]
        llm = build(name, max_num_batched_tokens=4096, max_num_seqs=max(8, args.batch), max_model_len=8192,
                    gpu_memory_utilization=0.9, cuda_graph_sizes=(args.batch,), async_scheduling=True,
                    enable_prefix_caching=False)  # every run prefills alike, so greedy tokens compare
        core, runner = llm.engine, llm.engine.runner
        wbytes = param_bytes(runner, MODELS[name]["num_experts_per_tok"] if moe else None)
        floor = (wbytes + kv_bytes(runner, args.batch, args.context)) / bw
        times = {v: [] for v in variants}
        tokens = {}
        for r in range(args.rounds):
            for v in variants:
                apply(v)
                recapture(runner, args.batch)
                t, toks = decode(core, args.batch, args.context, args.steps, f"{v}-{r}")
                times[v] += t
                tokens.setdefault(v, toks)
                print(f"{name} round {r} {v:<22} median {statistics.median(t) * 1e3:.3f} ms", flush=True)
        apply("all")
        for v in variants:
            ms = statistics.median(times[v]) * 1e3
            rows.append(dict(model=name, variant=v, batch=args.batch, context=args.context, ms=ms,
                             floor_ms=floor * 1e3, of_floor=floor * 1e3 / ms,
                             greedy_agreement=agreement(tokens[variants[0]], tokens[v])))
        del llm, core, runner
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'model':<15}{'variant':<24}{'ms':>8}{'floor ms':>10}{'of floor':>10}{'same tokens':>13}")
    for r in rows:
        print(f"{r['model']:<15}{r['variant']:<24}{r['ms']:>8.3f}{r['floor_ms']:>10.3f}{r['of_floor']:>10.1%}"
              f"{r['greedy_agreement']:>13.0%}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, date=time.strftime("%Y-%m-%d"), copy_GBps=bw / 1e9,
                                                  steps=args.steps, rounds=args.rounds, rows=rows), indent=1))


if __name__ == "__main__":
    main()
