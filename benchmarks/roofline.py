"""Engine step times against the hardware floors measured in the same run.

Decode: time per step vs. the HBM floor = (weight bytes read + KV bytes read) / copy
bandwidth (a large device-to-device copy, counting bytes read + written). Prefill: time of
one 4k-token step vs. the matmul floor = 2 * params * tokens / bf16 matmul rate (8k^3 GEMM).
Models are built with --load-format dummy from Hugging Face-shaped configs (no downloads).

FP8 (--fp8 block|channel): the same models with FP8 weights (block: the Hugging Face [128, 128]
layout in config.json; channel: --quantization fp8), optionally --kv-cache-dtype fp8. The HBM
floor then counts the fp8 weight and scale bytes; the prefill floor uses the FP8 matmul rate
(torch._scaled_mm at 8192^3) for the GEMMs, and --fp8-kernels times each FP8 GEMM against
torch._scaled_mm (row-wise scales) on the same shapes; --fp8-sweep times every candidate tile plan
(benchmarks/fp8_gemm.py).

  python -m benchmarks.roofline --out results.json
  python -m benchmarks.roofline --fp8 block --kv-cache-dtype fp8 --fp8-kernels --out fp8.json
  python -m benchmarks.roofline --models --fp8-sweep --out sweep.json
"""
import argparse
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0, torch_dtype="bfloat16", tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, max_position_embeddings=8192, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, torch_dtype="bfloat16", tie_word_embeddings=False),
}


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + written counted): the best of 5 rounds of
    10 copies after ~0.3 s of warm-up (the clocks ramp up; a cold first round read up to 20% low)."""
    a = torch.empty(2**32, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = 0.0
    warm_until = time.perf_counter() + 0.3
    while time.perf_counter() < warm_until:
        b.copy_(a)
        torch.cuda.synchronize()
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
        best = max(best, 2 * 10 * 2**32 / (time.perf_counter() - t))
    del a, b
    torch.cuda.empty_cache()  # the 8 GiB must not count as used when the engine sizes its KV cache
    return best


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)


def fp8_matmul_rate() -> float:
    """FLOP/s of torch._scaled_mm (e4m3, per-tensor scales, bf16 out) at 8192^3: the FP8 ceiling."""
    from tandem.kernels.fp8 import fp8_dtype
    a = torch.randn(8192, 8192, device="cuda").to(fp8_dtype("cuda"))
    b = torch.randn(8192, 8192, device="cuda").to(fp8_dtype("cuda")).t()
    one = torch.ones((), device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)


def kernel_flags(ap: argparse.ArgumentParser) -> None:
    """The engine's KernelConfig flags (--no-pdl, --no-skinny-gemm, --no-fuse-norms, --no-fuse-rope),
    as `server` takes them: a figure's command says which kernel configuration it measured."""
    from tandem.kernels import KernelConfig

    for f in dataclasses.fields(KernelConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=f.default,
                        help=f.metadata["help"])


def decode_step_args(ap: argparse.ArgumentParser, fp8: str = "none", kv_cache_dtype: str = "auto") -> None:
    """The decode step a profiling script builds: --model (MODELS), --batch, --context (prompt tokens a
    sequence), --fp8 and --kv-cache-dtype (as the engine's)."""
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--fp8", choices=["none", "block", "channel"], default=fp8,
                    help="FP8 weights, as benchmarks.roofline --fp8 builds them")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=kv_cache_dtype,
                    help="the engine's --kv-cache-dtype")


def kernel_kwargs(args: argparse.Namespace) -> dict:
    """The KernelConfig fields of parsed `kernel_flags`, as engine keyword arguments."""
    from tandem.kernels import KernelConfig

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(KernelConfig)}


def model_config(name: str, fp8: str = "none") -> dict:
    """The Hugging Face config of MODELS[name]; fp8 "block" adds the block-scaled FP8 checkpoint's
    quantization_config ([128, 128] blocks, as Qwen3-*-FP8 and DeepSeek-V3 ship), which
    --load-format dummy builds fp8 weights and scales for."""
    cfg = dict(MODELS[name])
    if fp8 == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return cfg


def build(name: str, fp8: str = "none", **kw):
    from tandem.engine import LLM

    d = Path(tempfile.mkdtemp()) / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(model_config(name, fp8)))
    # compile-ahead off: the roofline times steps after its own warm-up, and start-up time is not measured
    kw.setdefault("compile_ahead", False)
    return LLM(str(d), load_format="dummy", dtype="bfloat16", quantization="fp8" if fp8 == "channel" else None, **kw)


