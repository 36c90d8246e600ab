"""A/B of kernel configurations (engine/config.py KernelConfig): one engine per variant, decode
`--batch` sequences of `--context` tokens on each and time the steps.

Engines use dummy weights and --async-scheduling (as roofline's headline figures); they live side
by side and the rounds alternate between them, so that clock drift falls on every variant alike.
Each step's time is set against the HBM floor (weights + KV bytes / copy bandwidth measured in the
same run), as in benchmarks/roofline.py; for an MoE it counts the experts the routers picked
(roofline.RoutedExperts: the distinct experts a layer in the first variant's last step of each
round, averaged), not one token's top-k. The greedy tokens of each variant are compared with the
first variant's (same prompts): a variant that changes results shows up as a mismatch, not as a
speed-up.

A variant is "default" (the engine's KernelConfig), "none" (every field off), or fields to set as flag
names joined by "+": "no-x" turns field x off, "x" on, e.g. "no-pdl", "no-fuse-norms+no-fuse-rope" or
"fp8-tma-gemm+fp8-tma-early". Fields: those of
KernelConfig (python -m tandem.server --help says what each does). "plans=FILE" is the default
config with the plans that benchmarks.plan_tune wrote to FILE (--out) in place while that engine
captures its decode graphs (GEMM and expert plans in their tables, the decode attention's through
plan_tune's hook): the plans it found, timed as the engine runs them. A file may also be written by
hand, e.g. {"walks": [{"what": "tma (4096, 4096)", "best": {"SPLIT": 4}}]} for the TMA decode GEMM's
split (kernels/triton/fp8_tma.py PLANS), or "tma ring (N, K)" with {"SPLIT": s, "STAGES": t} for its ring
form (RING_PLANS). It joins fields like any other part: "plans=FILE+no-pdl", and
other plans files: "plans=A+plans=B" installs A's plans, then B's (B's win where both set one).

  python -m benchmarks.ab_decode --models llama3-8b --variants default no-fuse-norms no-pdl
  python -m benchmarks.ab_decode --models llama3-8b --fp8 block --kv-cache-dtype fp8 --batch 64 \
      --variants default no-fuse-fp8-quant
  python -m benchmarks.ab_decode --models llama3-8b --fp8 block --kv-cache-dtype fp8 --batch 64 \
      --variants default plans=tuned.json
"""
import argparse
import ast
import contextlib
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.roofline import MODELS, RoutedExperts, build, copy_bandwidth, kv_bytes, param_bytes, step_times
from tandem.kernels import KernelConfig

MAX_MODEL_LEN = 8192
FIELDS = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(KernelConfig)}


def kernel_fields(variant: str) -> dict:
    """Variant name -> KernelConfig keyword arguments (see the module docstring)."""
    if variant == "default":
        return {}
    if variant == "none":
        return {f: False for f in FIELDS.values()}
    fields = {}
    for part in variant.split("+"):
        if part.startswith("plans="):  # (tuned_plans)
            continue
        name = part.removeprefix("no-")
        if name not in FIELDS:
            raise SystemExit(f"unknown variant part {part!r}; expected <field> or no-<field>, fields: "
                             f"{', '.join(FIELDS)}")
        fields[FIELDS[name]] = not part.startswith("no-")
    return fields


