"""Environment variables, all read in one place: debug switches, the opt-in FP8 activations of
MXFP8 prefill, the cache folder, and the torchrun variables that multi-node launches may set
instead of flags."""
import os
from pathlib import Path

# Force the PyTorch reference ops even on a GPU (to bisect a kernel problem).
FORCE_REFERENCE_OPS = os.environ.get("M3SERVE_FORCE_REFERENCE_OPS", "0") == "1"


def env_flag(name: str, default: bool = False) -> bool:
    """An on/off switch: "1" on, "0" off, unset (or empty) `default`; anything else is a
    ValueError naming it."""
    value = os.environ.get(name, "") or ("1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


# Opt-in: MXFP8 linear layers run products of >= 256 rows (prefill) with FP8 activations, each
# token quantised to e4m3 with its own scale (W8A8), instead of dequantised weight x bf16
# activation, the declared numerics (docs/model.md §8). Off by default: it changes the outputs.
MXFP8_W8A8 = env_flag("M3SERVE_MXFP8_W8A8")


def debug_tracemalloc_frames() -> int:
    """M3SERVE_DEBUG_TRACEMALLOC=N (a leak hunt; tracing slows allocation down): the API process
    and the engine processes trace Python allocations with tracemalloc, N frames each, and the
    API process answers GET /debug/tracemalloc (docs/serving.md). 0 or unset: off."""
    value = os.environ.get("M3SERVE_DEBUG_TRACEMALLOC", "0") or "0"
    if not value.isdigit():
        raise ValueError(f"M3SERVE_DEBUG_TRACEMALLOC must be a number of frames (0 = off), got {value!r}")
    return int(value)

# Test-only: a JSON file of rules that constrain matching requests' outputs to fixed texts
# (serving/steer.py), for end-to-end tests of real agent clients against random weights.
TEST_STEER = os.environ.get("M3SERVE_TEST_STEER") or None

# The vision encoder's attention on a GPU: "varlen" (default; one flash call over all images of a
# forward) or "runs" (one SDPA call per run of equal-sized images), for A/B measurements.
VISION_ATTENTION = os.environ.get("M3SERVE_VISION_ATTENTION", "varlen") or "varlen"
if VISION_ATTENTION not in ("varlen", "runs"):
    raise ValueError(f"M3SERVE_VISION_ATTENTION must be varlen or runs, got {VISION_ATTENTION!r}")

# Opt-in: online-FP8 linears at decode rows (1-16) of a TP rank's narrow weights (N <= 4096,
# K >= 4096: the fused qkv) through the split-K FP8 GEMM (kernels/fp8_decode.py) instead of
# per-token quantisation + torch._scaled_mm; the same quantised operands. Off until a lease
# shows it faster at the rank (docs/performance.md).
FP8_DECODE_GEMM = env_flag("M3SERVE_FP8_DECODE_GEMM")


def route_align_max_tokens() -> int | None:
    """M3SERVE_ROUTE_ALIGN_MAX_TOKENS (0-16; unset: the kernel module's measured default):
    decode batches up to this many tokens route and align for the fused MoE in one launch
    (`kernels/fused_moe.py: moe_route_align`), larger ones in three; for A/B measurements."""
    value = os.environ.get("M3SERVE_ROUTE_ALIGN_MAX_TOKENS", "")
    if not value:
        return None
    if not value.isdigit() or int(value) > 16:
        raise ValueError(f"M3SERVE_ROUTE_ALIGN_MAX_TOKENS must be a token count from 0 to 16, got {value!r}")
    return int(value)


ROUTE_ALIGN_MAX_TOKENS = route_align_max_tokens()


# Opt-in: the per-token attention kernel merges its splits itself (the program of a token and
# KV group that finishes last does it) instead of a second kernel; off until a lease measures it.
SPLIT_MERGE_IN_KERNEL = env_flag("M3SERVE_SPLIT_MERGE_IN_KERNEL")


# On by default: routers of at least ROUTE_TC_MIN_TOKENS bf16 tokens (long prompt steps) compute
# their fp32 logits on tensor cores, the fp32 gate split into three exact bf16 parts
# (kernels/fused_moe.py: _route_logits_tc_kernel); "0": torch's fp32 GEMM, for A/B measurements.
ROUTE_TENSOR_CORES = env_flag("M3SERVE_ROUTE_TENSOR_CORES", default=True)


# Programmatic dependent launch of the decode kernels (kernels/pdl.py) where the GPU and Triton
# support it: "1" on, "0" off (the default: measured slower at one TP 8 rank, H100 online fp8,
# batch 1 and 4; docs/performance.md).
PDL = env_flag("M3SERVE_PDL")


def cpu_exact_positions() -> int:
    """M3SERVE_CPU_EXACT_POSITIONS (default 4096): on CPU, attention and the MSA top-k of query
    tokens at positions below this run in fp64, bit-identical to the reference ops; from it on,
    in fp32 (flash attention, fp32 index scores), the speed long prompts need."""
    value = os.environ.get("M3SERVE_CPU_EXACT_POSITIONS", "4096") or "4096"
    if not value.isdigit():
        raise ValueError(f"M3SERVE_CPU_EXACT_POSITIONS must be a token position (>= 0), got {value!r}")
    return int(value)


CPU_EXACT_POSITIONS = cpu_exact_positions()

# m3serve's cache folder (the smg workers manifest of `m3serve route`).
CACHE_DIR = os.environ.get("M3SERVE_CACHE", str(Path.home() / ".cache" / "m3serve"))


def log_level() -> int:
    """The logging level of m3serve's processes (`--log-level`, passed to the engine and rank
    processes as M3SERVE_LOG_LEVEL; default INFO)."""
    import logging
    return getattr(logging, os.environ.get("M3SERVE_LOG_LEVEL", "INFO").upper(), logging.INFO)


def torchrun_defaults() -> dict:
    """Defaults for the multi-node flags from torchrun's variables, when it launched us:
    master address/port, this node's rank (GROUP_RANK, or NODE_RANK) and the node count
    (WORLD_SIZE / LOCAL_WORLD_SIZE: torchrun starts one m3serve launcher per node)."""
    env = os.environ
    out = {}
    if "MASTER_ADDR" in env:
        out["master_addr"] = env["MASTER_ADDR"]
    if env.get("MASTER_PORT", "").isdigit():
        port = int(env["MASTER_PORT"])
        # torchrun's own store listens on MASTER_PORT; our ranks meet one port above it
        out["master_port"] = port + 1 if "TORCHELASTIC_RUN_ID" in env else port
    for name in ("GROUP_RANK", "NODE_RANK"):
        if env.get(name, "").isdigit():
            out["node_rank"] = int(env[name])
            break
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        out["nnodes"] = int(world) // int(local)
    return out


def nixl_side_channel() -> tuple[str, int | None, float]:
    """The KV producer's side channel as vLLM names it: VLLM_NIXL_SIDE_CHANNEL_HOST (default
    localhost: set it to an address the decode hosts reach), VLLM_NIXL_SIDE_CHANNEL_PORT (unset:
    a free port, so several workers start side by side on one host) and
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT (seconds held KV waits for its decode worker, default 480)."""
    env = os.environ
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
    port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_PORT must be a port number, got {port!r}")
    timeout = env.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480")
    try:
        timeout_s = float(timeout)
    except ValueError:
        timeout_s = -1.0
    if not timeout_s > 0:
        raise ValueError(f"VLLM_NIXL_ABORT_REQUEST_TIMEOUT must be a positive number of seconds, got {timeout!r}")
    return host, None if port is None else int(port), timeout_s
