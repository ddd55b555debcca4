"""Decode-shape kernel choices at the real MiniMax-M3 shapes, timed by CUDA-graph replay (µs):
  gemv   cuBLAS (F.linear) against the Triton skinny GEMM of m3serve/kernels/gemv.py, per shape
         and token count, with the bandwidth each reaches (gemv_sweep: and the best tiles);
  attn   the paged decode attention's split heuristic (_MIN_KEYS_PER_SPLIT), dense and sparse;
  route  the router against the torch ops it replaces (1-256 tokens), and its partial-logit
         tiles (K step, K steps per program, split cap) where it runs (1-32 tokens);
  prefill_attn / prefill_moe  the prefill attention and the fused MoE at prompt sizes, by tile;
  moe    the fused MoE's decode tile table against alternatives (both GEMMs, 4 routed + shared);
  mid_moe  the fused MoE at mixed-step sizes (575-2111 tokens), by tile, one GEMM at a time;
  moe_bounds  the fused MoE's regime configs side by side at 448-4223 tokens;
  prefill_moe_kernels  the fused MoE's prefill time by kernel (profiler), with each GEMM's TFLOP/s;
  moe_tma  the fused MoE at prefill sizes: atomic against store-and-sum, tensor-descriptor
         (TMA) weight tiles, the shared expert by cuBLAS beside the grouped GEMMs;
  moe_tma_regimes  the same choices for FP8 weights and at mixed-step sizes;
  grouped_mm  torch's grouped GEMMs (sort, gather, two grouped GEMMs, SwiGLU, weighted sum)
         against the fused MoE at prefill sizes, bf16 and fp8, each stage timed;
  small  the embedding gather, the residual-add RMSNorm and the indexer's top-k by warps;
  sample the top-p / top-k cut-offs (radix kernels against sorting) and a whole sampled step;
  rank_moe / rank_gemv  the fused MoE's and the projections' tiles at one TP 8 / TP 4 rank's
         widths (decode rows), against the tables and cuBLAS;
  rank_packed  the same for packed (MXFP4 / MXFP8) weights;
  prefill_w8a8  MXFP8 at prefill: W8A16 (packed_matmul) against W8A8 (per-token FP8 activations,
         kernels/mxfp8_w8a8.py, quantisation counted) at one TP 8 rank's dense shapes, 512-8192
         rows, by tile, with each path's error; JSON to $OUT/prefill_w8a8.json when $OUT is set.
`PYTHONPATH=. python scripts/decode_kernels_bench.py [gemv|gemv_sweep] [attn] [route] [route_prefill] [moe] [prefill_attn] [prefill_moe] [mid_moe] [moe_bounds] [moe_bounds_fp8] [prefill_moe_kernels] [moe_tma] [moe_tma_regimes] [grouped_mm] [small] [sample] [rank_packed] [prefill_w8a8]`"""
import os
import sys
import time

import torch
import triton
import torch.nn.functional as F

TBPS = 4.19e12


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def gemv(sweep: bool = False) -> None:
    shapes = {"qkv (sparse)": (9856, 6144), "o_proj": (6144, 8192), "dense gate_up": (24576, 6144),
              "dense down": (6144, 12288), "lm_head": (200064, 6144)}
    try:
        from m3serve.kernels.gemv import skinny_linear
    except ImportError:
        skinny_linear = None
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ideal = (n * k + m * k + m * n) * 2 / TBPS * 1e6
            t = bench(lambda: F.linear(x, w))
            line = f"gemv {name:14s} M={m}: cuBLAS {t:7.1f} us ({ideal / t:4.0%})"
            if skinny_linear is not None:
                ref = F.linear(x.float(), w.float())
                err = (skinny_linear(x, w).float() - ref).abs().max().item()
                t2 = bench(lambda: skinny_linear(x, w))
                line += f", triton {t2:7.1f} us ({ideal / t2:4.0%}), max err {err:.3g}"
                if sweep and m in (1, 8):
                    res = []
                    for bn in (32, 64, 128):
                        for bk in (128, 256):
                            for st in (3, 4, 5):
                                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": st}
                                try:
                                    res.append((bench(lambda: skinny_linear(x, w, cfg)), f"n{bn} k{bk} st{st}"))
                                except triton.runtime.errors.OutOfResources:
                                    pass
                    res.sort()
                    line += "; best " + ", ".join(f"{c} {t:.1f}" for t, c in res[:4])
            print(line, flush=True)


def gemv_sweep() -> None:
    gemv(sweep=True)


def attn() -> None:
    import m3serve.kernels.paged_attention as pa
    bs, G, H, D = 128, 4, 64, 128
    saved = pa._MIN_KEYS_PER_SPLIT, pa._MIN_KEYS_PER_SPLIT_SPARSE
    for T, ctx in ((1, 1024), (8, 1024), (4, 8192), (1, 8192)):
        blocks = -(-ctx // bs)
        kv = torch.randn(2, T * blocks + 1, bs, G, D, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        qsl = torch.arange(T + 1, device="cuda", dtype=torch.int32)
        seq = torch.full((T,), ctx, device="cuda", dtype=torch.int32)
        tables = torch.arange(T * blocks, device="cuda", dtype=torch.int32).view(T, blocks)
        sel = torch.full((T, G, 16), -1, device="cuda", dtype=torch.int32)
        nsel = min(16, blocks)
        sel[:, :, :nsel] = torch.arange(blocks - nsel, blocks, device="cuda", dtype=torch.int32)
        for sparse in (False, True):
            row = []
            for keys in (64, 128, 256, 512):
                pa._MIN_KEYS_PER_SPLIT = pa._MIN_KEYS_PER_SPLIT_SPARSE = keys
                fn = lambda: pa.paged_attention(q, kv, qsl, seq, tables, 0.088, block_ids=sel if sparse else None,
                                                max_query_len=1, max_seq_len=9472)
                row.append(f"{keys}: {bench(fn):5.1f}")
            print(f"attn T={T} ctx={ctx} {'sparse' if sparse else 'dense '} keys/split -> us  " + "  ".join(row),
                  flush=True)
    pa._MIN_KEYS_PER_SPLIT, pa._MIN_KEYS_PER_SPLIT_SPARSE = saved


def route() -> None:
    import m3serve.kernels.fused_moe as fm
    from m3serve.layers.moe import route as torch_route
    gate = torch.randn(128, 6144, device="cuda") * 6144 ** -0.5
    bias = torch.randn(128, device="cuda") * 0.05
    for t in (1, 2, 4, 8, 16, 32, 64, 256):
        x = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16)
        default = bench(lambda: fm.moe_route(x, gate, bias, 4, 2.0))
        line = f"route T={t}: moe_route {default:.1f} us, torch ops {bench(lambda: torch_route(x, gate, bias, 4, 2.0)):.1f} us"
        if t > fm.ROUTE_FUSED_MAX_TOKENS:                  # moe_route runs the torch ops itself
            print(line, flush=True)
            continue
        row = []
        saved = fm.ROUTE_BLOCK_K, fm.ROUTE_ITERS, fm.ROUTE_MAX_SPLITS
        for block_k in (32, 64, 128):
            for iters in (1, 2, 4, 8):
                for cap in (16, 48):
                    fm.ROUTE_BLOCK_K, fm.ROUTE_ITERS, fm.ROUTE_MAX_SPLITS = block_k, iters, cap
                    row.append((bench(lambda: fm.moe_route(x, gate, bias, 4, 2.0)), f"k{block_k} it{iters} cap{cap}"))
        fm.ROUTE_BLOCK_K, fm.ROUTE_ITERS, fm.ROUTE_MAX_SPLITS = saved
        row.sort()
        print(line + "; best tiles " + ", ".join(f"{n} {v:.1f}" for v, n in row[:5]), flush=True)


def route_prefill() -> None:
    """The router of more than 32 bf16 tokens (128 experts x 6144): tensor-core logits (the fp32
    gate split into three bf16 parts) + the top-k kernel, against torch's fp32 GEMM route, with
    the ROUTE_TC tiles and hidden-dimension splits swept; and how many tokens' experts differ
    from torch's."""
    import m3serve.kernels.fused_moe as fm
    from m3serve import envs
    from m3serve.layers.moe import route as torch_route
    gate = torch.randn(128, 6144, device="cuda") * 6144 ** -0.5
    bias = torch.randn(128, device="cuda") * 0.05
    switches = envs.ROUTE_TENSOR_CORES, fm.ROUTE_TC_MIN_TOKENS
    for t in (33, 64, 128, 256, 1024, 4096, 16384):
        x = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16)
        envs.ROUTE_TENSOR_CORES = False
        ref = _prefill_time(lambda: fm.moe_route(x, gate, bias, 4, 2.0))
        ref_w, ref_ids = torch_route(x, gate, bias, 4, 2.0)
        envs.ROUTE_TENSOR_CORES, fm.ROUTE_TC_MIN_TOKENS = True, 0      # the kernel at every size
        tc = _prefill_time(lambda: fm.moe_route(x, gate, bias, 4, 2.0))
        w, ids = fm.moe_route(x, gate, bias, 4, 2.0)
        differ = (ids.long().sort(-1).values != ref_ids.sort(-1).values).any(-1).sum().item()
        rows, saved = [], (fm.ROUTE_TC_BLOCK_T, fm.ROUTE_TC_BLOCK_K, fm.ROUTE_TC_SPLITS)
        for bt in (64, 128):
            for bk in (32, 64):
                for sp in (1, 4, 12, 48):
                    fm.ROUTE_TC_BLOCK_T, fm.ROUTE_TC_BLOCK_K, fm.ROUTE_TC_SPLITS = bt, bk, sp
                    rows.append((_prefill_time(lambda: fm.moe_route(x, gate, bias, 4, 2.0)), f"t{bt} k{bk} s{sp}"))
        fm.ROUTE_TC_BLOCK_T, fm.ROUTE_TC_BLOCK_K, fm.ROUTE_TC_SPLITS = saved
        rows.sort()
        print(f"route T={t}: torch fp32 {ref:.1f} us, tensor cores {tc:.1f} us (tokens whose experts differ: "
              f"{differ}, max |dw| {(w - ref_w).abs().max().item():.2e}); best tiles " +
              ", ".join(f"{n} {v:.1f}" for v, n in rows[:6]), flush=True)
    envs.ROUTE_TENSOR_CORES, fm.ROUTE_TC_MIN_TOKENS = switches


