"""Engine configuration: one frozen dataclass per domain, combined into `EngineConfig`.

CLI flags and `LLM(**kwargs)` keywords are generated from the dataclass fields (snake_case field
`max_num_seqs` <-> flag `--max-num-seqs`), so a new knob is added in exactly one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # local dir or hub repo id; None = the embedded tiny model
    dtype: str = "auto"               # auto | bfloat16 | float32
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0
    device: str = "auto"              # auto | cpu | cuda
    load_format: str = "auto"         # auto (read the checkpoint) | dummy (random weights, real shapes)
    quantization: str | None = None   # None | fp8 (online: per-channel weights, per-token activations)

    def __post_init__(self):
        if self.quantization not in (None, "fp8", "fp8_per_channel"):
            raise ValueError(f"quantization: unsupported value {self.quantization!r} (fp8)")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: unsupported value {self.load_format!r} (auto, dummy)")
        if self.dtype not in ("auto", "bfloat16", "bf16", "float32", "fp32", "float16", "half"):
            raise ValueError(f"dtype: unsupported value {self.dtype!r} (auto, bfloat16, float32)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = None           # None = the model's sparse block size
    gpu_memory_utilization: float = 0.9     # fraction of GPU memory the engine may use
    kv_cache_memory: int | None = None      # bytes for the KV cache (any device); overrides the above
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"            # auto | fp8 (e4m3, per-layer scales)
    index_cache_dtype: str = "auto"         # auto | fp8 (plain e4m3 cast, spec §4)

    def __post_init__(self):
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype: unsupported value {self.kv_cache_dtype!r} (auto, fp8)")
        if self.index_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"index_cache_dtype: unsupported value {self.index_cache_dtype!r} (auto, fp8)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget of one engine step
    max_num_seqs: int = 256             # running requests at most
    max_waiting_requests: int = 4096    # admission bound of the waiting queue (server answers 503 past it)

    def __post_init__(self):
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool = False                         # no CUDA graphs
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # decode batch sizes; None = 1,2,4,8,16,24,32,48,64,...

    def __post_init__(self):
        sizes = self.cudagraph_capture_sizes
        if isinstance(sizes, str):
            try:
                sizes = tuple(int(x) for x in sizes.replace(",", " ").split())
            except ValueError:
                raise ValueError(f"cudagraph_capture_sizes must be integers, got {self.cudagraph_capture_sizes!r}") from None
            object.__setattr__(self, "cudagraph_capture_sizes", sizes)
        if sizes is not None:
            sizes = tuple(sizes)
            if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
                raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat snake_case keywords (`max_num_seqs=8`); unknown keywords are an error."""
        parts = {}
        for name, f in ((f.name, f) for f in dataclasses.fields(cls)):
            sub_cls = f.default_factory  # type: ignore[misc]
            names = {sf.name for sf in dataclasses.fields(sub_cls)}
            parts[name] = sub_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        return cls(**parts)


def engine_fields() -> list[dataclasses.Field]:
    """Every flat engine option, in declaration order (used to generate CLI flags)."""
    out = []
    for f in dataclasses.fields(EngineConfig):
        out.extend(dataclasses.fields(f.default_factory))  # type: ignore[arg-type]
    return out
