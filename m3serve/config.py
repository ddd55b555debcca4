"""Engine configuration: one frozen dataclass per domain, combined into `EngineConfig`.

CLI flags and `LLM(**kwargs)` keywords are generated from the dataclass fields (snake_case field
`max_num_seqs` <-> flag `--max-num-seqs`), so a new knob is added in exactly one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


# Closed sets of values (flags list them in --help; errors name them all)
DTYPES = ("auto", "bfloat16", "bf16", "float16", "half", "float32", "fp32")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATION_METHODS = ("fp8", "fp8_per_channel", "mxfp8", "mxfp4", "nvfp4")
CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
EXECUTOR_BACKENDS = ("uni", "mp")


def _choices(values: tuple, metavar: str | None = None) -> dict:
    """Field metadata of a flag with a closed set of values (`engine_args` turns it into argparse
    choices)."""
    return {"choices": values, **({"metavar": metavar} if metavar else {})}


def _metavar(name: str) -> dict:
    """Field metadata naming the unit or form of a flag's value in --help (`--kv-offloading-size GiB`)."""
    return {"metavar": name}


def unsupported(option: str, value, supported) -> ValueError:
    """The error for a value outside a closed set, naming the value and every supported one."""
    return ValueError(f"{option}: unsupported value {value!r} (supported: {', '.join(supported)})")


# Each field's string literal below it is its documentation: `--help` prints it
# (`config_docs.field_docs`), so the flag's help and the field cannot drift apart.
@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """Checkpoint directory or hub repo id (default: the embedded tiny model, trained, a toy: docs/tiny_model.md)."""
    dtype: str = field(default="auto", metadata=_choices(DTYPES))
    """Dtype of weights and activations; auto: the checkpoint's torch_dtype (bfloat16 for MiniMax-M3)."""
    max_model_len: int | None = field(default=None, metadata=_metavar("TOKENS"))
    """Longest prompt + output in tokens (default: the model's max_position_embeddings)."""
    seed: int = 0
    """The engine's base seed: random weights (--load-format dummy) and the sampling of requests that
    set no seed."""
    device: str = "auto"
    """auto (a GPU when there is one, else the CPU), cpu, or cuda."""
    load_format: str = field(default="auto", metadata=_choices(LOAD_FORMATS))
    """auto: read the checkpoint's weights; dummy: random weights of the real shapes (config.json only)."""
    quantization: str | None = field(default=None, metadata=_choices(QUANTIZATION_METHODS))
    """Quantise a BF16 checkpoint while loading: fp8 (= fp8_per_channel: every linear, per-channel
    weights, per-token activations), mxfp8 (every linear and the routed experts as MXFP8), mxfp4 or
    nvfp4 (4-bit routed and shared experts). A quantised checkpoint's own format needs no flag
    (default: the checkpoint's weights as stored)."""
    hf_overrides: str | dict | None = field(default=None, metadata=_metavar("JSON"))
    """JSON object laid over config.json (vLLM's --hf-overrides; default: none)."""
    language_model_only: bool = False
    """Skip the vision tower: text-only serving, media requests are a 400."""
    limit_mm_per_prompt: str | dict | None = field(default=None, metadata=_metavar("JSON"))
    """Media items per prompt, JSON {"image": N, "video": M} (default: 16 images, 2 videos)."""
    mm_processor_kwargs: str | dict | None = field(default=None, metadata=_metavar("JSON"))
    """JSON defaults of the image / video processor: min_pixels, max_pixels, video_min_pixels,
    video_max_pixels, vision_segment_max_frames (default: the checkpoint's processor config)."""
    mm_encoder_cache_gb: float = field(default=1.0, metadata=_metavar("GiB"))
    """GiB of vision-encoder outputs each rank keeps on its device for images and videos that come
    back, by content; the running requests' own outputs count in it; 0: keep an output only while a
    request uses it."""

    def __post_init__(self):
        if self.hf_overrides is not None:
            object.__setattr__(self, "hf_overrides", _json_object_option(self.hf_overrides, "hf_overrides"))
        object.__setattr__(self, "limit_mm_per_prompt", _mm_limits(self.limit_mm_per_prompt))
        if self.mm_processor_kwargs is not None:      # its keys are checked by engine_args.build_engine_config
            object.__setattr__(self, "mm_processor_kwargs",
                               _json_object_option(self.mm_processor_kwargs, "mm_processor_kwargs"))
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise unsupported("quantization", self.quantization, QUANTIZATION_METHODS)
        if self.load_format not in LOAD_FORMATS:
            raise unsupported("load_format", self.load_format, LOAD_FORMATS)
        if self.dtype not in DTYPES:
            raise unsupported("dtype", self.dtype, DTYPES)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        size = self.mm_encoder_cache_gb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 <= size < float("inf"):
            raise ValueError(f"mm_encoder_cache_gb must be a number of GiB >= 0 (0: no reuse), got {size!r}")

    @property
    def mm_encoder_cache_bytes(self) -> int:
        """The encoder-output cache's bound per rank, in bytes."""
        return int(self.mm_encoder_cache_gb * (1 << 30))