def route_align() -> None:
    """Router + top-k + MoE alignment at decode sizes (128 experts, top 4 + the shared expert,
    BLOCK_M 16): `moe_route` then `moe_align` (two launches) against `moe_route_align` (one),
    and the whole MoE (narrow TP 8 rank experts, I = 384) each way."""
    import m3serve.kernels.fused_moe as fm
    E, H, I = 128, 6144, 384
    gate = torch.randn(E, H, device="cuda") * H ** -0.5
    bias = torch.randn(E, device="cuda") * 0.05
    w13, w2, shared = _moe_weights(E, H, I)
    for t in (1, 2, 4, 8, 12, 16):
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(t, H, device="cuda", dtype=torch.float32)
        bm = fm.decode_block_m(t, 4, E, w13.dtype)

        def two():
            w, ids = fm.moe_route(x, gate, bias, 4, 2.0)
            return fm.moe_align(ids, E, bm, shared_expert=True)

        def moe_two():
            w, ids = fm.moe_route(x, gate, bias, 4, 2.0)
            fm.fused_moe(x, w13, w2, w, ids, shared=shared, out=out)

        def moe_one():
            w, ids, al = fm.moe_route_align(x, gate, bias, 4, 2.0, E, bm, shared_expert=True)
            fm.fused_moe(x, w13, w2, w, ids, shared=shared, out=out, alignment=al)
        one = lambda: fm.moe_route_align(x, gate, bias, 4, 2.0, E, bm, shared_expert=True)  # noqa: E731
        print(f"route_align T={t}: route+align {bench(two):.1f} us, one launch {bench(one):.1f} us; "
              f"whole MoE {bench(moe_two):.1f} vs {bench(moe_one):.1f} us", flush=True)


def _moe_weights(E: int, H: int, I: int):
    """Random bf16 expert stacks w13 [E, 2I, H], w2 [E, H, I] and a shared expert."""
    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5
    return w(E, 2 * I, H), w(E, H, I), (w(2 * I, H), w(H, I))


def moe() -> None:
    from m3serve.kernels.fused_moe import _config, fused_moe, get_config
    E, H, I = 128, 6144, 3072
    w13, w2, shared = _moe_weights(E, H, I)
    for T in (1, 8):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:4] for _ in range(T)]).int()
        wts = torch.rand(T, 4, device="cuda")
        out = torch.empty(T, H, device="cuda", dtype=torch.float32)
        distinct = ids.unique().numel() + 1
        ideal = distinct * 3 * H * I * 2 / TBPS * 1e6
        base = get_config(1, I, H, torch.bfloat16)
        cands = {"table": None}
        for bn in (32, 64, 128):
            for bk in (64, 128, 256):
                for st in (3, 4, 5):
                    for wp in (4, 8):
                        cands[f"n{bn} k{bk} s{st} w{wp}"] = _config(base["BLOCK_M"], bn, bk, 1, wp, st)
        res = []
        for name, cfg in cands.items():
            try:
                t = bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out, config=cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"moe T={T} {name}: {type(e).__name__}")
                continue
            res.append((t, name))
        res.sort()
        table = next(t for t, n in res if n == "table")
        print(f"moe T={T} ({distinct} experts, ideal {ideal:.1f} us): table {table:.1f} us; best: " +
              ", ".join(f"{n} {t:.1f}" for t, n in res[:6]), flush=True)


def _selection(T: int, G: int, bs: int, topk: int, ctx_start: int = 0) -> torch.Tensor:
    """MSA-like block choices for T prompt tokens: the token's own block forced, the rest random
    among earlier blocks; [T, G, topk] int32, -1 padded."""
    pos = ctx_start + torch.arange(T, device="cuda")
    nb = (ctx_start + T + bs - 1) // bs
    own = (pos // bs)[:, None, None]
    blocks = torch.arange(nb, device="cuda")[None, None, :]
    score = torch.rand(T, G, nb, device="cuda").masked_fill(blocks > own, float("-inf"))
    score = score.masked_fill(blocks == own, float("inf"))
    vals, ids = score.topk(min(topk, nb), dim=-1)
    ids = ids.masked_fill(vals == float("-inf"), -1).int()
    if ids.shape[-1] < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - ids.shape[-1]), value=-1)
    return ids


