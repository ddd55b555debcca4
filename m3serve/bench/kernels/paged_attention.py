"""Micro-benchmark of the Triton paged attention kernel on a GPU at MiniMax-M3 shapes (64 q heads,
4 KV heads, head_dim 128, 128-token pages): dense and sparse (top-16) decode over batch sizes, and
8K-token prefill. Prints time, K/V bytes actually read as TB/s vs the H200's 4.19 TB/s, and TFLOP/s.

Run: python -m m3serve.bench.kernels.paged_attention [--fp8] [--ctx 8192] [--batches 1 8 32 64 128]
"""
from __future__ import annotations

import argparse

import torch

from m3serve.bench.roofline import BF16_TFLOPS, HBM_READ_TBPS

H, G, D, BS, TOPK = 64, 4, 128, 128, 16


def _cache(num_pages: int, fp8: bool, device: str):
    kv = torch.randn(2, num_pages, BS, G, D, device=device, dtype=torch.bfloat16)
    if not fp8:
        return kv, None, None, 2
    scale = torch.tensor([0.05], device=device)
    return (kv / scale).to(torch.float8_e4m3fn), scale, scale.clone(), 1


def _decode_inputs(batch: int, ctx: int, sparse: bool, fp8: bool, device: str):
    nb = -(-ctx // BS)
    kv, ks, vs, elem = _cache(batch * nb, fp8, device)
    tables = torch.randperm(batch * nb, device=device).view(batch, nb).int()
    ids = None
    blocks_read = nb
    if sparse:  # own (last) block plus TOPK-1 random earlier ones per token and group
        earlier = torch.rand(batch, G, nb - 1, device=device).argsort(-1)[..., :TOPK - 1]
        own = torch.full((batch, G, 1), nb - 1, device=device)
        ids = torch.cat([own, earlier], -1).int()
        blocks_read = min(TOPK, nb)
    kwargs = dict(
        q=torch.randn(batch, H, D, device=device, dtype=torch.bfloat16), kv_cache=kv,
        query_start_loc=torch.arange(batch + 1, device=device, dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx, device=device, dtype=torch.int32), block_tables=tables,
        scale=D ** -0.5, block_ids=ids, max_query_len=1, max_seq_len=ctx, k_scale=ks, v_scale=vs)
    kv_bytes = batch * G * blocks_read * BS * D * 2 * elem
    flops = 4 * batch * H * D * (blocks_read * BS if sparse else ctx)
    return kwargs, kv_bytes, flops


def _prefill_inputs(n: int, sparse: bool, fp8: bool, device: str):
    nb = -(-n // BS)
    kv, ks, vs, elem = _cache(nb, fp8, device)
    pos = torch.arange(n, device=device)
    own = pos // BS
    ids = None
    if sparse:  # own block forced, TOPK-1 random causal earlier blocks, -1 where too few exist
        score = torch.rand(n, G, nb, device=device)
        blocks = torch.arange(nb, device=device)
        score = score.masked_fill(blocks[None, None, :] > own[:, None, None], -1.0)
        score = score.masked_fill(blocks[None, None, :] == own[:, None, None], 2.0)
        top, idx = score.topk(min(TOPK, nb), -1)
        ids = torch.where(top >= 0, idx, -1).int()                          # [n, G, topk]
        valid = (ids >= 0).sum(-1)                                           # [n, G]
        pairs = ((valid - 1) * BS + (pos % BS + 1)[:, None]).sum().item()
        kv_bytes = valid.sum().item() * BS * D * 2 * elem
        flops = 4 * D * (H // G) * pairs
    else:
        kv_bytes = n * G * D * 2 * elem   # unique bytes; tiles re-read from L2 are not counted
        flops = 4 * D * H * n * (n + 1) // 2
    kwargs = dict(
        q=torch.randn(n, H, D, device=device, dtype=torch.bfloat16), kv_cache=kv,
        query_start_loc=torch.tensor([0, n], device=device, dtype=torch.int32),
        seq_lens=torch.tensor([n], device=device, dtype=torch.int32),
        block_tables=torch.randperm(nb, device=device).view(1, nb).int(),
        scale=D ** -0.5, block_ids=ids, max_query_len=n, max_seq_len=n, k_scale=ks, v_scale=vs)
    return kwargs, kv_bytes, flops


def _report(name: str, kwargs: dict, kv_bytes: int, flops: int) -> None:
    import triton.testing

    from m3serve.kernels.paged_attention import paged_attention
    out = torch.empty_like(kwargs["q"])
    ms = triton.testing.do_bench(lambda: paged_attention(**kwargs, out=out), warmup=25, rep=100)
    tbs = kv_bytes / ms / 1e9
    tflops = flops / ms / 1e9
    print(f"{name:<34} {ms * 1e3:9.1f} us  {tbs:6.2f} TB/s ({100 * tbs / HBM_READ_TBPS:5.1f}% of "
          f"{HBM_READ_TBPS})  {tflops:7.1f} TFLOP/s ({100 * tflops / BF16_TFLOPS:4.1f}%)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--fp8", action="store_true", help="float8_e4m3fn K/V cache")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    kv = "fp8" if args.fp8 else "bf16"
    for sparse in (False, True):
        for b in args.batches:
            tag = f"decode {'sparse' if sparse else 'dense'} {kv} b={b} ctx={args.ctx}"
            _report(tag, *_decode_inputs(b, args.ctx, sparse, args.fp8, "cuda"))
    for sparse in (False, True):
        tag = f"prefill {'sparse' if sparse else 'dense'} {kv} n={args.prefill}"
        _report(tag, *_prefill_inputs(args.prefill, sparse, args.fp8, "cuda"))


if __name__ == "__main__":
    main()
