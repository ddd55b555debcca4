"""MiniMax-M3's vision encoder: the CLIP-style ViT with 3-D RoPE, the per-patch projector and the
2 x 2 patch-merge MLP, from flattened patches to one text-width embedding per merge group.

Parameter names are the original checkpoint's (`vision_tower.vision_model.*`,
`multi_modal_projector.*`, `patch_merge_mlp.*`); `canonical_vision_name` maps transformers'
names onto them. The encoder is replicated on every tensor-parallel rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.layers.linear import attach_loader, replicated_loader
from m3serve.layers.rotary import apply_rotary


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    projector_hidden_size: int
    text_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2


def parse_vision_config(vision: dict, projector_hidden_size: int | None, text_hidden_size: int) -> VisionConfig:
    """`vision_config` of config.json (CLIP or transformers keys) -> VisionConfig; bad values raise
    a ValueError naming the key."""
    if not isinstance(vision, dict):
        raise ValueError(f"vision_config must be an object, got {type(vision).__name__}")

    def get(key, default=None):
        value = vision.get(key, default)
        if value is None:
            raise ValueError(f"vision_config.{key} is missing")
        return value
    rope = vision.get("rope_parameters") or {}
    theta = vision.get("rope_theta", rope.get("rope_theta", 10000.0))
    cfg = VisionConfig(
        hidden_size=int(get("hidden_size", 1280)), intermediate_size=int(get("intermediate_size", 5120)),
        num_hidden_layers=int(get("num_hidden_layers", 32)), num_attention_heads=int(get("num_attention_heads", 16)),
        projector_hidden_size=int(projector_hidden_size or 6144), text_hidden_size=int(text_hidden_size),
        patch_size=int(get("patch_size", 14)), temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)), num_channels=int(vision.get("num_channels", 3)),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)), rope_theta=float(theta))
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"vision_config.hidden_size {cfg.hidden_size} is not divisible by "
                         f"num_attention_heads {cfg.num_attention_heads}")
    if (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size, cfg.num_channels) != (14, 2, 2, 3):
        raise ValueError("vision_config: only patch_size 14, temporal_patch_size 2, spatial_merge_size 2 "
                         "and 3 channels are supported (the preprocessing is built for them)")
    return cfg


def vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tensor of a checkpoint, original name -> shape."""
    D, I, P = cfg.hidden_size, cfg.intermediate_size, cfg.projector_hidden_size
    v = "vision_tower.vision_model."
    shapes = {v + "embeddings.patch_embedding.weight":
              (D, cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
              v + "pre_layrnorm.weight": (D,), v + "pre_layrnorm.bias": (D,)}
    for i in range(cfg.num_hidden_layers):
        p = f"{v}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (D,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[p + f"self_attn.{proj}.weight"], shapes[p + f"self_attn.{proj}.bias"] = (D, D), (D,)
        shapes[p + "mlp.fc1.weight"], shapes[p + "mlp.fc1.bias"] = (I, D), (I,)
        shapes[p + "mlp.fc2.weight"], shapes[p + "mlp.fc2.bias"] = (D, I), (D,)
    merged = cfg.text_hidden_size * cfg.spatial_merge_size ** 2
    for prefix, width_in in (("multi_modal_projector.", D), ("patch_merge_mlp.", merged)):
        shapes[prefix + "linear_1.weight"], shapes[prefix + "linear_1.bias"] = (P, width_in), (P,)
        shapes[prefix + "linear_2.weight"] = (cfg.text_hidden_size, P)
        shapes[prefix + "linear_2.bias"] = (cfg.text_hidden_size,)
    return shapes


_HF_RENAMES = [
    (re.compile(r"^model\.vision_tower\.embeddings\.proj\."), "vision_tower.vision_model.embeddings.patch_embedding."),
    (re.compile(r"^model\.vision_tower\.layers\."), "vision_tower.vision_model.encoder.layers."),
    (re.compile(r"^model\.vision_tower\."), "vision_tower.vision_model."),
    (re.compile(r"^model\.multi_modal_projector\.merge_linear_"), "patch_merge_mlp.linear_"),
    (re.compile(r"^model\.multi_modal_projector\."), "multi_modal_projector."),
    (re.compile(r"^model\.(patch_merge_mlp|vision_tower\.vision_model)\."), r"\1."),
]
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.",
                   "model.vision_tower.", "model.multi_modal_projector.", "model.patch_merge_mlp.")


