"""Distilling an EAGLE3 draft from a target's own greedy outputs (`m3serve make-tiny DIR --draft
eagle3 --train-steps N`, and the trained tiny model's draft in `scripts/train_tiny.py`), so that
the draft accepts tokens for real.

Data (`distill/draft_data.py`): greedy continuations by the engine, of random prompts or of given
ones. For every position t of a sequence the target's tapped streams are recorded; the draft
learns to predict token t + 2 from (taps at t, token t + 1) -- and, unrolled as at inference,
token t + 2 + j from its own hidden state of step j - 1 -- with dense causal attention over the
sequence. The training forward uses the engine's `Eagle3Draft` parameters and RoPE, so the
weights it writes mean the same when served. The draft vocabulary is the target's most frequent
greedy tokens in the data (`d2t`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _dense_forward(draft, embed, g: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft layer over a batch of sequences with dense causal attention: embed, g: [B, L, H]."""
    from m3serve.layers.rotary import apply_rotary

    B, L, D = g.shape[0], g.shape[1], draft.cfg.head_dim
    a, b = draft.input_layernorm(embed), draft.hidden_norm(g)
    residual = b if draft.cfg.norm_before_residual else g
    q, k, v = draft.qkv_proj(torch.cat([a, b], dim=-1).reshape(B * L, -1))
    cos, sin = draft.rotary.cos_sin(positions.repeat(B), g.dtype)
    q = apply_rotary(q.view(B * L, draft.num_heads, D), cos, sin).view(B, L, -1, D).transpose(1, 2)
    k = apply_rotary(k.view(B * L, draft.num_kv_heads, D), cos, sin).view(B, L, -1, D).transpose(1, 2)
    v = v.view(B, L, -1, D).transpose(1, 2)
    rep = draft.num_heads // draft.num_kv_heads
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                       is_causal=True).transpose(1, 2).reshape(B, L, -1)
    x = draft.o_proj(o) + residual
    gate, up = draft.gate_up_proj(draft.post_attention_layernorm(x)).chunk(2, dim=-1)
    prenorm = draft.down_proj(F.silu(gate) * up) + x
    return draft.norm(prenorm), prenorm


def random_prompt_features(target_dir: Path, taps: tuple[int, ...], num: int, prompt_len: int,
                           new_tokens: int, seed: int):
    """The target's greedy continuations of `num` random-token prompts and its features over
    them (the data of `make-tiny --draft eagle3 --train-steps N`)."""
    from m3serve.model.config import load_config
    from m3serve.distill.draft_data import greedy_sequences, target_features

    g = torch.Generator().manual_seed(seed)
    vocab = load_config(target_dir).vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(num)]
    return target_features(target_dir, greedy_sequences(target_dir, prompts, new_tokens), taps)