def tuned_plans(variant: str) -> list[tuple[dict | None, object, dict]]:
    """(table, key, plan) for each walk's best plan in the plan_tune JSON files a variant's "plans="
    parts name, file by file in the variant's order (installed in that order, so a later file's
    plan wins); [] for other variants. The decode attention's launch plan has no table: its entry is
    (None, "attention", the override plan_tune's DecodeAttentionPlan hook puts on the rule's plan)."""
    files = [part.removeprefix("plans=") for part in variant.split("+") if part.startswith("plans=")]
    if not files:
        return []
    from tandem.kernels.triton import fp8_skinny, linear, moe
    out = []
    walks = [w for f in files for w in json.loads(Path(f).read_text())["walks"]]
    for w in walks:
        kind, _, key = w["what"].partition(" ")
        if kind == "fp8":
            out.append((fp8_skinny.PLANS, ast.literal_eval(key), w["best"]))
        elif kind == "bf16":
            out.append((linear.SKINNY_PLANS, ast.literal_eval(key), w["best"]))
        elif kind == "tma":
            from tandem.kernels.triton import fp8_tma
            ring = key.startswith("ring ")
            out.append((fp8_tma.RING_PLANS if ring else fp8_tma.PLANS, ast.literal_eval(key.removeprefix("ring ")),
                        w["best"]))
        elif kind == "fused":  # the fused experts' launch: "fused (H, I, top_k)" (kernels/triton/fp8_tma_moe.py)
            from tandem.kernels.triton import fp8_tma_moe
            out.append((fp8_tma_moe.FUSED_PLANS, ast.literal_eval(key), w["best"]))
        elif kind == "route":
            from tandem.kernels.triton import routing
            out.append((routing.ROUTE_PLANS, ast.literal_eval(key), w["best"]))
        elif kind == "experts":
            out += [(moe.W8A16_PAIRS, name, value) for name, value in w["best"].items()]
        elif w["what"] == "decode attention":
            out.append((None, "attention", w["best"]))
        else:
            raise SystemExit(f"{variant}: unknown walk {w['what']!r}")
    return out


def plans_flag(ap: argparse.ArgumentParser) -> None:
    """--plans F for the scripts that build one engine (profile_decode, program_trace); plans_from_flag installs."""
    ap.add_argument("--plans", default=None, help="a plan_tune JSON file: its plans in the tables (the decode "
                                                   "attention's through plan_tune's hook) while the engine is built "
                                                   "and measured, as benchmarks.ab_decode's plans= variants")


def plans_from_flag(args: argparse.Namespace):
    """plans_installed for --plans (plans_flag): nothing installed without it."""
    return plans_installed(tuned_plans(f"plans={args.plans}") if args.plans else [])


@contextlib.contextmanager
def plans_installed(plans: list[tuple[dict | None, object, dict]]):
    """The plans in their tables (and the attention's through plan_tune's hook) while the block
    runs, so that an engine built there captures its graphs with them; as they were after."""
    from benchmarks.plan_tune import DecodeAttentionPlan, _put_tables, _tables
    if not plans:
        yield
        return
    hook = DecodeAttentionPlan()
    before = _tables(hook)
    for table, key, plan in plans:
        if table is None:
            hook.override = plan
        else:
            table[key] = plan
    try:
        yield
    finally:
        _put_tables(hook, before)
        hook.restore()


def decode(core, batch: int, context: int, steps: int, tag: str) -> tuple[list[float], list[list[int]]]:
    """Step times of `steps` decode steps and each sequence's greedy tokens."""
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest

    ids = [f"{tag}-{i}" for i in range(batch)]
    # the first sequences decode while the last ones prefill, so no sequence may finish before the timed steps
    # end (a finished one leaves the scheduler): room up to the model length, and aborted after
    for i, rid in enumerate(ids):
        core.add_request(EngineRequest(rid, [(i * 7 + j) % 1000 + 1 for j in range(context)],
                                       SamplingParams(max_tokens=MAX_MODEL_LEN - context, ignore_eos=True,
                                                      temperature=0)))
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


def kv_cache_bytes(name: str, batch: int, context: int, steps: int, kv_cache_dtype: str = "auto") -> int:
    """A KV cache for this run only, so that one engine per variant fits beside the others: the
    batch's tokens, and never less than one sequence of MAX_MODEL_LEN (the engine's own check)."""
    cfg = MODELS[name]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim  # k and v, one byte each
    per_token *= 1 if kv_cache_dtype == "fp8" else 2  # (bf16 otherwise)
    return per_token * max(batch * (context + steps + 64), MAX_MODEL_LEN + 64) + (256 << 20)


