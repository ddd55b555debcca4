"""Micro-benchmark of the Triton MSA indexer on a GPU at MiniMax-M3 shapes (4 index heads, Di 128,
one shared index key head, 128-token blocks, top-16): decode at batch 1/8/64 over 8K/32K/128K
contexts (and 1M at batch 1), bf16 or fp8 index cache, plus an 8K-token prefill chunk. Prints the
scoring stage alone and scoring + top-k eagerly (host launch overhead included), and scoring +
top-k replayed from a CUDA graph (GPU time, what the engine's decode graphs see), as index-key
bytes read -> TB/s vs the H200's 4.19 TB/s. Decode rows also run with a graph-style loose bound
(max_seq_len = 1M) to show that the work follows the real context.

Run: python -m m3serve.bench.kernels.indexer [--fp8]
"""
from __future__ import annotations

import argparse

import torch

from m3serve.bench.kernels import graph_ms
from m3serve.bench.roofline import HBM_READ_TBPS

HI, DI, BS, TOPK = 4, 128, 128, 16
DECODE = [(b, c) for c in (8192, 32768, 131072) for b in (1, 8, 64)] + [(1, 1 << 20)]


def _inputs(batch: int, ctx: int, q_len: int, fp8: bool, bound: int | None = None):
    nb = -(-ctx // BS)
    cache = torch.randn(batch * nb, BS, DI, device="cuda", dtype=torch.bfloat16)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    width = -(-(bound or ctx) // BS)
    tables = torch.zeros(batch, width, device="cuda", dtype=torch.int32)
    tables[:, :nb] = torch.randperm(batch * nb, device="cuda").view(batch, nb).int()
    iq = torch.randn(batch * q_len, HI, DI, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    seq = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return dict(iq=iq, index_cache=cache, query_start_loc=qsl, seq_lens=seq, block_tables=tables,
                block_size=BS, max_seq_len=bound or ctx, max_query_len=q_len)


def _row(name: str, ms_score: float, ms_all: float, ms_graph: float, nbytes: int) -> None:
    tbs = nbytes / (ms_graph * 1e-3) / 1e12
    print(f"{name:<30} eager score {ms_score * 1e3:7.1f} us  score+topk {ms_all * 1e3:7.1f} us"
          f"   graph score+topk {ms_graph * 1e3:7.1f} us  {tbs:5.2f} TB/s "
          f"({tbs / HBM_READ_TBPS:5.1%})")


def main() -> None:
    import triton.testing

    from m3serve.kernels.indexer import index_block_scores, index_topk
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fp8", action="store_true", help="float8_e4m3fn index cache")
    args = ap.parse_args()
    elem = 1 if args.fp8 else 2
    kw = dict(local_blocks=1)
    print(f"index cache {'fp8' if args.fp8 else 'bf16'}; bytes = index keys read (one per token)")
    cases = [(b, c, None) for b, c in DECODE] + [(1, 8192, 1 << 20), (64, 8192, 1 << 20)]
    for batch, ctx, bound in cases:
        x = _inputs(batch, ctx, 1, args.fp8, bound)
        ms_s = triton.testing.do_bench(lambda x=x: index_block_scores(**x, **kw))
        ms_a = triton.testing.do_bench(lambda x=x: index_topk(**x, topk=TOPK, **kw))
        ms_g = graph_ms(lambda x=x: index_topk(**x, topk=TOPK, **kw))
        name = f"decode b={batch} ctx={ctx}" + (" bound=1M" if bound else "")
        _row(name, ms_s, ms_a, ms_g, batch * ctx * DI * elem)
    # prefill: one 8K chunk at the end of a 32K context; each query tile re-reads its keys, so
    # the byte count (keys read once) is a lower bound: report TFLOP/s of the causal scoring too
    x = _inputs(1, 32768, 8192, args.fp8)
    ms_s = triton.testing.do_bench(lambda: index_block_scores(**x, **kw))
    ms_a = triton.testing.do_bench(lambda: index_topk(**x, topk=TOPK, **kw))
    ms_g = graph_ms(lambda: index_topk(**x, topk=TOPK, **kw))
    _row("prefill 8K of 32K", ms_s, ms_a, ms_g, 32768 * DI * elem)
    flops = 2 * HI * DI * 8192 * (32768 - 8192 / 2)
    print(f"{'':<30} {flops / (ms_s * 1e-3) / 1e12:.1f} TFLOP/s of causal scoring (eager)")


if __name__ == "__main__":
    main()
