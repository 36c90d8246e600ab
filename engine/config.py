"""EngineConfig: one frozen dataclass tree, built once (from CLI flags or LLM kwargs), passed down.

Field names equal the CLI flag names (`max_num_seqs` <-> `--max-num-seqs`), which
follow vLLM's where the concept is the same.
"""
import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tandem.kernels.config import KernelConfig

DEFAULT_MODEL_DIR = str(Path(__file__).parent / "default_model")


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(default=DEFAULT_MODEL_DIR, metadata={
        "help": "a Hugging Face model folder (config.json, *.safetensors, tokenizer files); default: the tiny "
                "model shipped in engine/default_model"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "a tokenizer folder; default: the model folder"})
    served_model_name: tuple[str, ...] | None = field(default=None, metadata={
        "nargs": "+", "help": "the model name(s) the API answers to (the first is reported); default: the "
                              "model folder's name"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations: auto (the checkpoint's dtype on a GPU, float32 on the CPU), "
                "float32, bfloat16 or float16"})
    load_format: str = field(default="auto", metadata={
        "help": "auto or safetensors: the checkpoint's weights; dummy: random weights of the model's shape "
                "(benchmarks, no checkpoint needed)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "the longest sequence (prompt + output) in tokens; default and ceiling: the model's "
                "max_position_embeddings"})
    seed: int = field(default=0, metadata={
        "help": "torch seed at start-up (dummy weights, unseeded sampling); a request's own seed wins"})
    device: str = field(default="auto", metadata={
        "help": "auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N"})
    quantization: str | None = field(default=None, metadata={
        "help": "fp8: quantize a bf16 checkpoint's linear and expert weights to FP8 at load (per-channel "
                "weight scales, dynamic per-token activation scales). FP8 checkpoints are detected "
                "from config.json without it"})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block (the paging unit)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction (0-1] of the GPU's memory this instance may use: weights, activations, then the KV "
                "cache gets what is left (profiled at start-up)"})
    # On the CPU, which has no profiling run, the KV budget defaults to 1 GiB.
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV-cache size in bytes per rank; replaces the --gpu-memory-utilization budget on a GPU; "
                "default on the CPU: 1 GiB"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "exact number of KV-cache blocks, ignoring every memory budget (tests, debugging)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of a prompt prefix already computed (by full block); "
                "--no-enable-prefix-caching: compute every prompt in full"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto: the model's dtype; fp8: e4m3 (e4m3fnuz on MI300) with a per-tensor scale of 1.0, "
                "half the KV bytes"})


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running in one engine step"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "token budget of one engine step (prefill and decode tokens together)"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split a prompt longer than the step's token budget over several steps; "
                "--no-enable-chunked-prefill: such a prompt waits for a step with budget for all of it"})
    # None (the default) means on; EngineCore._step_async.
    async_scheduling: bool | None = field(default=None, metadata={
        "help": "launch a decode step before the previous step's tokens reach the host (default: on)"})


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",),
                                                           "help": "GPUs per instance for tensor parallelism"})
    data_parallel_size: int = field(default=1, metadata={
        "help": "engine ranks behind one API server, each a full copy of the model with its own KV cache"})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "shard MoE experts over the ranks (TP ranks, or DP ranks that then step together) "
                "instead of every rank holding all of them"})
    all2all_backend: str = field(default="none", metadata={
        "help": "how expert parallelism over DP ranks moves tokens: none (naive, or mori on ROCm when it "
                "imports), naive (all-gather), a2a (all_to_all), ipc (GPU peer memory, one node) or mori"})
    ep_dispatch_fp8: bool = field(default=False, metadata={
        "help": "a2a only: send tokens as fp8 with a per-token scale (half the bytes, inexact)"})
    moe_experts: str = field(default="auto", metadata={
        "help": "the MoE experts kernel: auto (aiter on ROCm when it imports, else triton), triton, "
                "torch (the reference) or aiter"})
    expert_placement_strategy: str = field(default="linear", metadata={
        "help": "which expert-parallel rank holds which expert: linear (contiguous ranges) or "
                "round_robin (expert e on rank e mod ranks)"})
    # Multi-node, torchrun style: ranks are spread evenly over the nodes.
    nnodes: int = field(default=1, metadata={"help": "nodes this instance spans (ranks spread evenly)"})
    node_rank: int = field(default=0, metadata={
        "help": "this node's index: 0 serves the API and schedules, > 0 runs its ranks only"})
    master_addr: str = field(default="127.0.0.1", metadata={
        "help": "node 0's address, where torch.distributed ranks meet (multi-node)"})
    master_port: int = field(default=29533, metadata={
        "help": "node 0's torch.distributed rendezvous port (multi-node)"})

    @property
    def lockstep_dp(self) -> bool:
        """Several DP ranks whose MoE layers are collectives over them: they step together."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel

    def validate(self, kv_transfer_enabled: bool) -> None:
        backends = ("none", "naive", "a2a", "ipc", "mori")
        if self.all2all_backend not in backends:
            raise ValueError(f"unknown --all2all-backend {self.all2all_backend!r}; "
                             f"expected one of {', '.join(backends)}")
        if self.all2all_backend != "none" and not self.enable_expert_parallel:
            raise ValueError(f"--all2all-backend {self.all2all_backend} needs --enable-expert-parallel")
        if self.ep_dispatch_fp8 and self.all2all_backend != "a2a":
            raise ValueError("--ep-dispatch-fp8 applies to --all2all-backend a2a only")
        if self.data_parallel_size > 1:
            unsupported = [msg for bad, msg in [
                (self.tensor_parallel_size > 1, "--tensor-parallel-size > 1"),
                (kv_transfer_enabled, "PD disaggregation (--kv-transfer-config)"),
                (self.nnodes > 1, "--nnodes > 1")] if bad]
            if unsupported:
                raise ValueError(f"--data-parallel-size > 1 with {unsupported[0]} is not supported yet")


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool = field(default=False, metadata={
        "help": "no CUDA graphs: every decode step launches its kernels one by one"})
    compile_ahead: bool = field(default=True, metadata={"help": (
        "compile every Triton kernel variant an eager step can need at start-up (engine/warmup.py), "
        "so none compiles while serving")})
    cuda_graph_sizes: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256),
                                              metadata={"help": (
        "comma-separated decode batch sizes captured as CUDA graphs (those <= --max-num-seqs); a batch "
        "runs in the smallest graph that fits it, larger ones run eagerly")})


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's --kv-transfer-config JSON: kv_connector, kv_role, kv_connector_extra_config."""

    kv_connector: str | None = None
    kv_role: str | None = None  # kv_producer | kv_consumer | kv_both
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.kv_connector is not None