def model_rows(name: str, args, configs: dict, plans: dict, bw: float) -> list[dict]:
    """One model's engines, a variant each, timed in alternating rounds -> a row a variant. The engines live only in
    this frame (a loop variable left holding one kept a model's weights and KV cache on the GPU while the next
    model's engines were built: two 8B and two 30B FP8 engines ran an H100 out of memory)."""
    rows = []
    moe = "moe" in MODELS[name]["model_type"]
    engines = {}
    routed = RoutedExperts(MODELS[name].get("num_experts", 0), MODELS[name].get("num_experts_per_tok", 0))
    for v, fields in configs.items():
        with plans_installed(plans[v]), (routed if moe and not engines else contextlib.nullcontext()):
            engines[v] = build(name, args.fp8, kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=4096,
                               max_num_seqs=max(8, args.batch), max_model_len=MAX_MODEL_LEN,
                               kv_cache_memory_bytes=kv_cache_bytes(name, args.batch, args.context, args.steps,
                                                                    args.kv_cache_dtype),
                               cuda_graph_sizes=(args.batch,), async_scheduling=True,
                               enable_prefix_caching=False,  # every run prefills alike, so tokens compare
                               **fields).engine
    runner = next(iter(engines.values())).runner
    first = args.variants[0]  # the reference for greedy agreement, and the variant whose routing is counted
    experts = []  # distinct experts a layer in each round's last step of the first variant
    times = {v: [] for v in engines}
    tokens = {}
    for r in range(args.rounds):
        for v, core in engines.items():
            t, toks = decode(core, args.batch, args.context, args.steps, f"{v}-{r}")
            times[v] += t
            tokens.setdefault(v, toks)
            if moe and v == first:
                experts += routed.counts(args.batch, MODELS[name]["num_hidden_layers"])
            print(f"{name} round {r} {v:<28} median {statistics.median(t) * 1e3:.3f} ms", flush=True)
    active = statistics.mean(experts) if moe else None
    if moe:
        print(f"{name}: {active:.1f} distinct experts a layer in a step (min {min(experts)}, max "
              f"{max(experts)}; one token's top-k {MODELS[name]['num_experts_per_tok']})", flush=True)
    wbytes = param_bytes(runner, active)
    floor = (wbytes + kv_bytes(runner, args.batch, args.context)) / bw
    for v in engines:
        ms = statistics.median(times[v]) * 1e3
        rows.append(dict(model=name, variant=v, batch=args.batch, context=args.context, ms=ms,
                         floor_ms=floor * 1e3, of_floor=floor * 1e3 / ms, experts_a_layer=active,
                         greedy_agreement=agreement(tokens[first], tokens[v])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=["default", "no-fuse-norms", "no-fuse-rope", "no-pdl"],
                    help="see the module docstring; the first is the reference for greedy agreement")
    ap.add_argument("--fp8", choices=["none", "block", "channel"], default="none", help="as benchmarks.roofline's")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the engine's --kv-cache-dtype")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = {v: kernel_fields(v) for v in args.variants}  # unknown names fail before any model is built
    plans = {v: tuned_plans(v) for v in args.variants}  # (as does a plans file that cannot be read)
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"{dev}: copy bandwidth {bw / 1e9:.0f} GB/s (measured now)", flush=True)
    rows = []
    for name in args.models:
        rows += model_rows(name, args, configs, plans, bw)
        gc.collect()  # the model's engines went with model_rows' frame: free them before the next model's
        torch.cuda.empty_cache()
    print(f"\n{'model':<15}{'variant':<30}{'ms':>8}{'floor ms':>10}{'of floor':>10}{'same tokens':>13}")
    for r in rows:
        print(f"{r['model']:<15}{r['variant']:<30}{r['ms']:>8.3f}{r['floor_ms']:>10.3f}{r['of_floor']:>10.1%}"
              f"{r['greedy_agreement']:>13.0%}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, date=time.strftime("%Y-%m-%d"), copy_GBps=bw / 1e9,
                                                  steps=args.steps, rounds=args.rounds, fp8=args.fp8,
                                                  kv_cache_dtype=args.kv_cache_dtype, rows=rows), indent=1))


if __name__ == "__main__":
    main()