def prefill_attn() -> None:
    """The tiled prefill kernel on one 8K prompt, dense and sparse, by tile."""
    import m3serve.kernels.paged_attention as pa
    bs, G, H, D = 128, 4, 64, 128
    base = dict(pa._PREFILL_TILES)
    for lens in ((8192,),):
        T, R = sum(lens), len(lens)
        blocks = [-(-n // bs) for n in lens]
        kv = torch.randn(2, sum(blocks) + 1, bs, G, D, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        seq = torch.tensor(lens, device="cuda", dtype=torch.int32)
        tables = torch.zeros(R, max(blocks), device="cuda", dtype=torch.int32)
        first = 1
        for r, nb in enumerate(blocks):
            tables[r, :nb] = torch.arange(first, first + nb, device="cuda", dtype=torch.int32)
            first += nb
        sel = torch.cat([_selection(n, G, bs, 16) for n in lens])
        visible = 0
        for r, n in enumerate(lens):      # (query, key) pairs each kernel computes, per head
            pos = torch.arange(n, device="cuda")
            s = sel[qsl[r]:qsl[r + 1]]
            keys = torch.where(s >= 0, torch.minimum((s + 1) * bs, pos[:, None, None] + 1) - s * bs, 0)
            visible += keys.sum().item() / G
        dense_pairs = sum(n * (n + 1) / 2 for n in lens)
        bq = base[True, True][0] // 16           # tokens per query tile (16 heads per group)
        _, counts = pa._tile_block_union(sel, qsl, R, bq, T // bq + R)
        print(f"prefill attn {lens}: distinct blocks per {bq}-token tile and group: mean "
              f"{counts.float().mean():.1f}, max {int(counts.max())} (each token selects <= 16)",
              flush=True)
        ref = {s: pa.paged_attention(q, kv, qsl, seq, tables, 0.088, block_ids=sel if s else None,
                                     max_query_len=max(lens), max_seq_len=max(lens)).float()
               for s in (False, True)}
        for sparse, pairs in ((False, dense_pairs), (True, visible)):
            flops = 4 * H * D * pairs
            res = []
            for tma in (False, True):
                pa._PREFILL_TMA = tma
                for bm in (64, 128):
                    for bn in (64, 128):
                        for wp in (4, 8):
                            for st in (2, 3):
                                if not tma and (bm, bn, wp, st) != base[sparse, False]:
                                    continue
                                pa._PREFILL_TILES[sparse, tma] = (bm, bn, wp, st)
                                fn = lambda: pa.paged_attention(q, kv, qsl, seq, tables, 0.088,
                                                                block_ids=sel if sparse else None,
                                                                max_query_len=max(lens), max_seq_len=max(lens))
                                try:
                                    err = ((fn().float() - ref[sparse]).norm() / ref[sparse].norm()).item()
                                    t = triton.testing.do_bench(fn, rep=30) * 1e3
                                except Exception:  # noqa: BLE001 - out of resources: skipped
                                    continue
                                res.append((t, f"{'TMA ' if tma else ''}m{bm} n{bn} w{wp} s{st} (err {err:.1e})",
                                            (bm, bn, wp, st) == base[sparse, tma]))
            pa._PREFILL_TILES.update(base)
            pa._PREFILL_TMA = True
            res.sort()
            cur = [f"{n} {t:.0f} us ({flops / t / 1e6:.0f} TFLOP/s)" for t, n, b in res if b]
            print(f"prefill attn {lens} {'sparse' if sparse else 'dense '}: the table's tiles "
                  f"{', '.join(cur)}; best " +
                  ", ".join(f"{n} {t:.0f} ({flops / t / 1e6:.0f})" for t, n, _ in res[:5]), flush=True)


def _prefill_moe_inputs(T: int, E: int, H: int):
    """Activations [T, H], balanced random routing to 4 of E experts, its weights, and an fp32
    output [T, H]."""
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(4, dim=-1).indices.int()
    wts = torch.rand(T, 4, device="cuda")
    return x, ids, wts, torch.empty(T, H, device="cuda", dtype=torch.float32)


def prefill_moe() -> None:
    """Fused MoE at prefill token counts (balanced random routing), by tile."""
    from m3serve.kernels.fused_moe import _config, fused_moe, get_config
    E, H, I = 128, 6144, 3072
    w13, w2, shared = _moe_weights(E, H, I)
    for T in (2048, 8192):
        x, ids, wts, out = _prefill_moe_inputs(T, E, H)
        flops = 2 * T * 5 * 3 * H * I
        table = triton.testing.do_bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out),
                                        rep=50) * 1e3
        m_avg = -(-T * 4 // E)
        res = []
        for bm in (64, 128):
            for bn in (128, 256):
                for bk in (64,):
                    for wp in (8,):
                        for st in (3, 4):
                            cfg = _config(bm, bn, bk, 8, wp, st)
                            try:
                                t = triton.testing.do_bench(
                                    lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out, config=cfg),
                                    rep=50) * 1e3
                            except Exception:  # noqa: BLE001 - out of resources: skipped
                                continue
                            res.append((t, f"m{bm} n{bn} k{bk} w{wp} s{st}"))
        res.sort()
        print(f"prefill moe T={T} (table {get_config(m_avg, I, H, torch.bfloat16, True)}): {table:.0f} us "
              f"({flops / table / 1e6:.0f} TFLOP/s); best " +
              ", ".join(f"{n} {t:.0f} ({flops / t / 1e6:.0f})" for t, n in res[:4]), flush=True)


def mid_moe() -> None:
    """The fused MoE at the token counts of mixed steps (a prefill chunk beside 63 decodes: 18,
    34 and 66 rows per routed expert), by tile, one GEMM varied at a time (the other on the
    table): time and the weight bytes' share of the HBM bandwidth (every expert is read)."""
    from m3serve.kernels.fused_moe import _config, fused_moe, get_config
    E, H, I = 128, 6144, 3072
    w13, w2, shared = _moe_weights(E, H, I)
    sizes = (575, 1087, 2111)
    inputs = {T: _prefill_moe_inputs(T, E, H) for T in sizes}
    for T in sizes:
        x, ids, wts, out = inputs[T]
        distinct = ids.unique().numel() + 1
        ideal = distinct * 3 * H * I * 2 / TBPS * 1e6
        t = bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out))
        m_avg = -(-T * 4 // E)
        print(f"mid moe T={T} M={m_avg}: table {t:.0f} us, ideal {ideal:.0f} us ({ideal / t:.0%}); "
              f"gate_up {get_config(m_avg, I, H, torch.bfloat16, True)}, down {get_config(m_avg, H, I, torch.bfloat16)}",
              flush=True)
    for bm in (16, 32, 64):
        for which in (0, 1):
            res = {T: [] for T in sizes}
            for bn in (64, 128):
                for bk in (64, 128):
                    for wp in (4, 8):
                        for st in (3, 4):
                            for T in sizes:
                                x, ids, wts, out = inputs[T]
                                m_avg = -(-T * 4 // E)
                                pair = [get_config(m_avg, I, H, torch.bfloat16, True), get_config(m_avg, H, I, torch.bfloat16)]
                                pair = [dict(c, BLOCK_M=bm) for c in pair]
                                pair[which] = _config(bm, bn, bk, 8, wp, st)
                                try:
                                    t = bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out,
                                                                config=tuple(pair)))
                                except Exception:  # noqa: BLE001 - out of resources: skipped
                                    continue
                                res[T].append((t, f"n{bn} k{bk} w{wp} s{st}"))
            for T in sizes:
                best = sorted(res[T])[:4]
                print(f"mid moe T={T} m{bm} {'gate_up' if which == 0 else 'down'} varied: " +
                      ", ".join(f"{n} {t:.0f}" for t, n in best), flush=True)


def _moe_weights_fp8(E: int, H: int, I: int):
    """FP8 (e4m3) expert stacks with one fp32 scale per output row, as `fused_moe` takes them:
    (w13, w2, {w13_scale, w2_scale}, shared (w13_s, w2_s, w13_s_scale, w2_s_scale))."""
    def w(*shape):
        q = torch.randn(*shape, device="cuda").clamp(-4, 4).to(torch.float8_e4m3fn)
        return q, torch.full(shape[:-1], shape[-1] ** -0.5, device="cuda")
    (w13, s13), (w2, s2), (ws13, ss13), (ws2, ss2) = w(E, 2 * I, H), w(E, H, I), w(2 * I, H), w(H, I)
    return w13, w2, {"w13_scale": s13, "w2_scale": s2}, (ws13, ws2, ss13, ss2)


def moe_bounds(fp8: bool = False) -> None:
    """Where the fused MoE's tile regimes should switch: the medium (32-row) and large (64-row)
    configs and a 128-row one of `get_config`'s table, at 448-4223 tokens (14-132 rows per
    routed expert), with the weight bytes' share of the HBM bandwidth."""
    from m3serve.kernels.fused_moe import fused_moe, get_config
    E, H, I = 128, 6144, 3072
    if fp8:
        w13, w2, scales, shared = _moe_weights_fp8(E, H, I)
    else:
        (w13, w2, shared), scales = _moe_weights(E, H, I), {}
    dt = w13.dtype
    rows = {"m32": 20, "m64": 60, "m128": 300}   # an M in each regime of the table
    for T in (448, 575, 704, 832, 960, 1087, 1536, 2111, 3071, 4223):
        x, ids, wts, out = _prefill_moe_inputs(T, E, H)
        ideal = (ids.unique().numel() + 1) * 3 * H * I * w13.element_size() / TBPS * 1e6
        times = {}
        for name, m in rows.items():
            pair = (get_config(m, I, H, dt, True), get_config(m, H, I, dt))
            times[name] = bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out,
                                                  config=pair, **scales))
        print(f"moe bounds {'fp8' if fp8 else 'bf16'} T={T} M={-(-T * 4 // E)}: " +
              ", ".join(f"{n} {t:.0f} us ({ideal / t:.0%})" for n, t in times.items()), flush=True)


def moe_bounds_fp8() -> None:
    moe_bounds(fp8=True)


def _moe_kernel_times(run, T: int, H: int, I: int, reps: int = 10) -> str:
    """The GPU time per call of each kernel `run` launches (torch profiler, after three warm
    calls), with the two grouped GEMMs' TFLOP/s (4 routed + shared expert per token)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    flops = {"_gemm1_swiglu_kernel": 2 * T * 5 * 2 * H * I, "_gemm2_kernel": 2 * T * 5 * H * I}
    parts = []
    for ev in prof.key_averages():
        us = ev.device_time_total / reps
        if us >= 1:
            f = flops.get(ev.key)
            parts.append(f"{ev.key[:28]} {us:.0f} us" + (f" ({f / us / 1e6:.0f} TFLOP/s)" if f else ""))
    return "; ".join(parts)


def prefill_moe_kernels() -> None:
    """Where the fused MoE's prefill time goes, kernel by kernel (torch profiler), at 2048 and
    8192 tokens with the tile table, and each GEMM's TFLOP/s."""
    from m3serve.kernels.fused_moe import fused_moe
    E, H, I = 128, 6144, 3072
    w13, w2, shared = _moe_weights(E, H, I)
    for T in (2048, 8192):
        x, ids, wts, out = _prefill_moe_inputs(T, E, H)
        for reduce in ("atomic", "sum"):   # the down GEMM adds into [T, H] or stores [T * 5, H]
            run = lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out, reduce=reduce)
            print(f"prefill moe kernels T={T} reduce={reduce}: {_moe_kernel_times(run, T, H, I)}",
                  flush=True)


