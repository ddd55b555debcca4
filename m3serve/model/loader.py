"""Checkpoint loading: resolve a model directory (local or Hugging Face hub), stream its
safetensors tensor by tensor into this rank's shards of a freshly built model.

Two name schemes are accepted and brought to one canonical form (the original checkpoint names
without the `language_model.` prefix): the original MiniMax-M3 names and the names transformers'
`save_pretrained` writes (fused gate_up, stacked experts, `self_attn.indexer.*`). MTP tensors are
skipped; vision, projector and merge-MLP tensors are skipped by the text pass and loaded, just as
strictly, by `load_vision_encoder` (unless the model is served language-model-only). Any missing, unexpected, duplicated or mis-shaped tensor, or an
unreadable file, raises a ValueError naming the tensor and the file; the half-built model is dropped.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from m3serve.distributed import ParallelInfo
from m3serve.layers.linear import attach_loader, deferred_weights, make_param
from m3serve.model.checkpoint import LAYER_NAME, LazyTensor, canonicalize, iter_checkpoint, materialize, weight_files
from m3serve.model.config import M3Config, canonical_shapes, load_config
from m3serve.model.files import resolve_model_dir

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "half": torch.float16}


_INDEX_TENSOR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.index_")


def unused_index_tensor(cfg: M3Config, name: str) -> bool:
    """Whether canonical tensor `name` is an index projection or norm (or a packed part of one)
    of a sparse layer that cross-layer top-k reuse keeps from running its indexer: the checkpoint
    still holds it, the loader checks it like any tensor and then drops it."""
    m = _INDEX_TENSOR.match(name)
    return m is not None and not cfg.computes_index(int(m.group(1)))


_ATTN_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "index_q_proj": "index_q",
             "index_k_proj": "index_k"}
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def canonical_to_param(name: str) -> tuple[str, object]:
    """Canonical checkpoint name -> (serving-model parameter name, shard id)."""
    m = LAYER_NAME.match(name)
    if not m:
        return name, None
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest.startswith("self_attn."):
        sub = rest[len("self_attn."):-len(".weight")]
        if sub in _ATTN_QKV:
            return p + "self_attn.qkv_proj.weight", _ATTN_QKV[sub]
        if sub in ("index_q_norm", "index_k_norm"):
            return p + f"self_attn.indexer.{sub[len('index_'):]}.weight", None
        return name, None
    e = _EXPERT.match(rest)
    if e:
        kind = e.group(2)
        return p + ("mlp.experts.w2" if kind == "w2" else "mlp.experts.w13"), (kind, int(e.group(1)))
    for mlp in ("mlp.", "block_sparse_moe.shared_experts."):
        base = p + ("mlp." if mlp == "mlp." else "mlp.shared_experts.")
        if rest == mlp + "gate_proj.weight":
            return base + "gate_up_proj.weight", 0
        if rest == mlp + "up_proj.weight":
            return base + "gate_up_proj.weight", 1
        if rest == mlp + "down_proj.weight":
            return base + "down_proj.weight", None
    if rest == "block_sparse_moe.gate.weight":
        return p + "mlp.gate.weight", None
    if rest == "block_sparse_moe.e_score_correction_bias":
        return p + "mlp.gate.e_score_correction_bias", None
    return name, None


def resolve_dtype(dtype: str | torch.dtype, cfg: M3Config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = cfg.torch_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unsupported value {dtype!r} (auto, bfloat16, float32)")
    return DTYPES[dtype]


def load_weights(model: torch.nn.Module, cfg: M3Config, model_dir: Path, progress: bool = True,
                 scheme=None, **fill) -> None:
    """Stream every checkpoint tensor into `model`'s parameters; a tensor only another rank
    needs (another rank's experts) is checked by its shape and never read. `scheme`: the
    checkpoint's quantisation (`model/formats`), whose packed tensors arrive in their canonical
    names; `fill`: the `device` / `on_complete` arguments of `fill_parameters`."""
    from m3serve.model.formats.layouts import checkpoint_name, expected_tensors, rename

    def entries():
        for path, key, tensor in iter_checkpoint(weight_files(model_dir)):
            packed = rename(scheme, key) if scheme is not None else None
            if packed is not None:
                name, scalar = packed
                if scalar and tensor.shape == ():          # ModelOpt writes 0-d scalars
                    tensor = LazyTensor((1,), lambda t=tensor: materialize(t).reshape(1), tensor.dtype)
                pairs = [(name, tensor)]
            else:
                pairs = canonicalize(key, tensor)
            if pairs is not None:
                yield path.name, key, pairs
    expected, dtypes = expected_tensors(cfg, scheme)
    fill_parameters(model, cfg, entries(), f"checkpoint {model_dir}", progress, expected=expected,
                    dtypes=dtypes, to_param=packed_to_param,
                    describe=(lambda name: checkpoint_name(scheme, name)) if scheme else None, **fill)


_PACKED_PARTS = ("weight_block_scale", "weight_global_scale")


def packed_to_param(name: str) -> tuple[str | None, object]:
    """`canonical_to_param` for packed checkpoints too: a packed linear's scales go to the
    parameters beside its codes (`<weight param>_block_scale`, `_global_scale`); stored
    activation scales to None (checked, not kept)."""
    module, _, part = name.rpartition(".")
    if part in _PACKED_PARTS:
        pname, shard = canonical_to_param(module + ".weight")
        return pname + part[len("weight"):], shard
    if part in ("input_scale", "input_global_scale"):
        return None, None
    return canonical_to_param(name)


def dummy_weights(cfg: M3Config, seed: int, device) -> Iterator[tuple[str, str, list]]:
    """Random weights in canonical names (`--load-format dummy`), each drawn from its own seed so
    that every rank, whatever its layout, slices the same full tensors; made on `device` and
    only when a rank needs them. Scaled so activations stay finite, and the router spreads tokens
    over experts like a trained model (iid rows, zero correction bias)."""
    for index, (name, shape) in enumerate(canonical_shapes(cfg).items()):
        def make(name=name, shape=shape, index=index):
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
            if name.endswith("e_score_correction_bias"):
                return torch.zeros(shape, device=device)
            if len(shape) == 1:                              # norm offsets (Gemma: 1 + w)
                return torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)
            return torch.empty(shape, device=device).normal_(0.0, shape[-1] ** -0.5, generator=gen)
        yield "dummy", name, [(name, LazyTensor(shape, make))]


def _materialize(model: torch.nn.Module, pname: str, param: torch.nn.Parameter, device) -> torch.nn.Parameter:
    """Replace a meta-device parameter (`layers.linear.deferred_weights`) by an empty one on
    `device` that keeps its loader; returns the new parameter."""
    owner, _, attr = pname.rpartition(".")
    with torch.device(device):
        real = attach_loader(make_param(param.shape, param.dtype), param.weight_loader, param.required_shards)
    if hasattr(param, "k_div"):
        real.k_div = param.k_div
    setattr(model.get_submodule(owner), attr, real)
    return real


def fill_parameters(model: torch.nn.Module, cfg: M3Config, entries, source: str,
                    progress: bool = True, expected: dict | None = None, to_param=None,
                    device=None, on_complete=None, dtypes: dict | None = None, describe=None) -> None:
    """Copy this rank's shards of canonical tensors into `model`. `entries` yields
    (file name, original name, [(canonical name, tensor or LazyTensor)]). Every tensor of
    `expected` (default: the configuration's checkpoint tensors) must arrive exactly once with
    its expected shape, and every parameter shard must be filled, else a ValueError names the
    tensor and `source`; a tensor named in `dtypes` (packed codes and scales) must have one of
    its dtypes. The index tensors of sparse layers that reuse another layer's block selection
    are checked, then dropped (`unused_index_tensor`). `to_param` maps a canonical name to
    (parameter name, shard id); a None parameter name means the tensor is checked and dropped;
    `describe` spells a missing canonical name as the checkpoint would.
    A parameter still on the meta device gets memory on `device` when its first shard arrives;
    `on_complete(parameter name)` runs as soon as all of a parameter's shards have arrived."""
    params = dict(model.named_parameters())
    required = {name: p.required_shards for name, p in params.items()}
    expected = canonical_shapes(cfg) if expected is None else expected
    to_param = to_param or canonical_to_param
    seen: dict[str, str] = {}
    loaded: dict[str, set] = {name: set() for name in params}
    bar = tqdm(desc="Loading weights", unit="tensor") if progress else None
    for file_name, key, pairs in entries:
        for cname, t in pairs:
            where = f"tensor {key!r} in {file_name}" + (f" (as {cname})" if cname != key else "")
            if cname not in expected:
                raise ValueError(f"unexpected {where}: not part of this model's configuration")
            if cname in seen:
                raise ValueError(f"duplicate {where}: already read from {seen[cname]}")
            if tuple(t.shape) != expected[cname]:
                raise ValueError(f"wrong shape for {where}: {tuple(t.shape)}, expected {expected[cname]}")
            want = (dtypes or {}).get(cname)
            got = getattr(t, "dtype", None)
            if want and got is not None and got not in want:
                names = " or ".join(str(d).replace("torch.", "") for d in want)
                raise ValueError(f"wrong dtype for {where}: {str(got).replace('torch.', '')}, expected {names}")
            seen[cname] = file_name
            if unused_index_tensor(cfg, cname):
                continue
            pname, shard = to_param(cname)
            if pname is None:
                continue
            param = params[pname]
            if shard not in required[pname]:
                continue  # another rank's expert
            if param.is_meta:
                param = params[pname] = _materialize(model, pname, param, device)
            full = materialize(t)
            if full.dtype == torch.float8_e8m0fnu:       # E8M0 scales are kept as their bytes
                full = full.view(torch.uint8)
            try:
                param.weight_loader(param, full, shard)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            loaded[pname].add(shard)
            if on_complete is not None and loaded[pname] >= required[pname]:
                on_complete(pname)
                # the model may have replaced it (quantised): hold only what the model holds
                params[pname] = model.get_parameter(pname)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    missing = sorted(set(expected) - set(seen))
    if missing and describe is not None:
        missing = [describe(m) for m in missing]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{source} is missing tensor(s) {missing[:5]}{more}")
    for name, shards in required.items():
        if set(shards) - loaded[name]:
            raise ValueError(f"parameter {name} was not fully loaded from {source}")


def pack_model_(model: torch.nn.Module, cfg: M3Config, format_of) -> None:
    """Turn the weights `format_of(canonical module)` (a `PackedFormat` or None) says are packed into packed parameters
    (`layers/packed.py`), before loading. The checkpoint linears fused into one parameter (q, k,
    v and the index projections; gate and up; every routed expert's w1 and w3) must share one
    format, else a ValueError names them."""
    from m3serve.layers.packed import pack_param_, split_note

    from m3serve.model.formats import quantizable_modules

    sources: dict[str, dict[str, object]] = {}
    for module in quantizable_modules(cfg):
        pname, _ = canonical_to_param(module + ".weight")
        sources.setdefault(pname, {})[module] = format_of(module)
    params = dict(model.named_parameters())
    for pname, by_module in sources.items():
        fmts = set(by_module.values())
        if fmts == {None} or pname not in params:
            continue
        if len(fmts) > 1:
            detail = ", ".join(f"{m.rpartition('.')[2] if 'experts.' not in m else m.split('block_sparse_moe.')[1]}: "
                               f"{f.name if f else 'unquantised'}" for m, f in list(by_module.items())[:6])
            raise ValueError(f"the checkpoint stores the parts of one fused weight {pname} in different "
                             f"formats ({detail}); they must share one")
        fmt = fmts.pop()
        owner_name, _, attr = pname.rpartition(".")
        owner = model.get_submodule(owner_name)
        pack_param_(owner, attr, fmt, pname, split_note(owner, attr))


def load_model(model: str | Path, dtype: str | torch.dtype = "auto", parallel: ParallelInfo = ParallelInfo(),
               device: str | torch.device = "cpu", progress: bool = True, load_format: str = "auto",
               seed: int = 0, quantization: str | None = None, hf_overrides: dict | None = None):
    """Build this rank's `MiniMaxM3ForCausalLM` and load its weights. Returns (model, cfg, dir).

    load_format "dummy" reads only config.json and makes random weights on the device."""
    from m3serve.model.minimax_m3 import MiniMaxM3ForCausalLM

    from m3serve.model.config import read_config_json
    from m3serve.model.formats import detect_scheme

    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir, hf_overrides)
    if cfg.index_topk_freq > 1:
        logger.info("cross-layer top-k reuse (index_topk_freq %d, offset %d): %d of %d sparse layers run the "
                    "indexer, the others reuse its blocks (an approximation of the trained model)",
                    cfg.index_topk_freq, cfg.index_skip_topk_offset, len(cfg.index_layer_ids),
                    len(cfg.sparse_layer_ids))
    torch_dtype = resolve_dtype(dtype, cfg)
    scheme = detect_scheme(read_config_json(model_dir)) if load_format != "dummy" else None
    if scheme is not None and quantization is not None:
        raise ValueError(f"quantization={quantization!r} quantises a BF16 checkpoint online, but {model_dir} "
                         f"is already quantised ({scheme.summary}); leave it out")
    # online quantisation, weight by weight as each completes: the bf16 model never exists whole
    from m3serve.model.quantize import ONLINE_PACKED, quantize_param_packed, quantize_param_fp8
    fp8 = quantization in ("fp8", "fp8_per_channel")
    online = fp8 or quantization in ONLINE_PACKED
    with torch.device(device), (deferred_weights() if online or scheme else contextlib.nullcontext()):
        net = MiniMaxM3ForCausalLM(cfg, parallel, torch_dtype)
    if scheme is not None:
        from m3serve.model.formats.layouts import packed_format_of
        pack_model_(net, cfg, lambda module: packed_format_of(scheme, module))
    on_complete = None
    if fp8:
        def on_complete(name):
            quantize_param_fp8(net, name)
    elif quantization in ONLINE_PACKED:
        def on_complete(name):
            quantize_param_packed(net, name, ONLINE_PACKED[quantization])
    fill = {"device": torch.device(device), "on_complete": on_complete}
    if load_format == "dummy":
        fill_parameters(net, cfg, dummy_weights(cfg, seed, device), "dummy weights", progress=False, **fill)
    else:
        load_weights(net, cfg, model_dir, progress=progress, scheme=scheme, **fill)
    if online and net.lm_head.weight.is_cuda:
        torch.cuda.empty_cache()
    from m3serve.layers.packed import w8a8_note
    if note := w8a8_note(net):
        logger.info(note)
    return net.eval(), cfg, model_dir


def dummy_vision_encoder(cfg: M3Config, dtype: torch.dtype, device, seed: int = 0):
    """A vision encoder of the config's `vision_config` with random weights (`--load-format
    dummy`), scaled like `dummy_weights`: LayerNorm weights near 1, biases near 0, matrices with
    1/sqrt(fan-in) deviation; None when the config has no vision tower."""
    from m3serve.model.vision import VisionEncoder, parse_vision_config
    if cfg.vision_config is None:
        return None
    vcfg = parse_vision_config(cfg.vision_config, cfg.projector_hidden_size, cfg.hidden_size)
    with torch.device(device):
        encoder = VisionEncoder(vcfg, dtype)
    randomize_vision_(encoder, torch.Generator(device=device).manual_seed(seed * 1_000_003 + 999_983))
    return encoder.eval()


@torch.no_grad()
def randomize_vision_(encoder, gen: torch.Generator) -> None:
    """Random vision weights in place, drawn from `gen` (on the parameters' device): LayerNorm
    weights near 1, biases near 0, matrices with 1/sqrt(fan-in) deviation."""
    for name, p in encoder.named_parameters():
        if p.dim() == 1:
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.normal_(0.0, 0.02, generator=gen).add_(base)
        else:
            p.normal_(0.0, p[0].numel() ** -0.5, generator=gen)


def checkpoint_has_vision(model_dir: Path) -> bool:
    """Whether the checkpoint ships vision-tower tensors (read from the file headers only)."""
    from m3serve.model.vision import is_vision_name
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                if any(is_vision_name(k) for k in f.keys()):
                    return True
        except Exception as e:
            raise ValueError(f"corrupt safetensors file {path}: {e}") from None
    return False


def load_vision_encoder(cfg: M3Config, model_dir: Path, dtype: torch.dtype, device="cpu"):
    """The vision encoder of a checkpoint whose config has a `vision_config` and whose files have
    vision tensors, else None. Every tensor of `model.vision.vision_shapes` must be there exactly
    once with its shape (either naming); anything else under the vision prefixes is an error."""
    from m3serve.model.vision import (VisionEncoder, canonical_vision_name, is_vision_name,
                                      parse_vision_config, vision_shapes)
    if cfg.vision_config is None or not checkpoint_has_vision(model_dir):
        return None
    vcfg = parse_vision_config(cfg.vision_config, cfg.projector_hidden_size, cfg.hidden_size)
    with torch.device(device):
        encoder = VisionEncoder(vcfg, dtype)

    def entries():
        for path, key, tensor in iter_checkpoint(weight_files(model_dir)):
            if is_vision_name(key):
                yield path.name, key, [(canonical_vision_name(key), tensor)]
    fill_parameters(encoder, cfg, entries(), f"checkpoint {model_dir} (vision tower)", progress=False,
                    expected=vision_shapes(vcfg), to_param=lambda name: (name, None))
    return encoder.eval()