def distill_eagle3(draft_dir: Path, target_dir: Path, steps: int, seed: int = 0,
                   num_sequences: int = 512, prompt_len: int = 16, new_tokens: int = 48,
                   batch_size: int = 32, data=None, unroll: int = 2, lr: float = 3e-3) -> dict:
    """Train the draft in `draft_dir` (written by `make_draft`) in place for `steps` epochs;
    returns the loss curve's ends and the draft vocabulary's coverage of the data.
    `data`: `draft_data.TargetFeatures` with the draft's taps (default: greedy continuations of
    `num_sequences` random prompts). `unroll`: draft steps trained per position, each on the
    previous one's hidden state, as the proposer chains them."""
    from m3serve.distributed import GroupInfo
    from m3serve.model.config import load_config
    from m3serve.model.loader import load_model
    from m3serve.spec_decode.eagle3 import Eagle3Draft, load_eagle3_config

    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    torch.manual_seed(seed)
    target_cfg = load_config(target_dir)
    cfg = load_eagle3_config(draft_dir, target_cfg)
    if data is None:
        data = random_prompt_features(target_dir, cfg.aux_layer_ids, num_sequences, prompt_len, new_tokens, seed)
    taps = data.tap_streams(cfg.aux_layer_ids)                              # [N, T, 3H]
    tokens = data.tokens                                                     # [N, T]
    # draft vocabulary: the tokens the target emits most often in the data
    counts = torch.bincount(data.next_ids.reshape(-1), minlength=cfg.vocab_size)
    draft_ids = counts.argsort(descending=True, stable=True)[:cfg.draft_vocab_size].sort().values
    to_draft = torch.full((cfg.vocab_size,), -100, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(cfg.draft_vocab_size)
    target, _, _ = load_model(target_dir, dtype="float32", progress=False)
    embed = target.model.embed_tokens
    draft = Eagle3Draft(cfg, GroupInfo(), torch.float32, own_lm_head=True, own_embedding=False)
    for p in draft.parameters():
        if p.dtype.is_floating_point:
            torch.nn.init.normal_(p, 0.0, 1.0 / p.shape[-1] ** 0.5) if p.dim() > 1 else torch.nn.init.ones_(p)
            p.requires_grad_(True)
    params = [p for p in draft.parameters() if p.dtype.is_floating_point]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, steps))
    with torch.no_grad():
        embeds = embed(tokens.reshape(-1)).view(*tokens.shape, -1)           # [N, T, H]
    N, L = tokens.shape[0], tokens.shape[1] - unroll       # base positions t in [0, L)
    pos = torch.arange(L)
    losses = []
    for step in range(steps):
        perm, total = torch.randperm(N), 0.0
        for i in range(0, N, batch_size):
            idx = perm[i:i + batch_size]
            nxt, emb = data.next_ids[idx], embeds[idx]
            hidden, loss = draft.combine(taps[idx][:, :L]), 0.0
            # step j at base position t: token t + 1 + j at position t + j -> the target's token
            # after it, its hidden input the previous step's prenorm (the taps for j = 0)
            for j in range(unroll):
                out, hidden = _dense_forward(draft, emb[:, 1 + j:L + 1], hidden[:, :L - j], pos[j:])
                loss = loss + F.cross_entropy(draft.lm_head.local_logits(out.reshape(-1, out.shape[-1])),
                                              to_draft[nxt[:, 1 + j:L + 1]].reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        sched.step()
        losses.append(total / N)
        logger.info("distill epoch %d: loss %.3f", step, losses[-1])
    _save_eagle3(draft, draft_ids, cfg, draft_dir / "model.safetensors")
    coverage = float(counts[draft_ids].sum() / counts.sum())
    return {"first_loss": losses[0], "last_loss": losses[-1], "draft_vocab_coverage": coverage}


def _save_eagle3(draft, draft_ids: torch.Tensor, cfg, path: Path) -> None:
    from safetensors.torch import save_file

    D = cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    w = {n: p.detach().to(torch.bfloat16) for n, p in draft.named_parameters() if p.dtype.is_floating_point}
    qkv = w.pop("qkv_proj.weight")
    gate, up = w.pop("gate_up_proj.weight").chunk(2, dim=0)
    out = {"fc.weight": w["fc.weight"], "norm.weight": w["norm.weight"], "lm_head.weight": w["lm_head.weight"],
           "midlayer.self_attn.q_proj.weight": qkv[:q_rows], "midlayer.self_attn.k_proj.weight": qkv[q_rows:q_rows + kv_rows],
           "midlayer.self_attn.v_proj.weight": qkv[q_rows + kv_rows:], "midlayer.self_attn.o_proj.weight": w["o_proj.weight"],
           "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
           "midlayer.mlp.down_proj.weight": w["down_proj.weight"]}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{norm}.weight"] = w[f"{norm}.weight"]
    out["d2t"] = (draft_ids - torch.arange(cfg.draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    out["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in out.items()}, str(path), metadata={"format": "pt"})