KV_OFFLOADING_BACKENDS = ("native",)   # vLLM's default; lmcache is not built in


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = field(default=None, metadata=_metavar("TOKENS"))
    """Tokens per KV block (default: the model's sparse block size, 128 for MiniMax-M3)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights, KV cache, activations), in (0, 1]."""
    kv_cache_memory: int | None = field(default=None, metadata=_metavar("BYTES"))
    """Bytes of KV cache per rank, on any device; overrides --gpu-memory-utilization (default: what
    that fraction leaves on a GPU, 256 MiB on a CPU)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of earlier requests' identical prompt prefixes."""
    kv_cache_dtype: str = field(default="auto", metadata=_choices(CACHE_DTYPES))
    """KV cache dtype: auto (the model dtype) or fp8 (= fp8_e4m3, per-layer scales)."""
    index_cache_dtype: str = field(default="auto", metadata=_choices(CACHE_DTYPES))
    """Index-key cache dtype of the sparse layers: auto (the model dtype) or fp8 (= fp8_e4m3, a plain
    cast, docs/model.md §4)."""
    kv_offloading_size: float | None = field(default=None, metadata=_metavar("GiB"))
    """CPU tier below the GPU prefix cache: GiB of pinned host memory per replica, summed over its TP
    ranks (each holds its share; vLLM's flag; default: no tier)."""
    kv_offloading_backend: str = field(default="native", metadata=_choices(KV_OFFLOADING_BACKENDS))
    """Implementation of the CPU tier (native is the only one)."""

    def __post_init__(self):
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_dtype not in CACHE_DTYPES:
            raise unsupported("kv_cache_dtype", self.kv_cache_dtype, CACHE_DTYPES)
        if self.index_cache_dtype not in CACHE_DTYPES:
            raise unsupported("index_cache_dtype", self.index_cache_dtype, CACHE_DTYPES)
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise unsupported("kv_offloading_backend", self.kv_offloading_backend, KV_OFFLOADING_BACKENDS)
        size = self.kv_offloading_size
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
                raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size needs prefix caching: the CPU tier holds prefix-cached "
                                 "blocks (drop --no-enable-prefix-caching)")

    @property
    def kv_offloading_bytes(self) -> int:
        """Bytes of the CPU tier over all TP ranks of a replica (0 = no tier)."""
        return 0 if self.kv_offloading_size is None else int(self.kv_offloading_size * (1 << 30))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = field(default=8192, metadata=_metavar("TOKENS"))
    """Token budget of one engine step (prefill chunks and decodes together)."""
    max_num_seqs: int = 256
    """Running requests at most."""
    max_waiting_requests: int = 4096
    """Bound of the waiting queue: past it the server answers 503 with Retry-After."""
    long_prefill_token_threshold: int = field(default=0, metadata=_metavar("TOKENS"))
    """Tokens one request may compute per step (0: no cap; with --max-num-partial-prefills > 1,
    0 means 4 % of --max-model-len)."""
    max_num_partial_prefills: int = 0
    """Requests prefilling in one step at most (0: no cap)."""
    max_num_encoder_input_tokens: int | None = field(default=None, metadata=_metavar("TOKENS"))
    """Image / video placeholder tokens whose encoding one step may start; an item larger than the
    budget is encoded alone in its step (default: --max-num-batched-tokens)."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device (default: on wherever it applies, as vLLM;
    --async-scheduling: on or a start-up error; --no-async-scheduling: off)."""

    def __post_init__(self):
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if not isinstance(self.max_num_partial_prefills, int) or self.max_num_partial_prefills < 0:
            raise ValueError(f"max_num_partial_prefills must be an integer >= 0 (0: no cap), got "
                             f"{self.max_num_partial_prefills}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens <= 0:
            raise ValueError(f"max_num_encoder_input_tokens must be positive, got "
                             f"{self.max_num_encoder_input_tokens}")

    def effective_long_prefill_threshold(self, max_model_len: int) -> int:
        """The per-request token cap the scheduler applies (0 = none): the flag's value, or, with
        more than one concurrent partial prefill and no value given, 4 % of max_model_len (vLLM's
        default for the same pair of flags)."""
        if self.long_prefill_token_threshold == 0 and self.max_num_partial_prefills > 1:
            return int(max_model_len * 0.04)
        return self.long_prefill_token_threshold


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over ranks (vLLM's names and meaning).

    world = tensor_parallel_size x data_parallel_size ranks, one process and one device each.
    Attention, dense MLPs, the shared expert, embedding and lm_head are split over the TP group;
    MoE experts over all DP x TP ranks: whole experts per rank with `enable_expert_parallel`,
    else every expert's intermediate dimension. Each DP rank has its own scheduler and KV cache.
    """
    tensor_parallel_size: int = 1
    """GPUs each replica's attention, dense MLPs, shared expert, embedding and lm_head are split over."""
    data_parallel_size: int = 1
    """Replicas, each with its own scheduler and KV cache; the MoE layers span all TP x DP ranks."""
    enable_expert_parallel: bool = False
    """The MoE layers' ranks hold whole experts instead of a slice of every expert."""
    distributed_executor_backend: str | None = field(default=None, metadata=_choices(EXECUTOR_BACKENDS))
    """uni: the one rank in this process; mp: every rank a process of its own (default: uni for one
    rank, mp otherwise)."""
    nnodes: int = 1
    """Hosts of one engine; each runs the same `m3serve serve ...` with its own --node-rank."""
    node_rank: int = 0
    """This host's index among --nnodes; node 0 serves HTTP, the others run ranks only."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where rank 0 listens (under torchrun: MASTER_ADDR)."""
    master_port: int | None = None
    """Port of rank 0's rendezvous on --master-addr (default: a free port on one host, 29500 across
    hosts; under torchrun: MASTER_PORT + 1)."""
    data_parallel_rpc_port: int = 29550
    """Across hosts, node 0's API process listens on this port (outputs) and the next ones (one per
    replica's inputs)."""
    distributed_timeout_seconds: int = field(default=600, metadata=_metavar("SECONDS"))
    """A collective (or an engine step) that waits longer fails the engine."""
    disable_custom_all_reduce: bool = False
    """NCCL for every TP all-reduce (no one-shot IPC all-reduce kernel)."""

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (tensor_parallel_size {self.tensor_parallel_size} "
                             f"x data_parallel_size {self.data_parallel_size}) cannot be spread "
                             f"evenly over nnodes={self.nnodes}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise unsupported("distributed_executor_backend", backend, EXECUTOR_BACKENDS)
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank, but "
                             f"{self.world_size} ranks were asked for; use 'mp'")
        for name in ("master_port", "data_parallel_rpc_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} must be in [1, 65535], got {port}")
        if self.distributed_timeout_seconds <= 0:
            raise ValueError(f"distributed_timeout_seconds must be positive, got "
                             f"{self.distributed_timeout_seconds}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def uses_processes(self) -> bool:
        """True when the engine runs as rank processes (the mp executor), not in-process."""
        return self.world_size > 1 or self.distributed_executor_backend == "mp"


_CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool = False
    """No CUDA graphs: every step runs eagerly."""
    cudagraph_capture_sizes: tuple[int, ...] | None = field(default=None, metadata=_metavar("N,N,..."))
    """Decode batch sizes captured as CUDA graphs, comma-separated (default: 1,2,4,8,16,24,32,48,64,...)."""
    compilation_config: str | dict | None = field(default=None, metadata=_metavar("JSON"))
    """vLLM's JSON: cudagraph_mode NONE = --enforce-eager, any other mode = graphs for pure-decode
    steps (mixed steps run eagerly); cudagraph_capture_sizes as above; other keys are logged as not
    applicable (default: none)."""

    def __post_init__(self):
        object.__setattr__(self, "not_applicable", {})
        if self.compilation_config is not None:
            raw = _json_object_option(self.compilation_config, "compilation_config")
            mode = raw.pop("cudagraph_mode", None)
            if mode is not None:
                if str(mode).upper() not in _CUDAGRAPH_MODES:
                    raise ValueError(f"compilation_config.cudagraph_mode must be one of {list(_CUDAGRAPH_MODES)}, "
                                     f"got {mode!r}")
                if str(mode).upper() == "NONE":
                    object.__setattr__(self, "enforce_eager", True)
            sizes = raw.pop("cudagraph_capture_sizes", None)
            if sizes is not None:
                if not isinstance(sizes, list):
                    raise ValueError(f"compilation_config.cudagraph_capture_sizes must be a list, got {sizes!r}")
                object.__setattr__(self, "cudagraph_capture_sizes", tuple(sizes))
            object.__setattr__(self, "not_applicable", raw)
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


_SPEC_METHODS = ("eagle3", "mtp", "dspark")
_SPEC_NOT_APPLICABLE = ("attention_backend", "use_local_argmax_reduction")   # recipes set these


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` JSON (or `LLM(speculative_config={...})`), vLLM's keys:
    method (eagle3 | mtp | dspark), model (the draft; MTP: default the target checkpoint;
    DSpark and EAGLE3: default the target's dspark/ or eagle3/ folder), num_speculative_tokens (k; DSpark: default
    the draft's dspark_block_size, filled in by `EngineConfig`), draft_tensor_parallel_size
    (1 = the draft replicated on every rank, or the target's TP), rejection_sample_method
    (standard | synthetic),
    synthetic_acceptance_length (with synthetic: mean tokens emitted per verify step, 1..k+1),
    disable_by_batch_size (a step with at least this many running requests decodes without
    drafts; None = on a GPU, each batch size runs plain steps or verifies the number of drafts
    (k or fewer) whose measured steps emit the most tokens per second, `core/spec_gate.py`; on
    a CPU, k always).
    The parsed values are the attributes below; None = speculation off."""
    speculative_config: str | dict | None = field(default=None, metadata=_metavar("JSON"))
    """Speculative decoding, vLLM's JSON: method (eagle3, mtp, dspark), model, num_speculative_tokens,
    draft_tensor_parallel_size, rejection_sample_method, synthetic_acceptance_length,
    disable_by_batch_size (docs/serving.md; default: off)."""

    def __post_init__(self):
        raw = self.speculative_config
        values = dict(method=None, model=None, num_speculative_tokens=0, draft_tensor_parallel_size=None,
                      rejection_sample_method="standard", synthetic_acceptance_length=None,
                      disable_by_batch_size=None, not_applicable={})
        if raw is not None:
            values.update(_parse_speculative(raw))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def enabled(self) -> bool:
        return self.method is not None


def _parse_speculative(raw) -> dict:
    raw = _json_object_option(raw, "speculative_config")
    known = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
             "rejection_sample_method", "synthetic_acceptance_length", "disable_by_batch_size")
    unknown = sorted(set(raw) - set(known) - set(_SPEC_NOT_APPLICABLE))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown} (known: {list(known)})")
    out = {"not_applicable": {k: raw.pop(k) for k in _SPEC_NOT_APPLICABLE if k in raw}}
    method = raw.get("method")
    if method not in _SPEC_METHODS:
        raise ValueError(f"speculative_config.method must be one of {list(_SPEC_METHODS)}, got {method!r}")
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"speculative_config.model must be a path or hub id, got {model!r}")
    k = raw.get("num_speculative_tokens")
    if k is None and method == "dspark":
        k = 0                                      # the draft's block size, once the model is known
    elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}")
    draft_tp = raw.get("draft_tensor_parallel_size")
    if draft_tp is not None and (isinstance(draft_tp, bool) or not isinstance(draft_tp, int) or draft_tp < 1):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size must be a positive integer, "
                         f"got {draft_tp!r}")
    rule = raw.get("rejection_sample_method", "standard")
    if rule not in ("standard", "synthetic"):
        raise ValueError(f"speculative_config.rejection_sample_method must be 'standard' or 'synthetic', "
                         f"got {rule!r}")
    length = raw.get("synthetic_acceptance_length")
    if rule == "synthetic":
        length = synthetic_length(length, k or 16)      # DSpark's default k: checked again once known
    elif length is not None:
        raise ValueError("speculative_config.synthetic_acceptance_length needs rejection_sample_method "
                         "'synthetic' (it is a benchmarking mode, never on by default)")
    disable = raw.get("disable_by_batch_size")
    if disable is not None and (isinstance(disable, bool) or not isinstance(disable, int) or disable < 2):
        raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 2 (steps with at "
                         f"least that many running requests decode without drafts), got {disable!r}")
    out.update(method=method, model=model, num_speculative_tokens=k, draft_tensor_parallel_size=draft_tp,
               rejection_sample_method=rule, synthetic_acceptance_length=length, disable_by_batch_size=disable)
    return out


def synthetic_length(length, k: int) -> float:
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not 1.0 <= length <= k + 1:
        raise ValueError(f"speculative_config.synthetic_acceptance_length must be a number in "
                         f"[1, num_speculative_tokens + 1 = {k + 1}] with rejection_sample_method "
                         f"'synthetic', got {length!r}")
    return float(length)


KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM keys that configure other connectors (NCCL, shared storage): accepted and logged
_KV_NOT_APPLICABLE = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip",
                      "kv_port", "enable_permute_local_kv", "kv_connector_module_path")
_KV_EXTRA_KEYS = {"backends": None, "abort_request_timeout": None, "transfer_timeout": 60.0,
                  "handshake_timeout": 10.0, "progress_thread": None, "test_fault": None}
KV_TEST_FAULTS = ("fail", "stall", "skip_index")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config` JSON (or `LLM(kv_transfer_config={...})`), vLLM's keys:
    kv_connector (NixlConnector), kv_role (kv_producer: prefills and holds KV for a decode
    worker; kv_consumer: pulls prompt KV and decodes; kv_both), engine_id (default: random),
    kv_load_failure_policy (recompute: a request whose KV cannot be pulled computes its prompt
    locally; fail: it ends with an error), kv_connector_extra_config: backends (NIXL backends,
    default ["UCX"]), abort_request_timeout (seconds a producer holds KV nobody pulls; default
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT or 480), transfer_timeout (seconds a consumer waits for one
    pull, default 60), handshake_timeout (seconds, default 10), progress_thread (NIXL's progress
    thread, which keeps a core busy: default on with a GPU, off on CPU), test_fault (tests only: "fail"
    makes every pull fail inside NIXL, "stall" never posts it, "skip_index" leaves the index
    cache behind). None = no KV transfer."""
    kv_transfer_config: str | dict | None = field(default=None, metadata=_metavar("JSON"))
    """Prefill/decode disaggregation, vLLM's JSON: kv_connector (NixlConnector), kv_role (kv_producer,
    kv_consumer, kv_both), engine_id, kv_load_failure_policy, kv_connector_extra_config
    (docs/serving.md; default: off)."""

    def __post_init__(self):
        values = dict(kv_connector=None, kv_role=None, engine_id=None, kv_load_failure_policy="recompute",
                      backends=("UCX",), abort_request_timeout=None, transfer_timeout=60.0,
                      handshake_timeout=10.0, progress_thread=None, test_fault=None, not_applicable={})
        if self.kv_transfer_config is not None:
            values.update(_parse_kv_transfer(self.kv_transfer_config))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def enabled(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


DEFAULT_MM_LIMITS = {"image": 16, "video": 2}


def _mm_limits(raw) -> dict:
    """--limit-mm-per-prompt (vLLM's JSON form, e.g. '{"image": 4, "video": 0}') -> a complete
    {"image": n, "video": m}; modalities left out keep their defaults."""
    if raw is None:
        return dict(DEFAULT_MM_LIMITS)
    given = _json_object_option(raw, "limit_mm_per_prompt")
    out = dict(DEFAULT_MM_LIMITS)
    for key, value in given.items():
        if key not in DEFAULT_MM_LIMITS:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {key!r} (image, video)")
        if isinstance(value, dict):          # vLLM's richer form {"count": n, ...}
            value = value.get("count")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt.{key} must be a non-negative integer, got {value!r}")
        out[key] = value
    return out


def _json_object_option(raw, option: str) -> dict:
    import json

    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option}: not valid JSON ({e}): {raw!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{option} must be a JSON object, got {raw!r}")
    return dict(raw)


def _positive_seconds(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name} must be a positive "
                         f"number of seconds, got {value!r}")
    return float(value)


def _parse_kv_transfer(raw) -> dict:
    import uuid

    raw = _json_object_option(raw, "kv_transfer_config")
    known = ("kv_connector", "kv_role", "engine_id", "kv_load_failure_policy", "kv_connector_extra_config")
    unknown = sorted(set(raw) - set(known) - set(_KV_NOT_APPLICABLE))
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key(s) {unknown} (known: {list(known)})")
    out = {"not_applicable": {k: raw[k] for k in _KV_NOT_APPLICABLE if k in raw}}
    connector = raw.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector must be one of {list(KV_CONNECTORS)}, "
                         f"got {connector!r}")
    role = raw.get("kv_role")
    if role not in KV_ROLES:
        raise ValueError(f"kv_transfer_config.kv_role must be one of {list(KV_ROLES)}, got {role!r}")
    engine_id = raw.get("engine_id") or str(uuid.uuid4())
    if not isinstance(engine_id, str) or len(engine_id) > 256:
        raise ValueError(f"kv_transfer_config.engine_id must be a string of at most 256 characters, "
                         f"got {engine_id!r}")
    policy = raw.get("kv_load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be 'recompute' or 'fail', "
                         f"got {policy!r}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config must be a JSON object, got {extra!r}")
    unknown = sorted(set(extra) - set(_KV_EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {unknown} "
                         f"(known: {sorted(_KV_EXTRA_KEYS)})")
    backends = extra.get("backends") or ["UCX"]
    if isinstance(backends, str):
        backends = [backends]
    if not isinstance(backends, list) or not all(isinstance(b, str) and b for b in backends):
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.backends must be a list of "
                         f"NIXL backend names, got {backends!r}")
    fault = extra.get("test_fault")
    if fault is not None and fault not in KV_TEST_FAULTS:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.test_fault must be one of "
                         f"{list(KV_TEST_FAULTS)}, got {fault!r}")
    progress = extra.get("progress_thread")
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.progress_thread must be true or false, "
                         f"got {progress!r}")
    abort = extra.get("abort_request_timeout")
    out.update(kv_connector=connector, kv_role=role, engine_id=engine_id, kv_load_failure_policy=policy,
               backends=tuple(backends), test_fault=fault, progress_thread=progress,
               abort_request_timeout=None if abort is None else _positive_seconds(abort, "abort_request_timeout"),
               transfer_timeout=_positive_seconds(extra.get("transfer_timeout", 60.0), "transfer_timeout"),
               handshake_timeout=_positive_seconds(extra.get("handshake_timeout", 10.0), "handshake_timeout"))
    return out


# generation_config.json keys that become request defaults (vLLM's set); max_new_tokens -> max_tokens
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling defaults for requests that do not set them (vLLM's flags).
    generation_config: "auto" (the model's generation_config.json), "vllm" (none: the OpenAI
    defaults) or a directory holding a generation_config.json. override_generation_config: a JSON
    object of GENERATION_KEYS laid over them (`{"temperature": 0.6}`)."""
    generation_config: str = "auto"
    """Request sampling defaults: auto (the model's generation_config.json), vllm (none: the OpenAI
    defaults) or a directory holding a generation_config.json."""
    override_generation_config: str | dict | None = field(default=None, metadata=_metavar("JSON"))
    """JSON object of temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens laid over
    those defaults, e.g. '{"temperature": 0.6}' (default: none)."""

    def __post_init__(self):
        overrides = {}
        if self.override_generation_config is not None:
            overrides = _json_object_option(self.override_generation_config, "override_generation_config")
        object.__setattr__(self, "overrides", overrides)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be auto, vllm or a directory, got {self.generation_config!r}")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    grammar_compile_timeout_seconds: float = field(default=30.0, metadata=_metavar("SECONDS"))
    """A request whose grammar (response_format, structured_outputs, forced tool_choice) is not
    compiled this long after it arrived fails with a 400; other requests never wait for it."""

    def __post_init__(self):
        timeout = self.grammar_compile_timeout_seconds
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"grammar_compile_timeout_seconds must be a positive number of seconds, got {timeout!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def __post_init__(self):
        if self.kv_transfer.enabled and self.speculative.enabled:
            raise ValueError("--kv-transfer-config cannot be combined with --speculative-config yet: "
                             "a decode worker would also need the draft's KV of the prompt")
        if self.kv_transfer.enabled and self.parallel.data_parallel_size > 1:
            raise ValueError("--kv-transfer-config needs data_parallel_size 1 for now: run one "
                             "prefill or decode server per replica behind the router instead")
        if self.scheduler.async_scheduling and self.async_scheduling_blocker():
            raise ValueError(f"--async-scheduling cannot be combined with {self.async_scheduling_blocker()} "
                             f"yet: drop the flag (by default it is used wherever it applies)")

    def async_scheduling_blocker(self) -> str | None:
        """What this engine cannot combine async scheduling with, if anything."""
        return ("--kv-transfer-config" if self.kv_transfer.enabled else
                "--data-parallel-size > 1" if self.parallel.data_parallel_size > 1 else None)

    def async_scheduling_off(self) -> str | None:
        """Why async scheduling is off in this engine (None: it is on)."""
        if self.scheduler.async_scheduling is False:
            return "--no-async-scheduling"
        return self.async_scheduling_blocker()

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
