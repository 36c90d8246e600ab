"""Where a decode step's time goes: engine step, graph replay, LM head + sampling, host
preparation, and a per-kernel table of the replayed graph.

Builds one model of `benchmarks.roofline.MODELS` with dummy weights, runs `--batch` sequences
to `--context` tokens, then per decode step reports
  (a) the full engine step (`EngineCore.step()`, what roofline times),
  (b) the CUDA graph replay alone (GPU time, events),
  (c) the LM head + sampling run eagerly on the replay's hidden states (GPU time),
  (d) the host phases of a step (schedule, prepare, forward launch, SamplingBatch.build, sample
      + token readback, update; wall time),
  (e) the kernels of one replay (torch.profiler; name, count, us, share),
  (f) the replay as a chain: what each kernel adds to its span (with PDL a kernel starts while the
      one ahead drains, so (e)'s durations overlap and include waits; here each kernel is charged
      from the later of its start and the previous kernels' end to its own end, and the GPU's idle
      gaps between kernels are counted apart: exposed + idle = the replay's span),
  (g) one decoder layer of the replay kernel by kernel, in launch order (the repeating run of kernel
      names), each position's exposed time and duration averaged over the layers: which GEMM or
      attention launch of a layer loses the time, where (e) and (f) sum each kernel name,
and, per linear layer of layer 0, the GEMM at this batch (achieved GB/s). To profile another
kernel configuration, pass its flags (--no-pdl, --no-fuse-norms, ...: engine/config.py, KernelConfig); other
tile plans, `--plans F` (a plan_tune JSON file, installed while the engine is built and profiled, as
benchmarks.ab_decode's `plans=F` variants).

  python -m benchmarks.profile_decode --model llama3-8b --batch 1 --context 1024 --out p.json
  python -m benchmarks.profile_decode --fp8 block --kv-cache-dtype fp8 --batch 1   # an FP8 step
"""
import argparse
import contextlib
import gc
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.roofline import (MODELS, RoutedExperts, build, copy_bandwidth, decode_step_args, kernel_flags,
                                 kernel_kwargs, kv_bytes, param_bytes, step_times)


def recapture(runner, batch: int, with_logits: bool) -> None:
    from tandem.engine.cuda_graphs import DecodeGraphs

    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner.model, [batch], -(-runner.max_model_len // runner.block_size),
                                 runner.max_model_len, runner.device, with_logits=with_logits)


class PhaseTimer:
    """Wraps host functions of one step and records their wall time per call."""

    def __init__(self):
        self.times = defaultdict(list)
        self._undo = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        self._undo.append((owner, name, vars(owner).get(name)))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[label].append(time.perf_counter() - t)

        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, raw in reversed(self._undo):
            if raw is None:
                delattr(owner, name)  # was the class's method, not the instance's own
            else:
                setattr(owner, name, raw)
        self._undo.clear()


def median_us(xs) -> float:
    return statistics.median(xs) * 1e6 if xs else float("nan")


def gpu_time_us(fn, reps: int = 50) -> float:
    """Median GPU time of fn from CUDA events, one pair per call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _kernel_events(fn, reps: int, sync_each: bool = False) -> list[tuple[str, float, float]]:
    """The GPU kernels (no copies or memsets) of `reps` calls of fn (graph replays show their
    kernels) as (name, start us, end us) in start order; sync_each: each call run alone."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    return sorted(((ev.name, ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in ev.name
                   and "Memset" not in ev.name), key=lambda e: e[1])


def kernel_table(events: list[tuple[str, float, float]], reps: int) -> list[dict]:
    """The kernels of `reps` calls (_kernel_events): per call, with their share of the kernels' time."""
    rows = defaultdict(lambda: [0, 0.0])
    for name, start, end in events:
        rows[name][0] += 1
        rows[name][1] += end - start
    total = sum(t for _, t in rows.values()) or 1.0
    out = [dict(kernel=name, count=c / reps, us=t / reps, share=t / total) for name, (c, t) in rows.items()]
    return sorted(out, key=lambda r: -r["us"])


