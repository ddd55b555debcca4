"""Sharding: the tiny checkpoint loaded as 2 and 4 ranks in one process, with and without expert
parallelism; every shard has its expected shape and the shards reassemble to the full weights."""
import pytest
import torch

from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.model.loader import load_model
from refgreedy import canonical_weights


@pytest.fixture(scope="module")
def full(tiny_dir):
    return canonical_weights(tiny_dir)


def shards(tiny_dir, tp, ep=False):
    return [dict(load_model(tiny_dir, dtype="float32", parallel=ParallelInfo(GroupInfo(r, tp), enable_expert_parallel=ep),
                            progress=False)[0].named_parameters())
            for r in range(tp)]


@pytest.mark.parametrize("tp,ep", [(2, False), (4, False), (2, True), (4, True)])
def test_shards_reassemble(tiny_dir, full, tp, ep):
    ranks = shards(tiny_dir, tp, ep)
    cfg = load_model(tiny_dir, progress=False)[1]
    D, G, Hq = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    kv_local = max(1, G // tp)
    for i in range(cfg.num_hidden_layers):
        p, c = f"model.layers.{i}.", f"model.layers.{i}."
        qkv = [r[p + "self_attn.qkv_proj.weight"] for r in ranks]
        q_rows, kv_rows = Hq // tp * D, kv_local * D
        idx_rows = (kv_local * D + D) if cfg.is_sparse(i) else 0  # index_q (like KV) + index_k
        assert all(w.shape == (q_rows + 2 * kv_rows + idx_rows, cfg.hidden_size) for w in qkv)
        assert torch.equal(torch.cat([w[:q_rows] for w in qkv]), full[c + "self_attn.q_proj.weight"])
        # KV heads: split when TP <= KV heads, replicated (rank // (TP / G)) beyond
        owner = [r * G // tp if tp > G else r for r in range(tp)]
        k_full = full[c + "self_attn.k_proj.weight"].view(G, D, -1)
        for r, w in enumerate(qkv):
            k = w[q_rows:q_rows + kv_rows].view(kv_local, D, -1)
            first = owner[r] * kv_local if tp <= G else owner[r]
            assert torch.equal(k, k_full[first:first + kv_local])
        if cfg.is_sparse(i):
            for w in qkv:  # the single index-key head is replicated on every rank
                assert torch.equal(w[-D:], full[c + "self_attn.index_k_proj.weight"])
        o = torch.cat([r[p + "self_attn.o_proj.weight"] for r in ranks], dim=1)
        assert torch.equal(o, full[c + "self_attn.o_proj.weight"])
        if cfg.is_moe(i):
            E, I = cfg.num_local_experts, cfg.intermediate_size
            if ep:   # whole experts, E / TP per rank
                w13 = torch.cat([r[p + "mlp.experts.w13"] for r in ranks])
                w2 = torch.cat([r[p + "mlp.experts.w2"] for r in ranks])
                assert ranks[0][p + "mlp.experts.w13"].shape == (E // tp, 2 * I, cfg.hidden_size)
            else:    # every expert, I / TP intermediate channels per rank (gate rows, then up rows)
                il = I // tp
                assert ranks[0][p + "mlp.experts.w13"].shape == (E, 2 * il, cfg.hidden_size)
                w13 = torch.cat([torch.cat([r[p + "mlp.experts.w13"][:, :il] for r in ranks], dim=1),
                                 torch.cat([r[p + "mlp.experts.w13"][:, il:] for r in ranks], dim=1)], dim=1)
                w2 = torch.cat([r[p + "mlp.experts.w2"] for r in ranks], dim=2)
            for e in range(E):
                m = f"{c}block_sparse_moe.experts.{e}."
                assert torch.equal(w13[e], torch.cat([full[m + "w1.weight"], full[m + "w3.weight"]]))
                assert torch.equal(w2[e], full[m + "w2.weight"])
            for r in ranks:
                assert torch.equal(r[p + "mlp.gate.weight"], full[c + "block_sparse_moe.gate.weight"])
            mlp, src = p + "mlp.shared_experts.", c + "block_sparse_moe.shared_experts."
        else:
            mlp, src = p + "mlp.", c + "mlp."
        gate_up = [r[mlp + "gate_up_proj.weight"] for r in ranks]
        half = gate_up[0].shape[0] // 2
        assert torch.equal(torch.cat([w[:half] for w in gate_up]), full[src + "gate_proj.weight"])
        assert torch.equal(torch.cat([w[half:] for w in gate_up]), full[src + "up_proj.weight"])
        down = torch.cat([r[mlp + "down_proj.weight"] for r in ranks], dim=1)
        assert torch.equal(down, full[src + "down_proj.weight"])
    for name in ("lm_head.weight", "model.embed_tokens.weight"):   # vocabulary rows split
        rows = -(-cfg.vocab_size // tp)
        assert all(r[name].shape == (rows, cfg.hidden_size) for r in ranks)
        assert torch.equal(torch.cat([r[name] for r in ranks])[:cfg.vocab_size], full[name])