def param_bytes(runner, active_experts: float | None = None) -> float:
    """Bytes of weights one decode step of ModelRunner `runner` reads: all but the embedding (a
    gather of a few rows) for dense; for MoE, the non-expert weights plus `active_experts`
    experts per layer (the top-k of one token at batch 1; at larger batches RoutedExperts counts them)."""
    total = 0
    for name, p in runner.model.named_parameters():
        if active_experts is not None and name.endswith((".w13", ".w2", ".w13_scale", ".w2_scale")):
            total += p.numel() // p.shape[0] * active_experts * p.element_size()
        elif "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    return total


class RoutedExperts:
    """How many distinct experts each MoE layer's router picks in a decode step, for the HBM floor
    at batch > 1 (each picked expert's weights are read once a step; one token's top-k is only
    the b=1 count). While open (around building an engine, which captures its decode graphs),
    it keeps every router output ([rows, num_experts]) made during a CUDA graph capture: kept, its
    memory is not handed to a later tensor of the capture, so after each replay it holds that
    step's router logits. counts(rows) reads the top-k of the last capture at that row count."""

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts, self.top_k = num_experts, top_k
        self.logits: dict[int, list[torch.Tensor]] = {}
        self._hook = None

    def __enter__(self) -> "RoutedExperts":
        from tandem.engine.layers.linear import ReplicatedLinear  # (the routers' class, and theirs only)

        self._router = ReplicatedLinear
        self._hook = torch.nn.modules.module.register_module_forward_hook(self._keep)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()

    def _keep(self, module, args, out) -> None:
        if (isinstance(module, self._router) and isinstance(out, torch.Tensor) and out.dim() == 2
                and out.shape[1] == self.num_experts
                and self._capturing(out)):
            self.logits.setdefault(out.shape[0], []).append(out)

    @staticmethod
    def _capturing(out: torch.Tensor) -> bool:
        return out.is_cuda and torch.cuda.is_current_stream_capturing()

    def counts(self, rows: int, layers: int) -> list[int]:
        """Distinct experts each of the last `layers` router outputs captured at `rows` rows picks
        (softmax routing: the top-k of the logits), as the last replay left them. One row picks top-k
        (kernels/triton/routing.py route_token makes its logits inside a kernel, no router output)."""
        if rows == 1:
            return [self.top_k] * layers
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # (the last replay may still run: async scheduling)
        kept = self.logits.get(rows, [])
        if len(kept) < layers:
            raise RuntimeError(f"{len(kept)} router outputs captured at {rows} rows, expected {layers}")
        return [int(torch.topk(t.float(), self.top_k, dim=1).indices.unique().numel()) for t in kept[-layers:]]


