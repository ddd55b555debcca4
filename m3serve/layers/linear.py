"""Linear layers that know their tensor-parallel rank and load only their shard.

Every weight `Parameter` carries `weight_loader(param, full, shard_id)`, which checks the full
checkpoint tensor's shape against what that shard expects and copies this rank's slice, and
`required_shards`, the shard ids that must all arrive for the weight to be complete. The loader
uses both to name missing, unexpected and mis-shaped tensors.
Column-parallel layers split output rows; row-parallel layers split input columns and all-reduce.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.distributed import GroupInfo
from m3serve.layers.dispatch import use_triton
from m3serve.layers.packed import is_row_scale, packed_format, packed_linear, row_fill


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T in x's dtype.

    On CPU (the reference backend) it accumulates in fp64 and rounds once: BLAS picks different
    kernels for different row counts, so an fp32 product of one row would depend on how many rows
    share the batch. Rounded from fp64, a row's result is the same however the batch is cut, which
    makes chunked prefill, prefix-cache hits and batching bit-identical to a one-shot run.
    On the GPU, decode-sized products (`skinny_eligible`: <= 8 rows, both weight dimensions
    >= 4096) use the Triton skinny GEMM (`kernels/gemv.py`), which reads the weight as fast as
    cuBLAS or faster at the measured shapes; the rest use cuBLAS.
    """
    if x.device.type == "cpu":
        return F.linear(x.double(), weight.double()).to(x.dtype)
    from m3serve.kernels.gemv import skinny_eligible, skinny_linear
    if skinny_eligible(x, weight) and use_triton("skinny_gemm", x):
        return skinny_linear(x, weight)
    return F.linear(x, weight)


def apply_linear(module: nn.Module, x: torch.Tensor, x_quant: tuple | None = None) -> torch.Tensor:
    """A linear layer's forward: packed codes (`layers/packed.py`), FP8 GEMM once quantised
    online (`layers/quant.py`; `x_quant`: x's per-token FP8 form when the caller has it), else
    `linear`."""
    if packed_format(module, "weight") is not None:
        return packed_linear(x, module)
    scale = getattr(module, "weight_scale", None)
    if scale is not None:
        from m3serve.layers.quant import fp8_linear
        return fp8_linear(x, module.weight, scale, x_quant)
    return linear(x, module.weight)