def is_vision_name(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def canonical_vision_name(name: str) -> str:
    """A vision tensor's name in either naming -> its original checkpoint name."""
    for pattern, repl in _HF_RENAMES:
        new, n = pattern.subn(repl, name)
        if n:
            return new
    return name


def _replicated(module: nn.Module) -> nn.Module:
    for p in module.parameters(recurse=False):
        attach_loader(p, replicated_loader, [None])
        p.requires_grad_(False)
    return module


def _linear(n_in: int, n_out: int, dtype) -> nn.Linear:
    return _replicated(nn.Linear(n_in, n_out, bias=True, dtype=dtype))


def _layer_norm(width: int, eps: float, dtype) -> nn.LayerNorm:
    return _replicated(nn.LayerNorm(width, eps=eps, dtype=dtype))


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype):
        super().__init__()
        D = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj, self.k_proj = _linear(D, D, dtype), _linear(D, D, dtype)
        self.v_proj, self.out_proj = _linear(D, D, dtype), _linear(D, D, dtype)
        self._qkv: tuple[torch.Tensor, torch.Tensor] | None = None     # ([3D, D], [3D]) behind q/k/v

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One [3D, D] weight (and [3D] bias) whose thirds are q_proj's, k_proj's and v_proj's own
        storage, so the three products run as one and a later load or copy into the parameters
        updates it; built again if the parameters were replaced (moved to another device)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self._qkv is None or self.q_proj.weight.data_ptr() != self._qkv[0].data_ptr() or \
                self.v_proj.bias.data_ptr() != self._qkv[1][2 * self.q_proj.bias.numel():].data_ptr():
            weight = torch.cat([p.weight.data for p in projections])
            bias = torch.cat([p.bias.data for p in projections])
            for i, p in enumerate(projections):
                rows = slice(i * p.weight.shape[0], (i + 1) * p.weight.shape[0])
                p.weight.data, p.bias.data = weight[rows], bias[rows]
            self._qkv = (weight, bias)
        return self._qkv

    def forward(self, x, cos, sin, seqlens: list[int], cu_seqlens: torch.Tensor | None = None):
        """cu_seqlens [segments + 1] int32 on x's device: the variable-length flash path (see
        `_use_varlen`); None: the per-size SDPA calls."""
        n = x.shape[0]
        qkv = F.linear(x, *self._fused_qkv())                                      # [n, 3D]
        if cu_seqlens is not None:
            from m3serve.kernels.vision_rope import vision_qkv_rope
            q, k, v = vision_qkv_rope(qkv, cos, sin, self.num_heads)                # [n, heads, hd] each
            longest = max(seqlens)
            o = _varlen_attn()(q, k, v, cu_seqlens, cu_seqlens, longest, longest)   # [n, heads, hd]
            return self.out_proj(o.reshape(n, -1))
        qkv = qkv.view(n, 3, self.num_heads, self.head_dim)
        q, k = apply_rotary(qkv[:, 0], cos, sin), apply_rotary(qkv[:, 1], cos, sin)
        v = qkv[:, 2]
        outs, start = [], 0
        for length, count in _runs(seqlens):
            # bidirectional attention inside each image / segment; equal lengths in one batched
            # call of 4-D inputs [segments, heads, length, head_dim] (3-D inputs get no fused kernel)
            sl = slice(start, start + length * count)
            batch = [t[sl].view(count, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*batch)                              # [count, heads, length, hd]
            outs.append(o.transpose(1, 2).reshape(length * count, -1))
            start += length * count
        return self.out_proj(torch.cat(outs) if len(outs) > 1 else outs[0])


def _varlen_attn():
    """torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`), or
    None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _use_varlen(x: torch.Tensor) -> bool:
    """On a CUDA device in half precision: the qkv split and RoPE in one Triton launch
    (`kernels.vision_rope`), then one flash call over every image of the forward (no padding, no
    per-size loop); `M3SERVE_VISION_ATTENTION=runs` keeps the torch ops and per-size SDPA calls
    (the CPU and float32 path) for comparison."""
    from m3serve import envs
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and envs.VISION_ATTENTION != "runs"
            and _varlen_attn() is not None)


def _runs(seqlens: list[int]) -> list[tuple[int, int]]:
    """Consecutive equal lengths as (length, count): [4, 4, 4, 9] -> [(4, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for length in seqlens:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype):
        super().__init__()
        self.fc1 = _linear(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.fc2 = _linear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype):
        super().__init__()
        self.layer_norm1 = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.self_attn = _Attention(cfg, dtype)
        self.layer_norm2 = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = _MLP(cfg, dtype)

    def forward(self, x, cos, sin, seqlens, cu_seqlens=None):
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, seqlens, cu_seqlens)
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        # fp32 as in the checkpoint: the patch convolution sees raw normalised pixels
        self.patch_embedding = _replicated(nn.Conv3d(
            cfg.num_channels, cfg.hidden_size, kernel_size=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
            stride=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size), bias=False, dtype=torch.float32))
        self.cfg = cfg

    def forward(self, pixels):
        c = self.cfg
        x = pixels.view(-1, c.num_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        # a Conv3d whose kernel equals its input is one matrix product per patch
        w = self.patch_embedding.weight.reshape(c.hidden_size, -1)
        return x.reshape(x.shape[0], -1).to(w.dtype) @ w.t()


class _VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype):
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.pre_layrnorm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_EncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))