def grouped_mm() -> None:
    """The MoE of a prefill step as torch's grouped GEMMs: pairs sorted by expert (the shared
    expert as group E), rows gathered, gate_up GEMM, SwiGLU-OAI, down GEMM, weighted sum over
    the K + 1 choices; against the fused MoE (atomic), bf16 and fp8 (row scales), 2048-16384
    tokens. Prints each stage's time and the result's error against the fused MoE."""
    from m3serve.kernels.fused_moe import fused_moe, quant_rows_fp8
    E, H, I = 128, 6144, 3072
    w13, w2, shared = _moe_weights(E, H, I)
    b13 = torch.cat([w13, shared[0][None]]).transpose(1, 2)     # [E+1, H, 2I], column-major
    b2 = torch.cat([w2, shared[1][None]]).transpose(1, 2)       # [E+1, I, H]
    fp8 = {}
    try:
        q13, s13 = quant_rows_fp8(torch.cat([w13, shared[0][None]]).flatten(0, 1))
        q2, s2 = quant_rows_fp8(torch.cat([w2, shared[1][None]]).flatten(0, 1))
        fp8 = {"b13": q13.view(E + 1, 2 * I, H).transpose(1, 2), "s13": s13.view(E + 1, 2 * I),
               "b2": q2.view(E + 1, H, I).transpose(1, 2), "s2": s2.view(E + 1, H)}
    except Exception as exc:  # noqa: BLE001 - reported, bf16 still runs
        print(f"grouped_mm: fp8 weights not built: {exc}")

    def swiglu(h):
        gate, up = h[:, :I].float().clamp(max=7.0), h[:, I:].float().clamp(-7.0, 7.0)
        return (gate * torch.sigmoid(1.702 * gate) * (up + 1.0)).to(torch.bfloat16)

    for T in (2048, 8192, 16384):
        x, ids, wts, out = _prefill_moe_inputs(T, E, H)
        flops = 2 * T * 5 * 3 * H * I
        ours = triton.testing.do_bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out),
                                       rep=50) * 1e3
        ref = out.clone()
        all_ids = torch.cat([ids, torch.full((T, 1), E, device="cuda", dtype=ids.dtype)], 1).flatten()
        all_w = torch.cat([wts, torch.ones(T, 1, device="cuda")], 1)          # [T, 5]
        state = {}

        def plan():
            order = torch.argsort(all_ids, stable=True)
            state["order"] = order
            state["offs"] = torch.cumsum(torch.bincount(all_ids, minlength=E + 1), 0).int()
            state["a"] = x[order // 5]

        def gemms(q=None):
            a, offs = state["a"], state["offs"]
            if q is None:
                h = torch._grouped_mm(a, b13, offs=offs)
                y = torch._grouped_mm(swiglu(h), b2, offs=offs)
            else:
                qa, sa = quant_rows_fp8(a)
                h = torch._scaled_grouped_mm(qa, q["b13"], sa, q["s13"], offs=offs,
                                             out_dtype=torch.bfloat16, use_fast_accum=True)
                qh, sh = quant_rows_fp8(swiglu(h))
                y = torch._scaled_grouped_mm(qh, q["b2"], sh, q["s2"], offs=offs,
                                             out_dtype=torch.bfloat16, use_fast_accum=True)
            state["y"] = y

        def combine():
            y = torch.empty_like(state["y"])
            y[state["order"]] = state["y"]
            state["out"] = torch.einsum("tk,tkh->th", all_w, y.view(T, 5, H).float())

        for name, q in [("bf16", None)] + ([("fp8", fp8)] if fp8 else []):
            try:
                plan(); gemms(q); combine()
                t_plan = triton.testing.do_bench(plan, rep=50) * 1e3
                t_gemm = triton.testing.do_bench(lambda: gemms(q), rep=50) * 1e3
                t_comb = triton.testing.do_bench(combine, rep=50) * 1e3
            except Exception as exc:  # noqa: BLE001 - the op may be missing for this dtype
                print(f"grouped_mm T={T} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            err = ((state["out"] - ref).norm() / ref.norm()).item()
            tot = t_plan + t_gemm + t_comb
            print(f"grouped_mm T={T} {name}: fused_moe bf16 {ours:.0f} us ({flops / ours / 1e6:.0f} TFLOP/s); "
                  f"grouped: plan {t_plan:.0f} + gemms+swiglu {t_gemm:.0f} ({flops / t_gemm / 1e6:.0f} TFLOP/s) "
                  f"+ combine {t_comb:.0f} = {tot:.0f} us ({flops / tot / 1e6:.0f} TFLOP/s); rel err vs fused "
                  f"bf16 {err:.4f}", flush=True)


def moe_tma() -> None:
    """The fused MoE at prefill sizes (8192 / 16384 tokens, bf16, balanced routing): the
    down GEMM's atomic epilogue against storing each expert's output and one summing pass, the
    weight (and h) tiles by per-thread loads against tensor descriptors (TMA), tiles, and the
    shared expert inside the grouped GEMMs against cuBLAS beside them (`extra`); each variant's
    error against the default path, and cuBLAS at the shared expert's shapes as the ceiling."""
    from m3serve.kernels.fused_moe import _config, fused_moe, get_config
    from m3serve.kernels.swiglu import swiglu_oai_fused
    E, H, I = 128, 6144, 3072
    w13, w2, shared = _moe_weights(E, H, I)

    def cfg(bm, bn, bk, wp, st, tma, bn2=None):
        c1 = _config(bm, bn, bk, 8, wp, st, tma=tma)
        return c1, {**c1, "BLOCK_N": bn2 or bn}

    def shared_cublas(x):
        return F.linear(swiglu_oai_fused(F.linear(x, shared[0]), 1.702, 7.0), shared[1])

    for T in (8192, 16384):
        x, ids, wts, out = _prefill_moe_inputs(T, E, H)
        flops = 2 * T * 5 * 3 * H * I
        m_avg = -(-T * 4 // E)
        table = (get_config(m_avg, I, H, torch.bfloat16, True), get_config(m_avg, H, I, torch.bfloat16))
        ref = fused_moe(x, w13, w2, wts, ids, shared=shared).float()
        mm = bench(lambda: F.linear(x, shared[0]))
        print(f"moe_tma T={T}: cuBLAS x @ w13_shared^T [{T}x{H}] x [{H}x{2 * I}] {mm:.0f} us "
              f"({2 * T * H * 2 * I / mm / 1e6:.0f} TFLOP/s); shared expert by cuBLAS + SwiGLU "
              f"{bench(lambda: shared_cublas(x)):.0f} us", flush=True)
        variants = [("table atomic", table, "atomic", False),
                    ("table sum", table, "sum", False),
                    ("table sum, shared by cuBLAS", table, "sum", True)]
        for tiles in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4),
                      (64, 128, 64, 4, 4), (128, 128, 64, 8, 3, 256)):
            name = "m{} n{} k{} w{} s{}".format(*tiles[:5]) + (f" n2={tiles[5]}" if len(tiles) > 5 else "")
            c = cfg(*tiles[:5], True, *tiles[5:])
            variants += [(f"TMA {name} sum", c, "sum", False),
                         (f"TMA {name} sum, shared by cuBLAS", c, "sum", True)]
        variants += [("no TMA m128 n128 k64 w8 s4 sum", cfg(128, 128, 64, 8, 4, False), "sum", False)]
        for name, config, reduce, cublas in variants:
            def run():
                if cublas:
                    return fused_moe(x, w13, w2, wts, ids, out=out, reduce=reduce, config=config,
                                     extra=shared_cublas(x))
                return fused_moe(x, w13, w2, wts, ids, shared=shared, out=out, reduce=reduce,
                                 config=config)
            try:
                run()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                t = triton.testing.do_bench(run, rep=50) * 1e3
            except Exception as exc:  # noqa: BLE001 - reported, the next variant runs
                print(f"moe_tma T={T} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            print(f"moe_tma T={T} {name}: {t:.0f} us ({flops / t / 1e6:.0f} TFLOP/s), rel err {err:.4f}",
                  flush=True)
        for name, config in (("table", table), ("TMA m128 n128 k64 w8 s3", cfg(128, 128, 64, 8, 3, True))):
            run = lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out, reduce="sum", config=config)
            print(f"moe_tma kernels T={T} {name} sum: {_moe_kernel_times(run, T, H, I, reps=5)}", flush=True)