def chain_attribution(replays: list[list[tuple[str, float, float]]]) -> dict:
    """replays: the kernels of each replay as (name, start, end) in us, any order -> per kernel name
    the count, exposed us (end minus the later of its start and every earlier kernel's end: what it
    adds to the replay's span) and idle us before it (the GPU running none of the replay's kernels),
    per replay; and the mean span. Exposed plus idle over all names is the span."""
    rows = defaultdict(lambda: [0, 0.0, 0.0])
    spans = []
    for events in replays:
        events = sorted(events, key=lambda e: (e[1], e[2]))
        done = events[0][1] if events else 0.0
        for name, start, end in events:
            r = rows[name]
            r[0] += 1
            r[1] += max(0.0, end - max(done, start))
            r[2] += max(0.0, start - done)
            done = max(done, end)
        spans.append(done - events[0][1] if events else 0.0)
    n = max(1, len(replays))
    out = [dict(kernel=name, count=c / n, exposed_us=e / n, idle_before_us=i / n) for name, (c, e, i) in rows.items()]
    return dict(span_us=sum(spans) / n, kernels=sorted(out, key=lambda r: -(r["exposed_us"] + r["idle_before_us"])))


def _exposed(events: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """(name, exposed us, duration us) of each kernel of one replay in start order (chain_attribution's
    charge: end minus the later of its start and every earlier kernel's end)."""
    events = sorted(events, key=lambda e: (e[1], e[2]))
    done = events[0][1] if events else 0.0
    out = []
    for name, start, end in events:
        out.append((name, max(0.0, end - max(done, start)), end - start))
        done = max(done, end)
    return out


def layer_chain(replays: list[list[tuple[str, float, float]]], max_period: int = 64) -> dict:
    """One decoder layer of a replay, kernel by kernel in launch order: the layers' repeating run of
    kernel names (the period p that repeats over the most kernels; the shortest on a tie) and, per
    position in it, the exposed and plain duration averaged over the layers and replays.
    -> dict(period, layers, kernels=[dict(position, kernel, exposed_us, duration_us)])."""
    if not replays or not replays[0]:
        return dict(period=0, layers=0, kernels=[])
    names = [n for n, _, _ in sorted(replays[0], key=lambda e: (e[1], e[2]))]
    best = (0, 0, 0)  # (kernels covered, -period, run start)
    for p in range(1, min(max_period, len(names) // 2) + 1):
        i = 0
        while i + p < len(names):
            j = i
            while j + p < len(names) and names[j] == names[j + p]:
                j += 1
            if j > i:
                best = max(best, (j - i + p, -p, i), key=lambda b: (b[0], b[1]))
            i = j + 1
    covered, p, start = best[0], -best[1], best[2]
    if not p:
        return dict(period=0, layers=0, kernels=[])
    layers = covered // p
    rows = [[names[start + j], 0.0, 0.0] for j in range(p)]
    for events in replays:
        timed = _exposed(events)
        for layer in range(layers):
            for j in range(p):
                _, exposed, duration = timed[start + layer * p + j]
                rows[j][1] += exposed
                rows[j][2] += duration
    n = layers * len(replays)
    return dict(period=p, layers=layers, kernels=[dict(position=j, kernel=k, exposed_us=e / n, duration_us=d / n)
                                                  for j, (k, e, d) in enumerate(rows)])


def chain_table(events: list[tuple[str, float, float]], reps: int) -> dict:
    """chain_attribution of the kernels of `reps` calls, each run alone (_kernel_events, sync_each)."""
    per = len(events) // reps if reps and len(events) % reps == 0 else 0
    if not per:  # (kernels not seen inside the replays, or a count that does not split evenly)
        return dict(span_us=0.0, kernels=[], layer=layer_chain([]))
    replays = [events[i * per:(i + 1) * per] for i in range(reps)]
    return dict(chain_attribution(replays), layer=layer_chain(replays))


def _in_graph_us(fn, copies: int, calls: int = 8) -> float:
    """Microseconds per call of fn(i) replayed `calls` times back to back in one graph, cycling
    over `copies` weight copies so that none is read from L2 (as in a decode step)."""
    from triton.testing import do_bench

    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % copies)
    return do_bench(g.replay, warmup=10, rep=50, return_mode="median") * 1e3 / calls


def linear_table(model, batch: int, bw: float) -> list[dict]:
    """Each linear weight of layer 0 (and the LM head) as a GEMM at this batch, timed inside a graph
    of back-to-back calls: cuBLAS, and what the engine runs (kernels.linear: the Triton GEMM at
    <= 16 rows, the LM head included)."""
    from tandem.kernels.linear import linear
    layer = model.model.layers[0]
    weights = {n: m.weight for n, m in layer.named_modules() if hasattr(m, "weight") and m.weight is not None
               and m.weight.dim() == 2}
    weights["lm_head"] = model.lm_head.weight
    rows = []
    for name, w in weights.items():
        copies = 1 if name == "lm_head" else max(1, min(4, -(-200 * 2**20 // (w.numel() * w.element_size()))))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        x = torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype)
        calls = 1 if name == "lm_head" else 8
        t = _in_graph_us(lambda i: F.linear(x, ws[i]), copies, calls)
        t_engine = _in_graph_us(lambda i: linear(x, ws[i], config=model.kernels), copies, calls)
        nbytes = w.numel() * w.element_size()
        rows.append(dict(linear=name, shape=list(w.shape), us=t, of_copy_bw=nbytes / (t * 1e-6) / bw,
                         engine_us=t_engine, engine_of_copy_bw=nbytes / (t_engine * 1e-6) / bw))
    return rows


def replay_launch_us(graph, reps: int = 20) -> float:
    """Median host time of graph.replay() itself (the call returns before the GPU is done)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return median_us(times)


def profile_variant(llm, batch: int, label: str, with_logits: bool, steps: int) -> dict:
    from tandem.engine import model_runner
    from tandem.engine.sampler import SamplingBatch, sample

    core, runner = llm.engine, llm.engine.runner
    recapture(runner, batch, with_logits)
    for _ in range(5):
        core.step()
    timer = PhaseTimer()
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(runner, "prepare", "prepare")
    timer.wrap(runner, "forward_logits", "forward_logits (launch)")
    timer.wrap(model_runner.SamplingBatch, "build", "SamplingBatch.build")
    timer.wrap(model_runner, "sample", "sample (launch)")
    timer.wrap(core.scheduler, "update", "update")
    try:
        times = step_times(core, steps)
    finally:
        timer.restore()
    host = {k: median_us(v) for k, v in timer.times.items()}
    step_us = median_us(times)
    host["tokens readback + other (rest of the step)"] = step_us - sum(host.values())

    graph, hidden, _ = runner.graphs.graphs[batch]
    replay_us = gpu_time_us(graph.replay)
    launch_us = replay_launch_us(graph)
    reqs = list(core.scheduler.running)[:batch]
    sbatch = SamplingBatch.build(reqs, runner.vocab_size, runner.device)

    def head_and_sample():
        logits = runner.model.compute_logits(hidden).float()
        sample(logits[:len(reqs)], sbatch, core.eos_token_ids, runner.config.kernel)

    head_us = gpu_time_us(head_and_sample)
    reps = 10
    replays = _kernel_events(graph.replay, reps, sync_each=True)  # (e) and (f) from the same replays
    kernels = kernel_table(replays, reps)
    if not kernels:  # this profiler does not see inside graphs: the same forward, eagerly
        g = runner.graphs
        print("no kernels reported inside the graph replay; profiling the eager forward instead")
        kernels = kernel_table(_kernel_events(torch.inference_mode()(lambda: g._forward(batch)), reps), reps)
    return dict(variant=label, lm_head_in_graph=with_logits, step_us=step_us, graph_replay_us=replay_us,
                graph_launch_host_us=launch_us, lm_head_and_sampling_eager_us=head_us, host_us=host,
                kernels=kernels, chain=chain_table(replays, reps))


def print_variant(r: dict, floor_us: float) -> None:
    print(f"\n=== {r['variant']}: step {r['step_us']:.0f} us ({floor_us / r['step_us']:.0%} of the HBM floor "
          f"{floor_us:.0f} us) ===")
    inside = "decoder + LM head" if r["lm_head_in_graph"] else "decoder only"
    print(f"(b) graph replay ({inside}): {r['graph_replay_us']:.0f} us GPU; "
          f"graph.replay() host call {r['graph_launch_host_us']:.0f} us")
    print(f"(c) LM head + sampling, eager: {r['lm_head_and_sampling_eager_us']:.0f} us GPU")
    print("(d) host phases (median wall us per step):")
    for k, v in r["host_us"].items():
        print(f"    {k:<45}{v:>9.1f}")
    print("(e) kernels of one replay:")
    print(f"    {'kernel':<72}{'count':>7}{'us':>9}{'share':>7}")
    for k in r["kernels"][:40]:
        print(f"    {k['kernel'][:72]:<72}{k['count']:>7.1f}{k['us']:>9.1f}{k['share']:>7.1%}")
    total = sum(k["us"] for k in r["kernels"])
    count = sum(k["count"] for k in r["kernels"])
    print(f"    {'all kernels':<72}{count:>7.0f}{total:>9.1f}")
    chain = r["chain"]
    if chain["kernels"]:
        print(f"(f) one replay as a chain: span {chain['span_us']:.0f} us = exposed + idle, per kernel:")
        print(f"    {'kernel':<72}{'count':>7}{'exposed':>9}{'idle':>7}")
        for k in chain["kernels"][:40]:
            print(f"    {k['kernel'][:72]:<72}{k['count']:>7.1f}{k['exposed_us']:>9.1f}{k['idle_before_us']:>7.1f}")
        print(f"    {'all kernels':<72}{sum(k['count'] for k in chain['kernels']):>7.0f}"
              f"{sum(k['exposed_us'] for k in chain['kernels']):>9.1f}"
              f"{sum(k['idle_before_us'] for k in chain['kernels']):>7.1f}")
    layer = chain.get("layer", {})
    if layer.get("kernels"):
        print(f"(g) one decoder layer in launch order (mean of {layer['layers']} layers; exposed as in (f), "
              f"duration = end - start):")
        print(f"    {'#':>3} {'kernel':<68}{'exposed':>9}{'duration':>10}")
        for k in layer["kernels"]:
            print(f"    {k['position']:>3} {k['kernel'][:68]:<68}{k['exposed_us']:>9.1f}{k['duration_us']:>10.1f}")
        print(f"    {'':>3} {'the layer':<68}{sum(k['exposed_us'] for k in layer['kernels']):>9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decode_step_args(ap)
    ap.add_argument("--steps", type=int, default=40)
    kernel_flags(ap)
    from benchmarks.ab_decode import plans_flag, plans_from_flag
    plans_flag(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with plans_from_flag(args):
        profile(args)


def decoding_engine(args: argparse.Namespace, steps: int):
    """The synchronous engine (its host phases are what profile() times) of args' model and kernel flags, with
    args.batch requests of args.context prompt tokens each past its first token and `steps` more to go."""
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest

    llm = build(args.model, args.fp8, kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=4096,
                max_num_seqs=max(args.batch, 8), max_model_len=8192, gpu_memory_utilization=0.9,
                cuda_graph_sizes=(args.batch,), async_scheduling=False, **kernel_kwargs(args))
    core = llm.engine
    for i in range(args.batch):
        core.add_request(EngineRequest(f"r{i}", [(i * 7 + j) % 1000 + 1 for j in range(args.context)],
                                       SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0)))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    return llm


def profile(args: argparse.Namespace) -> None:
    """The profile main() prints, of the configuration args name."""
    bw = copy_bandwidth()
    llm = decoding_engine(args, 4 * (args.steps + 10))  # enough for every variant's steps
    cfg = MODELS[args.model]
    moe = "moe" in cfg["model_type"]
    routed = RoutedExperts(cfg.get("num_experts", 0), cfg.get("num_experts_per_tok", 0))
    results = []
    with routed if moe else contextlib.nullcontext():  # (around the graphs' capture)
        results.append(profile_variant(llm, args.batch, "current", True, args.steps))
    # an MoE step reads the experts its routers picked (the last timed step's), not one token's top-k
    experts = routed.counts(args.batch, cfg["num_hidden_layers"]) if moe else []
    active = sum(experts) / len(experts) if moe else None
    wbytes = param_bytes(llm.engine.runner, active)
    floor_us = (wbytes + kv_bytes(llm.engine.runner, args.batch, args.context)) / bw * 1e6
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; {args.model} b={args.batch} "
          f"ctx={args.context}: {wbytes / 1e9:.2f} GB of weights per step"
          + (f" ({active:.1f} distinct experts a layer, {min(experts)}-{max(experts)})" if moe else "")
          + f", floor {floor_us:.0f} us")
    print_variant(results[-1], floor_us)
    # FP8 GEMMs against torch._scaled_mm per shape: benchmarks.roofline --fp8-kernels
    linears = linear_table(llm.engine.runner.model, args.batch, bw) if args.fp8 == "none" else []
    if linears:
        print("\nlinear layers of layer 0, us per call inside a graph of back-to-back calls (of copy bandwidth):")
    for r in linears:
        print(f"    {r['linear']:<24}{str(r['shape']):<16} cuBLAS {r['us']:>7.1f} ({r['of_copy_bw']:.0%})"
              f"   engine {r['engine_us']:>7.1f} ({r['engine_of_copy_bw']:.0%})")
    print(f"\n{'variant':<28}{'step us':>9}{'of floor':>9}{'replay us':>10}{'launch us':>10}{'kernels':>8}")
    for r in results:
        print(f"{r['variant']:<28}{r['step_us']:>9.0f}{floor_us / r['step_us']:>9.0%}{r['graph_replay_us']:>10.0f}"
              f"{r['graph_launch_host_us']:>10.0f}{sum(k['count'] for k in r['kernels']):>8.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), model=args.model,
            batch=args.batch, context=args.context, copy_GBps=bw / 1e9, floor_us=floor_us, experts_a_layer=active,
            variants=results, linears=linears), indent=1))


if __name__ == "__main__":
    main()