def takes_fp8_input(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `apply_linear(module, x)` quantises x per token for an online-FP8 GEMM on the GPU
    (a norm before it can then make that form: `x_quant`)."""
    return (x.is_cuda and getattr(module, "weight_scale", None) is not None
            and packed_format(module, "weight") is None and use_triton("rms_norm", x))


def attach_loader(param: nn.Parameter, loader, required_shards) -> nn.Parameter:
    param.weight_loader = loader
    param.required_shards = frozenset(required_shards)
    return param


def check_shape(full: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(full.shape) != tuple(expected):
        raise ValueError(f"shape mismatch for {what}: checkpoint has {tuple(full.shape)}, "
                         f"model expects {tuple(expected)}")


def replicated_loader(param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
    if is_row_scale(param):
        param.data.fill_(row_fill(param, full, "replicated weight"))
        return
    check_shape(full, param.shape, "replicated weight")
    param.data.copy_(full)


_deferring = False


@contextlib.contextmanager
def deferred_weights():
    """Inside, the weights online FP8 quantises (`make_param(..., quantizable=True)`: linear
    layers and routed experts) are made on the meta device. The loader gives each real memory
    when its first shard arrives and quantises it once complete, so a model whose bf16 weights
    would not fit the device still loads in FP8 (model/loader.py)."""
    global _deferring
    before, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = before


def make_param(shape, dtype, quantizable: bool = False) -> nn.Parameter:
    device = "meta" if quantizable and _deferring else None
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def kv_head_range(num_kv_heads: int, tp: GroupInfo) -> tuple[int, int]:
    """KV (and index-query) heads owned by this rank: split when TP <= heads, else replicated."""
    if tp.size <= num_kv_heads:
        if num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} not divisible by TP={tp.size}")
        n = num_kv_heads // tp.size
        return tp.rank * n, n
    if tp.size % num_kv_heads:
        raise ValueError(f"TP={tp.size} not a multiple of num_key_value_heads={num_kv_heads}")
    return tp.rank // (tp.size // num_kv_heads), 1


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = attach_loader(make_param((out_features, in_features), dtype, True),
                                    replicated_loader, [None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(self, x)


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel outputs in one GEMM, e.g. gate|up. Local layout: [s0 | s1 | ...],
    each section this rank's slice (rows) of the corresponding full weight."""

    def __init__(self, in_features: int, output_sizes: list[int], tp: GroupInfo, dtype: torch.dtype):
        super().__init__()
        for n in output_sizes:
            if n % tp.size:
                raise ValueError(f"output size {n} not divisible by TP={tp.size}")
        self.tp = tp
        self.full_sizes = list(output_sizes)
        self.local_sizes = [n // tp.size for n in output_sizes]
        self.weight = attach_loader(make_param((sum(self.local_sizes), in_features), dtype, True),
                                    self._load, range(len(output_sizes)))

    def _load(self, param, full: torch.Tensor, shard_id: int) -> None:
        n = self.local_sizes[shard_id]
        start = sum(self.local_sizes[:shard_id])
        if is_row_scale(param):
            param.data[start:start + n] = row_fill(param, full, f"section {shard_id}")
            return
        check_shape(full, (self.full_sizes[shard_id], param.shape[1]), f"section {shard_id}")
        param.data[start:start + n].copy_(full[self.tp.rank * n:(self.tp.rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(self, x)


class QKVParallelLinear(nn.Module):
    """Fused [q | k | v | index_q | index_k] projection (index parts only on sparse layers).

    q heads split over ranks; k, v and index_q heads split like KV heads (replicated when
    TP > num_kv_heads); the single index-key head is replicated on every rank.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: GroupInfo,
                 dtype: torch.dtype, index_heads: int = 0, index_dim: int = 0):
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads={num_heads} not divisible by TP={tp.size}")
        self.tp = tp
        kv_start, kv_n = kv_head_range(num_kv_heads, tp)
        q_n = num_heads // tp.size
        # shard id -> (full rows, first local head, local heads, head size)
        self.sections = {"q": (num_heads * head_dim, tp.rank * q_n, q_n, head_dim),
                         "k": (num_kv_heads * head_dim, kv_start, kv_n, head_dim),
                         "v": (num_kv_heads * head_dim, kv_start, kv_n, head_dim)}
        if index_heads:
            i_start, i_n = kv_head_range(index_heads, tp)
            self.sections["index_q"] = (index_heads * index_dim, i_start, i_n, index_dim)
            self.sections["index_k"] = (index_dim, 0, 1, index_dim)
        self.output_sizes = [n * size for _, _, n, size in self.sections.values()]
        self.offsets = {}
        off = 0
        for name, out in zip(self.sections, self.output_sizes):
            self.offsets[name] = off
            off += out
        self.weight = attach_loader(make_param((off, hidden), dtype, True), self._load, self.sections)

    def _load(self, param, full: torch.Tensor, shard_id: str) -> None:
        rows, first, n, size = self.sections[shard_id]
        off = self.offsets[shard_id]
        if is_row_scale(param):
            param.data[off:off + n * size] = row_fill(param, full, f"{shard_id} projection")
            return
        check_shape(full, (rows, param.shape[1]), f"{shard_id} projection")
        param.data[off:off + n * size].copy_(full[first * size:(first + n) * size])

    def forward(self, x: torch.Tensor, x_quant: tuple | None = None) -> list[torch.Tensor]:
        """x: [T, hidden] -> one tensor per section, [T, local_heads * size] each (`x_quant`: see
        `apply_linear`)."""
        return list(apply_linear(self, x, x_quant).split(self.output_sizes, dim=-1))


class RowParallelLinear(nn.Module):
    """Input columns split over ranks; the partial products are summed with an all-reduce
    (skipped when `reduce_results=False`, so a caller can fuse several partial sums into one)."""

    def __init__(self, in_features: int, out_features: int, tp: GroupInfo, dtype: torch.dtype,
                 reduce_results: bool = True):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} not divisible by TP={tp.size}")
        self.tp = tp
        self.reduce_results = reduce_results
        self.in_local = in_features // tp.size
        self.weight = attach_loader(make_param((out_features, self.in_local), dtype, True),
                                    self._load, [None])

    def _load(self, param, full: torch.Tensor, shard_id=None) -> None:
        if is_row_scale(param):
            param.data.fill_(row_fill(param, full, "row-parallel weight"))
            return
        k = param.shape[1]           # this rank's columns: of the weight, its codes or its scales
        check_shape(full, (param.shape[0], k * self.tp.size), "row-parallel weight")
        r = self.tp.rank
        param.data.copy_(full[:, r * k:(r + 1) * k])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = apply_linear(self, x)
        return self.tp.all_reduce(y) if self.reduce_results else y