def moe_tma_regimes() -> None:
    """Where else tensor-descriptor tiles and the summing pass pay: FP8 weights at prefill
    sizes (the table's tiles, with and without TMA) and bf16 at mixed-step sizes (64-row
    tiles), each with the atomic and the sum reduction."""
    from m3serve.kernels.fused_moe import fused_moe, get_config
    E, H, I = 128, 6144, 3072
    bf16 = _moe_weights(E, H, I)
    fp8 = _moe_weights_fp8(E, H, I)
    cases = [("fp8", 8192), ("fp8", 16384), ("fp8", 2048), ("bf16", 2048), ("bf16", 1087)]
    for kind, T in cases:
        if kind == "fp8":
            w13, w2, scales, shared = fp8
        else:
            (w13, w2, shared), scales = bf16, {}
        x, ids, wts, out = _prefill_moe_inputs(T, E, H)
        m = -(-T * 4 // E)
        table = (get_config(m, I, H, w13.dtype, True), get_config(m, H, I, w13.dtype))
        ref = fused_moe(x, w13, w2, wts, ids, shared=shared, reduce="atomic", **scales).float()
        res = []
        for tma in (False, True):
            pair = tuple({**c, "TMA": tma} for c in table)
            for reduce in ("atomic", "sum"):
                run = lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out, reduce=reduce,
                                        config=pair, **scales)
                try:
                    run()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    res.append(f"{'TMA' if tma else 'loads'} {reduce} {bench(run):.0f} us (err {err:.4f})")
                except Exception as exc:  # noqa: BLE001 - reported, the next variant runs
                    res.append(f"{'TMA' if tma else 'loads'} {reduce} failed: {str(exc)[:200]}")
        print(f"moe_tma_regimes {kind} T={T} tiles m{table[0]['BLOCK_M']} n{table[0]['BLOCK_N']}/"
              f"{table[1]['BLOCK_N']} k{table[0]['BLOCK_K']}: " + "; ".join(res), flush=True)


def small() -> None:
    """The small per-layer kernels of a decode step at 1 and 8 tokens: the embedding gather
    (advanced indexing against F.embedding, int32 and int64 ids), the fused residual-add RMSNorm
    by warps, and the indexer's top-k rows by warps (16 of 74 blocks: a 9472-token graph)."""
    import m3serve.kernels.indexer as ix
    import m3serve.kernels.rmsnorm as rn
    from m3serve.kernels.step_inputs import embedding_rows
    table = torch.randn(200064, 6144, device="cuda", dtype=torch.bfloat16)
    for m in (1, 8):
        for dt in (torch.int32, torch.int64):
            ids = torch.randint(0, 200064, (m,), device="cuda", dtype=dt)
            t_idx = bench(lambda: table[ids])
            t_emb = bench(lambda: F.embedding(ids, table))
            t_tri = bench(lambda: embedding_rows(ids, table))
            print(f"embedding M={m} {dt}: indexing {t_idx:.1f} us, F.embedding {t_emb:.1f} us, "
                  f"embedding_rows {t_tri:.1f} us", flush=True)
        x = torch.randn(m, 6144, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, 6144, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(6144, device="cuda", dtype=torch.bfloat16)
        base = rn.norm_warps
        res = []
        for warps in (4, 8, 16, 32):
            rn.norm_warps = lambda block, warps=warps: warps
            res.append(f"w{warps} {bench(lambda: rn.fused_add_rms_norm(x, r, w, 1e-6)):.2f}")
        rn.norm_warps = base
        print(f"add+rmsnorm M={m} (current {base(8192)} warps): " + ", ".join(res), flush=True)
        scores = torch.randn(m, 4, 74, device="cuda")
        base_topk = ix.TOPK_WARPS_SMALL
        res = []
        for warps in (1, 2, 4):
            ix.TOPK_WARPS_SMALL = warps
            res.append(f"w{warps} {bench(lambda: ix.select_topk(scores, 16)):.2f}")
        ix.TOPK_WARPS_SMALL = base_topk
        print(f"top-16 of 74 rows M={m} x 4 heads: " + ", ".join(res), flush=True)


def _sorted_top_p(logits, p):
    """The sampler's top-p before the radix kernels: a full sort, softmax, cumsum and scatter."""
    values, ids = logits.sort(dim=-1, descending=True)
    probs = values.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs >= p.unsqueeze(1)) & (p.unsqueeze(1) < 1.0)
    return torch.empty_like(logits).scatter_(1, ids, values.masked_fill(drop, float("-inf")))