class _VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype):
        super().__init__()
        self.vision_model = _VisionModel(cfg, dtype)


class _TwoLayerMLP(nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int, dtype):
        super().__init__()
        self.linear_1, self.linear_2 = _linear(n_in, hidden, dtype), _linear(hidden, n_out, dtype)

    def forward(self, x):
        return self.linear_2(F.gelu(self.linear_1(x)))


def rope_inv_freq(cfg: VisionConfig) -> torch.Tensor:
    """Frequencies of one axis: 2 * floor(head_dim / 6) channels (13 frequencies at head 80)."""
    axis_dim = 2 * ((cfg.head_dim // 3) // 2)
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32) / axis_dim))


def position_ids(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[num_patches, 3] (t, h, w) of each patch in the tower's order: merge groups row-major,
    patches row-major inside a group; t restarts at 0 in every grid (segment)."""
    out = []
    for t, h, w in grids:
        hh = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        ww = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hh = hh.permute(0, 2, 1, 3).reshape(-1)
        ww = ww.permute(0, 2, 1, 3).reshape(-1)
        tt = torch.arange(t).repeat_interleave(h * w)
        out.append(torch.stack([tt, hh.repeat(t), ww.repeat(t)], dim=-1))
    return torch.cat(out)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype):
    """pos [N, 3] -> cos, sin [N, 3 * len(inv_freq)]: the (t, h, w) frequency bands, for
    `layers.rotary.apply_rotary` (NeoX halves; channels past 2 x that width pass through)."""
    freqs = (pos[..., None].float() * inv_freq.to(pos.device)).flatten(1)      # [N, 3 * F]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


class VisionEncoder(nn.Module):
    """`forward(pixel_values [num_patches, 1176], grids [(t, h, w), ...]) -> [num_patches / 4,
    text_hidden]`: patch embedding, pre-LayerNorm, the encoder layers with attention inside each
    grid (one image, or one video segment), no post-norm; then the projector per patch and the
    merge MLP over each 2 x 2 group of consecutive patches."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.vision_tower = _VisionTower(cfg, dtype)
        self.multi_modal_projector = _TwoLayerMLP(cfg.hidden_size, cfg.projector_hidden_size,
                                                  cfg.text_hidden_size, dtype)
        self.patch_merge_mlp = _TwoLayerMLP(cfg.text_hidden_size * cfg.spatial_merge_size ** 2,
                                            cfg.projector_hidden_size, cfg.text_hidden_size, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        vm = self.vision_tower.vision_model
        merge = self.cfg.spatial_merge_size
        device = self.inv_freq.device
        x = vm.embeddings(pixel_values.to(device)).to(self.dtype)                  # [N, D]
        pos = position_ids(grids, merge).to(device)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        seqlens = [t * h * w for t, h, w in grids]
        x = vm.pre_layrnorm(x)
        cu = None
        if _use_varlen(x):          # one host-to-device copy of the segment bounds per forward
            cu = torch.tensor([0] + seqlens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        for layer in vm.encoder.layers:
            x = layer(x, cos, sin, seqlens, cu)
        x = self.multi_modal_projector(x)                                           # [N, H]
        x = x.reshape(x.shape[0] // merge ** 2, -1)                                 # [N / 4, 4H]
        return self.patch_merge_mlp(x)                                              # [N / 4, H]