@dataclass(frozen=True)
class ServingConfig:
    """The OpenAI API's options (read by the API process only)."""

    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template, as a file path or the template itself; replaces the tokenizer's"})
    generation_config: str = field(default="auto", metadata={
        "help": "default sampling parameters: auto (the model's generation_config.json), vllm (none: "
                "vLLM's own defaults), or a folder holding a generation_config.json"})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": 'let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser'})
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "how tool calls are read from the model's text: hermes (Hermes, Qwen2.5, Qwen3) or "
                "llama3_json (Llama 3.1+)"})

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, "hermes", "llama3_json"):
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}; expected hermes or llama3_json")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # Kernel and decode-path choices (PDL, skinny GEMMs, fusions): defined in kernels/config.py,
    # which imports nothing of ours, and handed to every layer at construction.
    kernel: KernelConfig = field(default_factory=KernelConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)

    @classmethod
    def create(cls, **kwargs) -> "EngineConfig":
        """Build from flat field names (CLI names with '_'); unknown names are an error."""
        sections = {}
        for f in dataclasses.fields(cls):
            sub = f.default_factory
            names = {sf.name for sf in dataclasses.fields(sub)}
            sections[f.name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise TypeError(f"unknown engine options: {sorted(kwargs)}")
        return cls(**sections)


def _flag_type(f: dataclasses.Field):
    t = str(f.type)
    if "tuple" in t:
        return lambda s: tuple(int(x) for x in s.split(","))
    if "dict" in t:
        return json.loads
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--kv-transfer-config` takes vLLM's JSON)."""
    for section in dataclasses.fields(EngineConfig):
        if section.name == "kv_transfer":
            continue
        group = parser.add_argument_group(section.name)
        for f in dataclasses.fields(section.default_factory):
            flags = ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))
            extra = {"help": f.metadata["help"]} if "help" in f.metadata else {}
            if "bool" in str(f.type) or f.type is bool:
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, **extra)
            elif "nargs" in f.metadata:
                group.add_argument(*flags, nargs=f.metadata["nargs"], default=None, **extra)
            else:
                group.add_argument(*flags, type=_flag_type(f), default=None, **extra)
    parser.add_argument("--kv-transfer-config", type=json.loads, default=None,
                        help='JSON, e.g. {"kv_connector": "TandemConnector", "kv_role": "kv_producer"}')


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The one place CLI flags become an EngineConfig (unset flags keep the defaults)."""
    kwargs = {k: v for k, v in vars(args).items() if v is not None}
    known = {sf.name for s in dataclasses.fields(EngineConfig) for sf in dataclasses.fields(s.default_factory)}
    kwargs = {k: v for k, v in kwargs.items() if k in known}
    if args.kv_transfer_config:
        kwargs.update(args.kv_transfer_config)
    if isinstance(kwargs.get("served_model_name"), list):
        kwargs["served_model_name"] = tuple(kwargs["served_model_name"])
    return EngineConfig.create(**kwargs)