def _eager_us(fn, n: int = 100) -> float:
    """Back-to-back eager calls (as the sampler runs, outside the graphs): host launch time
    counts where it exceeds the GPU's."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def sample() -> None:
    """At the real vocabulary: top-p 0.9 by the old sort path, the sort-based reference cut-off
    and the radix kernels; top-k 50 by torch.topk and by the radix kernels; Sampler.forward at
    temperature 1, top-p 0.9 on each path. Eager back-to-back (host-bound shows) and by graph
    replay (GPU time only), then the sampled step's kernels by the profiler. Logits: N(0, 2^2)
    with 20 tokens lifted by 8-12 (a peaked row)."""
    from m3serve.kernels.ref.sampling import top_k_threshold_ref, top_p_threshold_ref
    from m3serve.kernels.sampling import top_k_threshold, top_p_threshold
    from m3serve.layers.dispatch import reference_ops
    from m3serve.sampling_params import SamplingParams
    from m3serve.worker.sampler import Sampler, SamplingMetadata
    V = 200064
    for R in (1, 8, 64):
        logits = torch.randn(R, V, device="cuda") * 2
        logits[:, :20] += torch.rand(R, 20, device="cuda") * 4 + 8
        p = torch.full((R,), 0.9, device="cuda")
        k = torch.full((R,), 50, device="cuda", dtype=torch.int64)
        same = int((top_p_threshold(logits, p) == top_p_threshold_ref(logits, p)).sum())
        print(f"sample R={R}: radix top-p cut-off equals the reference in {same}/{R} rows")
        fns = {"top-p sort (before)": lambda: _sorted_top_p(logits, p),
               "top-p sort cut-off (ref)": lambda: top_p_threshold_ref(logits, p),
               "top-p radix cut-off": lambda: top_p_threshold(logits, p),
               "top-k 50 torch.topk": lambda: top_k_threshold_ref(logits, k, 50),
               "top-k 50 radix": lambda: top_k_threshold(logits, k)}
        for name, fn in fns.items():
            print(f"sample R={R} {name}: eager {_eager_us(fn):.1f} us, graph {bench(fn):.1f} us",
                  flush=True)
        sampler = Sampler(torch.Generator(device="cuda").manual_seed(0))
        params = [SamplingParams(temperature=1.0, top_p=0.9)] * R
        meta = SamplingMetadata.from_params(params, [[]] * R, [[]] * R, [None] * R, V, "cuda")
        t_radix = _eager_us(lambda: sampler(logits, meta))
        with reference_ops():
            t_sort = _eager_us(lambda: sampler(logits, meta))
        print(f"sample R={R} Sampler T=1 top-p 0.9: radix {t_radix:.1f} us, sort reference "
              f"{t_sort:.1f} us (eager)", flush=True)
        if R in (1, 8):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    sampler(logits, meta)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)


def sample_rounds() -> None:
    """The radix cut-offs' digit split and chunk size: top-p 0.9 and top-k 50 by graph replay,
    each checked against the sort-based reference, with the hist/scan kernel times by profiler."""
    import m3serve.kernels.sampling as ks
    from m3serve.kernels.ref.sampling import top_p_threshold_ref
    V = 200064
    base = ks.ROUNDS, ks.CHUNK
    variants = [(((20, 12), (10, 10), (0, 10)), 4096), (((20, 12), (10, 10), (0, 10)), 8192),
                (((20, 12), (10, 10), (0, 10)), 2048), (((18, 14), (9, 9), (0, 9)), 4096),
                (((17, 15), (8, 9), (0, 8)), 4096), (((16, 16), (8, 8), (0, 8)), 4096)]
    for R in (1, 8, 64):
        logits = torch.randn(R, V, device="cuda") * 2
        logits[:, :20] += torch.rand(R, 20, device="cuda") * 4 + 8
        p = torch.full((R,), 0.9, device="cuda")
        k = torch.full((R,), 50, device="cuda", dtype=torch.int64)
        ref = top_p_threshold_ref(logits, p)
        for rounds, chunk in variants:
            ks.ROUNDS, ks.CHUNK = rounds, chunk
            same = int((ks.top_p_threshold(logits, p) == ref).sum())
            t_p = bench(lambda: ks.top_p_threshold(logits, p))
            t_k = bench(lambda: ks.top_k_threshold(logits, k))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                ks.top_p_threshold(logits, p)
                torch.cuda.synchronize()
            kern = [f"{e.name[1:5]} {e.self_device_time_total:.1f}" for e in prof.events()
                    if e.name in ("_hist_kernel", "_scan_kernel")]
            print(f"rounds R={R} {[b for _, b in rounds]} chunk {chunk}: top-p {t_p:.1f} us "
                  f"({same}/{R} equal), top-k {t_k:.1f} us; top-p kernels {kern}", flush=True)
        ks.ROUNDS, ks.CHUNK = base


# one rank's widths (bench make-realshape --tp-rank N): routed / shared expert width I, the fused
# qkv rows of a sparse layer (q | k | v | index_q | index_k), o_proj's K, the dense MLP width
RANK_SHAPES = {"tp8": {"I": 384, "qkv": 1536, "o_k": 1024, "dense": 1536, "vocab": 25008},
               "tp4": {"I": 768, "qkv": 2816, "o_k": 2048, "dense": 3072, "vocab": 50016}}


def _sweep_moe_tiles(run, g0: dict, d0: dict, gate_grid: list, down_grid: list):
    """A coordinate search over the fused MoE's tiles: `run((gate_up config, down config))` ->
    µs. gate_up configs (label, config) beside the table's down, then down configs beside the
    best gate_up -> (the table's time, gate_up results, down results), results sorted
    [(µs, label, config)]."""
    table = run((g0, d0))
    gate = sorted(((run((g, d0)), n, g) for n, g in gate_grid), key=lambda r: r[0])
    down = sorted(((run((gate[0][2], d)), n, d) for n, d in down_grid), key=lambda r: r[0])
    return table, gate, down


def rank_moe() -> None:
    """The fused MoE at one TP rank's expert width (4 routed of 128 + the shared expert, bf16
    and FP8, 1 / 4 / 16 tokens): the tile table against a coordinate search, gate_up tiles
    first (down at the table's), then down tiles beside the best gate_up."""
    from m3serve.kernels.fused_moe import _config, fused_moe, get_config
    E, H = 128, 6144
    for fp8 in (False, True):
        for rank, shp in RANK_SHAPES.items():
            I = shp["I"]
            if fp8:
                w13, w2, scales, shared = _moe_weights_fp8(E, H, I)
            else:
                (w13, w2, shared), scales = _moe_weights(E, H, I), {}
            dt = w13.dtype
            for T in (1, 4, 16):
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                ids = torch.stack([torch.randperm(E, device="cuda")[:4] for _ in range(T)]).int()
                wts = torch.rand(T, 4, device="cuda")
                out = torch.empty(T, H, device="cuda", dtype=torch.float32)
                ideal = (ids.unique().numel() + 1) * 3 * H * I * w13.element_size() / TBPS * 1e6
                m = -(-T * 4 // E)
                g0, d0 = get_config(m, I, H, dt, True), get_config(m, H, I, dt)

                def run(pair):
                    try:
                        return bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out,
                                                       config=pair, **scales))
                    except Exception:  # noqa: BLE001 - a config that does not compile is skipped
                        return float("inf")
                table, res, res2 = _sweep_moe_tiles(
                    run, g0, d0,
                    [(f"n{bn} k{bk} s{st} w{wp}", _config(g0["BLOCK_M"], bn, bk, 1, wp, st))
                     for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 5) for wp in (2, 4)],
                    [(f"n{bn} k{bk} s{st}", _config(d0["BLOCK_M"], bn, bk, 1, 4, st))
                     for bn in (32, 64, 128) for bk in (64, 128) for st in (2, 3, 4)])
                print(f"rank_moe {'fp8' if fp8 else 'bf16'} {rank} I={I} T={T} ideal {ideal:.1f} us: "
                      f"table {table:.1f} ({ideal / table:.0%}); gate_up best " +
                      ", ".join(f"{n} {t:.1f}" for t, n, _ in res[:4]) + "; then down best " +
                      ", ".join(f"{n} {t:.1f} ({ideal / t:.0%})" for t, n, _ in res2[:4]), flush=True)