def step_times(core, steps: int) -> list[float]:
    """Seconds of each of `steps` engine steps, GPU work included. With --async-scheduling a
    step leaves the next one running on the GPU by design, so there the steps are timed back
    to back (each waits for the one before it): the period of the steady state."""
    times = []
    overlap = core.async_scheduling
    # (CPU engines, as in the benchmarks' CPU tests, have nothing to wait for)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        if not overlap:
            sync()
            t = time.perf_counter()
        core.step()
        if not overlap:
            sync()
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def time_decode(core, batch: int, context: int, steps: int = 32) -> float:
    """Median seconds per decode step of EngineCore `core` with `batch` sequences at ~`context`
    tokens (lockstep DP ranks call it together: they take the same steps)."""
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest

    for i in range(batch):
        core.add_request(EngineRequest(f"r{i}", [(i * 7 + j) % 1000 + 1 for j in range(context)],
                                       SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0)))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    times = step_times(core, steps)
    core.abort_requests(list(core.scheduler.requests))
    core.step()
    return sorted(times)[len(times) // 2]


def time_prefill(llm, tokens: int) -> float:
    from tandem.engine import SamplingParams
    from tandem.engine.protocol import EngineRequest

    core = llm.engine
    best = float("inf")
    for k in range(3):
        core.add_request(EngineRequest(f"p{k}", [(j * 13 + k) % 1000 + 1 for j in range(tokens)],
                                       SamplingParams(max_tokens=1, temperature=0)))
        torch.cuda.synchronize()
        t = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
        while core.has_unfinished_requests():
            core.step()
    return best


def kv_bytes(runner, batch: int, context: int) -> int:
    return runner.kv_bytes_per_block() * batch * -(-context // runner.block_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS),
                    help="run one model per process on an 80 GB GPU: a finished model's memory is not all returned")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                    help="the engine's --async-scheduling (off here unless asked, so runs compare like for like)")
    kernel_flags(ap)
    ap.add_argument("--fp8", choices=["none", "block", "channel"], default="none",
                    help="FP8 weights: block = the Hugging Face [128, 128] checkpoint layout, channel = "
                         "--quantization fp8 (per-channel); the floors then count fp8 bytes and the FP8 matmul rate")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the engine's --kv-cache-dtype")
    ap.add_argument("--fp8-kernels", action="store_true",
                    help="also time each FP8 GEMM against torch._scaled_mm on the same shapes")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="also time every candidate FP8 GEMM tile plan per shape and print the best")
    ap.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the 4096-token prefill of the dense models")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels = kernel_kwargs(args)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    bw, mm = copy_bandwidth(), matmul_rate()
    dev = torch.cuda.get_device_name()
    mm8 = fp8_matmul_rate() if args.fp8 != "none" or args.fp8_kernels or args.fp8_sweep else None
    print(f"{dev}: copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s"
          + (f", fp8 matmul {mm8 / 1e12:.0f} TFLOP/s" if mm8 else "") + " (measured now)")
    from benchmarks import fp8_gemm
    rows = (fp8_gemm.kernel_rows() if args.fp8_kernels else []) + (fp8_gemm.sweep_rows() if args.fp8_sweep else [])
    tag = ("" if args.fp8 == "none" else f" fp8-{args.fp8}") + (" kv-fp8" if args.kv_cache_dtype == "fp8" else "")
    for name in args.models:
        moe = "moe" in MODELS[name]["model_type"]
        llm = build(name, args.fp8, max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=8192,
                    gpu_memory_utilization=0.92, async_scheduling=args.async_scheduling,
                    kv_cache_dtype=args.kv_cache_dtype, **kernels)
        for batch in ([1] if moe else [1, 64]):
            t = time_decode(llm.engine, batch, args.context)
            wbytes = param_bytes(llm.engine.runner, MODELS[name]["num_experts_per_tok"] if moe else None)
            # bw counts bytes read + written, which is what HBM moves per second either way.
            floor = (wbytes + kv_bytes(llm.engine.runner, batch, args.context)) / bw
            what = (f"decode b={batch} ctx={args.context}" + (" async" if args.async_scheduling else "")
                    + "".join(f" no-{k.replace('_', '-')}" for k, on in kernels.items() if not on) + tag)
            rows.append(dict(model=name, what=what, ms=t * 1e3,
                             floor_ms=floor * 1e3, of_floor=floor / t))
            print("measured:", rows[-1], flush=True)
        if not moe and args.prefill:
            t, T = time_prefill(llm, 4096), 4096
            cfg = MODELS[name]
            layer_params = sum(p.numel() for n, p in llm.engine.runner.model.named_parameters() if ".layers." in n)
            # GEMMs over every layer weight, plus causal attention (QK^T and PV over half the T x T scores).
            attn_flops = 4 * cfg["num_hidden_layers"] * cfg["hidden_size"] * T * T / 2
            # FP8: the layer GEMMs at the FP8 matmul rate (attention stays bf16)
            floor = 2 * layer_params * T / (mm8 if args.fp8 != "none" else mm) + attn_flops / mm
            rows.append(dict(model=name, what="prefill 4096" + tag, ms=t * 1e3, floor_ms=floor * 1e3, of_floor=floor / t))
            print("measured:", rows[-1], flush=True)
        del llm
        torch.cuda.empty_cache()
    print(f"{'model':<15} {'step':<26} {'ms':>8} {'floor ms':>9} {'of floor':>9}  plan")
    for r in rows:
        print(f"{r['model']:<15} {r['what']:<26} {r['ms']:>8.4f} {r['floor_ms']:>9.4f} {r['of_floor']:>9.0%}  "
              f"{r.get('plan', '')}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, date=time.strftime("%Y-%m-%d"), copy_GBps=bw / 1e9,
                                                  matmul_TFLOPs=mm / 1e12,
                                                  fp8_matmul_TFLOPs=mm8 / 1e12 if mm8 else None, rows=rows), indent=1))


if __name__ == "__main__":
    main()
