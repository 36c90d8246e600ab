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
    model: str = DEFAULT_MODEL_DIR
    tokenizer: str | None = None  # defaults to the model folder
    served_model_name: tuple[str, ...] | None = field(default=None, metadata={
        "nargs": "+", "help": "the model name(s) the API answers to (the first is reported); default: the "
                              "model folder's name"})
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | safetensors | dummy
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    quantization: str | None = field(default=None, metadata={
        "help": "fp8: quantize a bf16 checkpoint's linear and expert weights to FP8 at load (per-channel "
                "weight scales, dynamic per-token activation scales). FP8 checkpoints are detected "
                "from config.json without it"})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # The KV cache's size in bytes (per rank). On a GPU it replaces the gpu_memory_utilization
    # budget when given (as in vLLM); on the CPU, which has no profiling run, it defaults to 1 GiB.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto: the model's dtype; fp8: e4m3 (e4m3fnuz on MI300) with a per-tensor scale of 1.0, "
                "half the KV bytes"})


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    # Launch a decode step before the previous step's tokens reach the host (EngineCore._step_async).
    # None (the default) means on.
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",),
                                                           "help": "GPUs per instance for tensor parallelism"})
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # none: with --enable-expert-parallel over DP ranks that means naive (mori on ROCm when importable)
    all2all_backend: str = "none"  # none | naive | a2a | ipc | mori
    ep_dispatch_fp8: bool = False  # a2a: quantize tokens to fp8 (per-token scale) before dispatch
    moe_experts: str = "auto"  # auto | triton | torch | aiter
    expert_placement_strategy: str = "linear"  # linear | round_robin
    # Multi-node, torchrun style: ranks are spread evenly over the nodes.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29533

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
    enforce_eager: bool = False
    compile_ahead: bool = field(default=True, metadata={"help": (
        "compile every Triton kernel variant an eager step can need at start-up (engine/warmup.py), "
        "so none compiles while serving")})
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


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