def rank_gemv() -> None:
    """cuBLAS against the Triton skinny GEMM (its table and a tile sweep) at one TP rank's
    projection shapes, 1 / 4 / 8 rows, bf16; and FP8 weights through torch._scaled_mm with the
    per-token activation quantisation (the FP8 path's kernels) for the same shapes."""
    from m3serve.kernels.gemv import skinny_config, skinny_linear
    from m3serve.layers.quant import fp8_linear, quantize_weight
    for rank, shp in RANK_SHAPES.items():
        shapes = {"qkv": (shp["qkv"], 6144), "o_proj": (6144, shp["o_k"]),
                  "dense gate_up": (2 * shp["dense"], 6144), "dense down": (6144, shp["dense"]),
                  "lm_head": (shp["vocab"], 6144)}
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            wq, ws = quantize_weight(w)
            for m in (1, 4, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ideal = (n * k + m * k + m * n) * 2 / TBPS * 1e6
                t_cublas = bench(lambda: F.linear(x, w))
                t_table = bench(lambda: skinny_linear(x, w))
                t_fp8 = bench(lambda: fp8_linear(x, wq, ws))
                res = []
                for bn in (16, 32, 64, 128):
                    for bk in (128, 256):
                        for st in (3, 4, 6):
                            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": st}
                            try:
                                res.append((bench(lambda: skinny_linear(x, w, cfg)), f"n{bn} k{bk} s{st}"))
                            except Exception:  # noqa: BLE001
                                pass
                res.sort()
                print(f"rank_gemv {rank} {name} N={n} K={k} M={m} ideal {ideal:.1f} us: cuBLAS "
                      f"{t_cublas:.1f} ({ideal / t_cublas:.0%}), skinny table {skinny_config(n, k)} "
                      f"{t_table:.1f} ({ideal / t_table:.0%}), fp8 _scaled_mm {t_fp8:.1f} "
                      f"(ideal {ideal / 2:.1f}); best " + ", ".join(f"{c} {t:.1f}" for t, c in res[:4]),
                      flush=True)


def allreduce() -> None:
    """The one-shot all-reduce kernel, 2 / 4 / 8 ranks as streams of one process on the one
    GPU (no NVLink: a floor for the kernel's own cost, with peers' reads from local HBM), at
    decode message sizes: per-call time of graphed back-to-back calls, every rank's graph
    on its own stream."""
    from m3serve.kernels import allreduce as ar
    for world in (2, 4, 8):
        bufs = [ar.IpcBuffers(r, world, 1 << 20, torch.device("cuda")) for r in range(world)]
        ptrs = torch.tensor([b.staging.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
        flags = torch.tensor([b.flags.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
        for b in bufs:
            b.buf_ptrs, b.flag_ptrs = ptrs, flags
        ranks = [ar.OneShotAllReduce(b, max_spins=1 << 22) for b in bufs]
        streams = [torch.cuda.Stream() for _ in range(world)]
        for tokens, dtype in ((1, torch.bfloat16), (4, torch.bfloat16), (16, torch.bfloat16),
                              (64, torch.bfloat16), (16, torch.float32), (42, torch.float32)):
            xs = [torch.randn(tokens * 6144, device="cuda").to(dtype) for _ in range(world)]

            for r in range(world):          # compile, and step every rank's counter together
                with torch.cuda.stream(streams[r]):
                    ranks[r](xs[r])
            torch.cuda.synchronize()
            graphs = []
            for r in range(world):          # 100 calls per rank in one graph: no host in the loop
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=streams[r]):
                    for _ in range(100):
                        ranks[r](xs[r])
                graphs.append(graph)
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for r in range(world):
                    with torch.cuda.stream(streams[r]):
                        graphs[r].replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / 100 * 1e6)
            us = sorted(times)[len(times) // 2]
            for r in ranks:
                r.check()
            print(f"allreduce world {world} {tokens} tokens {str(dtype)[6:]} "
                  f"({xs[0].numel() * xs[0].element_size() // 1024} KiB): {us:.1f} us per call "
                  f"(median of 5 replays of 100 graphed calls per rank)", flush=True)


def _packed_stack(w: torch.Tensor, kind: str):
    """(codes, block scales, global scales or None) of a [.., N, K] stack, expert by expert."""
    from m3serve.kernels.ref import packed as rp
    parts = []
    for e in range(w.shape[0]):
        if kind == "mxfp8":
            parts.append((*rp.quantize_mxfp8(w[e]), None))
        elif kind == "mxfp4":
            parts.append((*rp.quantize_mxfp4(w[e]), None))
        else:
            g = rp.nvfp4_global_scale(w[e].float().abs().amax(-1))
            parts.append((*rp.quantize_nvfp4(w[e], g), g))
    return tuple(None if parts[0][i] is None else torch.stack([p[i] for p in parts]) for i in range(3))


def rank_packed() -> None:
    """The packed-weight kernels at one TP 8 rank's widths, decode rows: the fused MoE with
    packed experts (PACKED_KINDS, default mxfp4,mxfp8; nvfp4 too) (4 routed of 128 + the shared expert) at the table's tiles against a
    sweep (gate_up tiles first, then down tiles beside the best), the bf16 experts' table time
    beside it; then the dense packed product (MXFP8) against cuBLAS bf16 at the rank's
    projection shapes, by tile (skipped with PACKED_DENSE=0)."""
    from m3serve.kernels.fused_moe import _config, fused_moe, get_config
    from m3serve.bench.roofline import PACKED_BYTES
    from m3serve.kernels.packed_gemm import packed_config, packed_matmul
    E, H, I = 128, 6144, RANK_SHAPES["tp8"]["I"]
    (w13, w2, shared), _ = _moe_weights(E, H, I), {}
    for kind in os.environ.get("PACKED_KINDS", "mxfp4,mxfp8").split(","):
        c13, s13, g13 = _packed_stack(w13, kind)
        c2, s2, g2 = _packed_stack(w2, kind)
        sh13, sh2 = _packed_stack(shared[0][None], kind), _packed_stack(shared[1][None], kind)
        sh = (sh13[0][0], sh2[0][0], sh13[1][0], sh2[1][0])
        if kind == "nvfp4":
            sh += (sh13[2][0], sh2[2][0])
        for T in (1, 4, 16):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device="cuda")[:4] for _ in range(T)]).int()
            wts = torch.rand(T, 4, device="cuda")
            out = torch.empty(T, H, device="cuda", dtype=torch.float32)
            ideal = (ids.unique().numel() + 1) * 3 * H * I * PACKED_BYTES[kind] / TBPS * 1e6
            m = -(-T * 4 // E)
            g0, d0 = get_config(m, I, H, torch.bfloat16, True), get_config(m, H, I, torch.bfloat16)
            bf16 = bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out))
            bf16_split = {sp: bench(lambda: fused_moe(x, w13, w2, wts, ids, shared=shared, out=out,
                                                      config=({**g0, "SPLIT_K": sp}, d0)))
                          for sp in (2, 4, 8)}

            def run(pair):
                try:
                    return bench(lambda: fused_moe(x, c13, c2, wts, ids, w13_scale=s13, w2_scale=s2,
                                                   w13_global=g13, w2_global=g2, packed=kind,
                                                   shared=sh, out=out, config=pair))
                except Exception:  # noqa: BLE001 - a config that does not compile is skipped
                    return float("inf")
            table, res, res2 = _sweep_moe_tiles(
                run, g0, d0,
                [(f"n{bn} k{bk} w{wp} s{sp}", _config(g0["BLOCK_M"], bn, bk, 1, wp, 3, split_k=sp))
                 for bn in (32, 64) for bk in (128, 256) for wp in (4, 8) for sp in (1, 2, 4, 8)],
                [(f"n{bn} k{bk}", _config(d0["BLOCK_M"], bn, bk, 1, 4, 3))
                 for bn in (32, 64, 128) for bk in (64, 128, 256)])
            print(f"rank_packed moe {kind} I={I} T={T} ideal {ideal:.1f} us: bf16 table {bf16:.1f} "
                  f"(split 2/4/8: {' / '.join(f'{t:.1f}' for t in bf16_split.values())}); "
                  f"{kind} table {table:.1f} ({ideal / table:.0%}); gate_up best " +
                  ", ".join(f"{n} {t:.1f}" for t, n, _ in res[:4]) + "; then down best " +
                  ", ".join(f"{n} {t:.1f} ({ideal / t:.0%})" for t, n, _ in res2[:3]), flush=True)
    if os.environ.get("PACKED_DENSE", "1") == "0":
        return
    shp = RANK_SHAPES["tp8"]
    for name, (n, k) in {"qkv": (shp["qkv"], 6144), "o_proj": (6144, shp["o_k"]),
                         "dense gate_up": (2 * shp["dense"], 6144),
                         "dense down": (6144, shp["dense"])}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        c, sc, _ = _packed_stack(w[None], "mxfp8")
        c, sc = c[0], sc[0]
        for T in (1, 4, 16):
            x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
            cub = bench(lambda: F.linear(x, w))
            table = bench(lambda: packed_matmul(x, c, sc, None, "mxfp8"))
            res = []
            for bn in (16, 32, 64):
                for bk in (128, 256, 512):
                    for wp in (4, 8):
                        cfg = {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": wp, "num_stages": 3}
                        try:
                            t = bench(lambda: packed_matmul(x, c, sc, None, "mxfp8", config=cfg))
                        except Exception:  # noqa: BLE001
                            t = float("inf")
                        res.append((t, f"n{bn} k{bk} w{wp}"))
            res.sort()
            print(f"rank_packed dense mxfp8 {name} N={n} K={k} T={T}: cuBLAS bf16 {cub:.1f} us, "
                  f"table {table:.1f} ({packed_config(T, n, k)['BLOCK_N']}x"
                  f"{packed_config(T, n, k)['BLOCK_K']}), best " +
                  ", ".join(f"{nm} {t:.1f}" for t, nm in res[:3]), flush=True)


# one TP 8 rank's dense products (N, K) at prefill: the fused qkv of a sparse layer, o_proj, the
# dense MLP's gate_up / down, and the shared expert's when it runs as a dense MLP (expert
# parallelism; otherwise it runs inside the fused MoE)
PREFILL_W8A8_SHAPES = {"qkv": (RANK_SHAPES["tp8"]["qkv"], 6144), "o_proj": (6144, RANK_SHAPES["tp8"]["o_k"]),
                       "dense gate_up": (2 * RANK_SHAPES["tp8"]["dense"], 6144),
                       "dense down": (6144, RANK_SHAPES["tp8"]["dense"]),
                       "shared gate_up": (2 * RANK_SHAPES["tp8"]["I"], 6144),
                       "shared down": (6144, RANK_SHAPES["tp8"]["I"])}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, N_FIRST]) tried beside each kernel's own
# table; W8A16's default grid walks the row blocks of a column tile first, N_FIRST the column
# tiles of a row block (as the W8A8 kernel does), which keeps the activation rows in L2
_W8A16_TILES = [(64, 128, 128, 8, 3, True), (128, 128, 64, 8, 3, False), (128, 128, 64, 8, 3, True),
                (128, 128, 128, 8, 3, True), (64, 256, 64, 8, 3, True)]
_W8A8_TILES = [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3),
               (64, 128, 128, 4, 4), (64, 256, 128, 8, 3), (128, 128, 64, 8, 4),
               (128, 128, 32, 8, 6), (256, 128, 128, 8, 3)]


def _prefill_time(fn) -> float:
    """Median µs of fn over ~100 ms (L2 flushed between calls, as a prefill step sees it)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _tiles(t) -> dict:
    cfg = {"BLOCK_M": t[0], "BLOCK_N": t[1], "BLOCK_K": t[2], "num_warps": t[3], "num_stages": t[4]}
    return {**cfg, "N_FIRST": t[5]} if len(t) > 5 else cfg


def _timed(timer, fn) -> tuple[float, str]:
    """(µs, "") or (inf, why) when fn fails to compile or run (out of resources etc.)."""
    try:
        return timer(fn), ""
    except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
        return float("inf"), f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def _checked(timer, fn, ref: torch.Tensor, tol: float = 2e-2) -> tuple[float, str]:
    """`_timed`, after checking fn's result against ref (max relative error within tol): a tile
    that computes a wrong product is reported, not timed."""
    try:
        err = _max_rel(fn(), ref)
    except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
        return float("inf"), f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    if not err <= tol:
        return float("inf"), f"wrong product: max rel err {err:.3g}"
    return _timed(timer, fn)


def prefill_w8a8_cases(shapes: dict, ms, device: str = "cuda", timer=None, sweep: bool = True) -> list[dict]:
    """One record per (shape, rows): W8A16 (`packed_matmul`, its table tiles and the best of
    `_W8A16_TILES`) against W8A8 (`mxfp8_w8a8_matmul`: the row quantiser + the FP8 GEMM, both
    counted; its table tiles and the best GEMM tiles of `_W8A8_TILES`), the quantiser alone,
    cuBLAS bf16 on the dequantised weight and, for scale, a per-channel FP8 GEMM
    (torch._scaled_mm, no block scales) as what FP8 tensor cores reach without them; and each
    path's max relative error against its reference (`w8a8_reference`; the bf16 product of the
    dequantised weight). On CPU (TRITON_INTERPRET=1, a fake timer) it checks the plumbing."""
    from m3serve.kernels.fused_moe import quant_rows_fp8
    from m3serve.kernels.mxfp8_w8a8 import mxfp8_w8a8_gemm, mxfp8_w8a8_matmul, w8a8_config
    from m3serve.kernels.packed_gemm import packed_config, packed_matmul
    from m3serve.kernels.ref import packed as rp
    timer = timer or _prefill_time
    records = []
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=device).manual_seed(n * 7 + k)
        codes, scales = rp.quantize_mxfp8(torch.randn(n, k, device=device, generator=g) * k ** -0.5)
        w_deq = rp.dequantize("mxfp8", codes, scales)                              # fp32 [N, K]
        w_bf16 = w_deq.to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            flop = 2.0 * m * n * k
            rec = {"shape": name, "N": n, "K": k, "M": m}
            ref8 = rp.w8a8_reference(x, codes, scales)
            ref16 = x.float() @ w_bf16.float().t()
            try:
                rec["max_rel_err_w8a16_vs_ref"] = _max_rel(packed_matmul(x, codes, scales, None, "mxfp8"), ref16)
                out8 = mxfp8_w8a8_matmul(x, codes, scales)
                rec["max_rel_err_w8a8_vs_ref"] = _max_rel(out8, ref8)
                rec["max_rel_err_w8a8_vs_w8a16_ref"] = _max_rel(out8, ref16)
                del out8
            except Exception as e:  # noqa: BLE001 - reported in the record, the timings still run
                rec["check_failed"] = f"{type(e).__name__}: {e}"[:300]
            cfg16 = {"table": None, **{str(t): _tiles(t) for t in (_W8A16_TILES if sweep else [])}}
            cfg8 = {"table": None, **{str(t): _tiles(t) for t in (_W8A8_TILES if sweep else [])}}
            xq, xs = quant_rows_fp8(x)
            t16 = {c: _checked(timer, lambda: packed_matmul(x, codes, scales, None, "mxfp8", config=cfg), ref16)
                   for c, cfg in cfg16.items()}
            t8 = {c: _checked(timer, lambda: mxfp8_w8a8_gemm(xq, xs, codes, scales, config=cfg), ref8)
                  for c, cfg in cfg8.items()}
            del ref8, ref16
            rec["errors"] = {f"{kind} {tile}": why for kind, d in (("w8a16", t16), ("w8a8", t8))
                             for tile, (_, why) in d.items() if why}
            best16 = min(t16, key=lambda c: t16[c][0])
            best8 = min(t8, key=lambda c: t8[c][0])
            quant = _timed(timer, lambda: quant_rows_fp8(x))[0]
            e2e_table = _timed(timer, lambda: mxfp8_w8a8_matmul(x, codes, scales))[0]
            e2e_best = _timed(timer, lambda: mxfp8_w8a8_matmul(x, codes, scales, config=cfg8[best8]))[0]
            rec.update({
                "w8a16_table_tiles": packed_config(m, n, k), "w8a8_table_tiles": w8a8_config(m, n, k),
                "w8a16_table_us": t16["table"][0], "w8a16_best_us": t16[best16][0], "w8a16_best_tiles": best16,
                "w8a8_quant_us": quant, "w8a8_gemm_table_us": t8["table"][0],
                "w8a8_gemm_best_us": t8[best8][0], "w8a8_best_tiles": best8,
                "w8a8_table_us": e2e_table, "w8a8_best_us": min(e2e_table, e2e_best),
                "w8a16_sweep_us": {c: v[0] for c, v in t16.items()},
                "w8a8_gemm_sweep_us": {c: v[0] for c, v in t8.items()},
            })
            rec["cublas_bf16_us"] = _timed(timer, lambda: F.linear(x, w_bf16))[0]
            rec["fp8_per_channel_scaled_mm_us"] = float("nan")
            if device == "cuda":
                from m3serve.kernels.ref.fused_moe import quant_weight_fp8
                wq, ws = quant_weight_fp8(w_bf16)
                rec["fp8_per_channel_scaled_mm_us"] = _timed(timer, lambda: torch._scaled_mm(
                    xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16))[0]
                del wq, ws
            for key in ("w8a16_best_us", "w8a8_best_us", "w8a8_gemm_best_us", "cublas_bf16_us"):
                rec[key.replace("_us", "_tflops")] = flop / rec[key] / 1e6 if rec[key] > 0 else 0.0
            rec["speedup_w8a8_over_w8a16"] = rec["w8a16_best_us"] / rec["w8a8_best_us"]
            rec["faster"] = "w8a8" if rec["w8a8_best_us"] < rec["w8a16_best_us"] else "w8a16"
            records.append(rec)
            print(f"prefill_w8a8 {name} N={n} K={k} M={m}: W8A16 table {rec['w8a16_table_us']:.1f} / best "
                  f"{rec['w8a16_best_us']:.1f} us {best16}; W8A8 quant {quant:.1f} + GEMM table "
                  f"{rec['w8a8_gemm_table_us']:.1f} / best {rec['w8a8_gemm_best_us']:.1f} {best8} -> "
                  f"end to end {e2e_table:.1f} / {e2e_best:.1f} us; cuBLAS bf16 {rec['cublas_bf16_us']:.1f}, "
                  f"fp8 per-channel {rec['fp8_per_channel_scaled_mm_us']:.1f}; max rel err W8A16 "
                  f"{rec.get('max_rel_err_w8a16_vs_ref', float('nan')):.2e}, W8A8 "
                  f"{rec.get('max_rel_err_w8a8_vs_ref', float('nan')):.2e} (vs the bf16-activation product "
                  f"{rec.get('max_rel_err_w8a8_vs_w8a16_ref', float('nan')):.2e})"
                  + (f"; CHECK FAILED {rec['check_failed']}" if "check_failed" in rec else "")
                  + (f"; failed tiles {rec['errors']}" if rec["errors"] else ""), flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    return records


def prefill_w8a8() -> None:
    """W8A16 against W8A8 for MXFP8 weights at one TP 8 rank's dense shapes, 512 / 2048 / 8192
    rows (`prefill_w8a8_cases`); a table at the end and, when $OUT is set, $OUT/prefill_w8a8.json."""
    import json
    import os
    records = prefill_w8a8_cases(PREFILL_W8A8_SHAPES, (512, 2048, 8192))
    print("\n| shape | N x K | M | W8A16 table / best µs | W8A8 quant + GEMM table / best µs (quant) "
          "| best W8A16 / best W8A8 | cuBLAS bf16 µs | max rel err W8A16 / W8A8 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['shape']} | {r['N']} x {r['K']} | {r['M']} | {r['w8a16_table_us']:.1f} / "
              f"{r['w8a16_best_us']:.1f} | {r['w8a8_table_us']:.1f} / {r['w8a8_best_us']:.1f} "
              f"({r['w8a8_quant_us']:.1f}) | {r['speedup_w8a8_over_w8a16']:.2f}x | "
              f"{r['cublas_bf16_us']:.1f} | {r.get('max_rel_err_w8a16_vs_ref', float('nan')):.1e} / "
              f"{r.get('max_rel_err_w8a8_vs_ref', float('nan')):.1e} |", flush=True)
    for m in sorted({r["M"] for r in records}):
        rows = [r for r in records if r["M"] == m]
        t16 = sum(r["w8a16_best_us"] for r in rows)
        t8 = sum(r["w8a8_best_us"] for r in rows)
        print(f"M={m}: all shapes W8A16 {t16:.1f} us, W8A8 {t8:.1f} us -> keep "
              f"{'W8A8' if t8 < t16 else 'W8A16'} ({t16 / t8:.2f}x)", flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "prefill_w8a8.json")
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "triton": triton.__version__,
                       "torch": torch.__version__, "records": records}, f, indent=1, default=str)
        print(f"wrote {path}", flush=True)

if __name__ == "__main__":
    todo = sys.argv[1:] or ["gemv", "attn", "moe"]
    for name in todo:
        globals()[name]()
