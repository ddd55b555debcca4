"""Distilling a DSpark draft for a target from its own greedy sequences (the trained tiny model's
`dspark/` folder, `scripts/train_tiny.py`).

The forward is `spec_decode/dspark.py`'s, written over canonical tensors for a batch of anchors: the
context K/V of every position from `hidden_norm(fc(taps))` (no input norm), and for an anchor at
position a the query block [token a, noise x (k - 1)] at positions a .. a + k - 1, whose queries
see every block key and the context keys at positions <= a - 1 inside the sliding window; the
target's head on the final norm, plus the Markov head's bias from the previous token. Draft i
learns the target's greedy token after position a + i with the true previous token fed to the
Markov head (at serving time, its own draft, equal whenever the draft before was accepted).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from m3serve.model.reference import apply_rope, gemma_rms_norm, rope_cos_sin, swiglu_oai

logger = logging.getLogger(__name__)

_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _heads(x: torch.Tensor, n: int, norm: torch.Tensor, eps: float, cos, sin) -> torch.Tensor:
    """x [M, n * D] -> per-head Gemma norm and RoPE -> [M, n, D] (cos, sin: [M, rotary / 2])."""
    return apply_rope(gemma_rms_norm(x.view(x.shape[0], n, -1), norm, eps), cos, sin)


def dspark_forward(w, cfg, rope_cfg, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                   embed: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """taps [B, T, n x H], tokens [B, T], anchors [B, A] (positions >= 1, <= T - k) -> logits of
    the k drafts [B, A, k, V] (Markov bias from the sequence's own previous tokens)."""
    B, T, _ = taps.shape
    A, k, D = anchors.shape[1], cfg.block_size, cfg.head_dim
    Hq, G, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    main = gemma_rms_norm(taps @ w["fc.weight"].t(), w["hidden_norm.weight"], eps).reshape(B * T, -1)
    ctx_cos, ctx_sin = rope_cos_sin(rope_cfg, torch.arange(T).repeat(B), main.dtype)
    offs = torch.arange(k)
    qpos = anchors[..., None] + offs                                                # [B, A, k]
    cos, sin = rope_cos_sin(rope_cfg, qpos.reshape(-1), main.dtype)
    block = torch.full((B, A, k), cfg.noise_token_id, dtype=torch.int64)
    block[..., 0] = tokens.gather(1, anchors)
    x = embed[block].reshape(B * A * k, -1)                                         # [M, H]
    kpos = torch.arange(T)
    # context key p is visible to the query at q of anchor a iff p <= a - 1 and p >= q - (W - 1)
    visible = (kpos <= anchors[..., None, None] - 1) & (kpos >= qpos[..., None] - (cfg.sliding_window - 1))
    group = torch.arange(Hq) // (Hq // G)
    for l in range(cfg.num_layers):
        p = f"layers.{l}.decoder_layer."
        a = p + "self_attn."
        ck = _heads(main @ w[a + "k_proj.weight"].t(), G, w[a + "k_norm.weight"], eps, ctx_cos, ctx_sin)
        ck = ck.view(B, T, G, D)[:, :, group]                                           # [B, T, Hq, D]
        cv = (main @ w[a + "v_proj.weight"].t()).view(B, T, G, D)[:, :, group]
        xn = gemma_rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = _heads(xn @ w[a + "q_proj.weight"].t(), Hq, w[a + "q_norm.weight"], eps, cos, sin).view(B, A, k, Hq, D)
        bk = _heads(xn @ w[a + "k_proj.weight"].t(), G, w[a + "k_norm.weight"], eps, cos, sin).view(B, A, k, G, D)
        bv = (xn @ w[a + "v_proj.weight"].t()).view(B, A, k, G, D)
        bk, bv = bk[:, :, :, group], bv[:, :, :, group]                                # [B, A, k, Hq, D]
        s_ctx = torch.einsum("baqhd,bthd->baqht", q, ck).masked_fill(~visible[:, :, :, None, :], -math.inf)
        s_blk = torch.einsum("baqhd,bajhd->baqhj", q, bk)
        probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1) / math.sqrt(D), dim=-1)
        o = torch.einsum("baqht,bthd->baqhd", probs[..., :T], cv) + torch.einsum("baqhj,bajhd->baqhd", probs[..., T:], bv)
        x = x + o.reshape(B * A * k, Hq * D) @ w[a + "o_proj.weight"].t()
        xn = gemma_rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        h = swiglu_oai(xn @ w[p + "mlp.gate_proj.weight"].t(), xn @ w[p + "mlp.up_proj.weight"].t(),
                       cfg.swiglu_alpha, cfg.swiglu_limit)
        x = x + h @ w[p + "mlp.down_proj.weight"].t()
    base = gemma_rms_norm(x, w["final_norm.weight"], eps) @ head.t()                 # [M, V]
    prev = tokens.gather(1, qpos.reshape(B, -1)).reshape(-1)                        # token at a + i
    markov = F.embedding(prev, w["markov_head.markov_w1.weight"]) @ w["markov_head.markov_w2.weight"].t()
    return (base + markov).view(B, A, k, -1)


def distill_dspark(draft_dir: Path, target_dir: Path, data, epochs: int, seed: int = 0, anchors_per_seq: int = 16,
                   batch_size: int = 8, lr: float = 2e-3, position_decay: float = 0.7) -> dict:
    """Train the DSpark draft in `draft_dir` (its config.json written by `make_draft(...,
    "dspark")`) on `data` (`draft_data.TargetFeatures` with the draft's taps) and write its
    weights there (MXFP8 projections when its config says so); returns the loss curve. Draft i's
    loss weighs `position_decay` ** i (normalised)."""
    from m3serve.model.config import load_config
    from m3serve.model.trainable import ParamStore, init_weights, read_canonical
    from m3serve.spec_decode.dspark import dspark_shapes, load_dspark_config

    target_cfg = load_config(target_dir)
    cfg = load_dspark_config(draft_dir, target_cfg)
    rope_cfg = dataclasses.replace(target_cfg, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, rope_yarn=None)
    target = read_canonical(target_dir, ("model.embed_tokens.weight", "lm_head.weight"))
    embed, head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    shapes = {n: s for n, s in dspark_shapes(cfg, target_cfg.hidden_size).items() if not n.endswith("_scale_inv")}
    store = ParamStore(init_weights(shapes, cfg.num_layers, torch.Generator().manual_seed(seed)))
    params = [p for p in store.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    taps = data.tap_streams(tuple(i + 1 for i in cfg.target_layer_ids))          # [N, T, n x H]
    tokens, nxt = data.tokens, data.next_ids
    N, T, k = tokens.shape[0], tokens.shape[1], cfg.block_size
    if T < k + 2:
        raise ValueError(f"sequences of {T} tokens are too short for DSpark blocks of {k}")
    total_steps = epochs * -(-N // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / total_steps)))
    gen = torch.Generator().manual_seed(seed + 1)
    # draft i counts only when drafts 0 .. i - 1 were accepted: later positions weigh less
    weights = position_decay ** torch.arange(k, dtype=torch.float32)
    weights = weights / weights.sum()
    curve = []
    for epoch in range(epochs):
        perm, total, count = torch.randperm(N, generator=gen), 0.0, 0
        for i in range(0, N, batch_size):
            idx = perm[i:i + batch_size]
            anchors = torch.randint(1, T - k + 1, (len(idx), anchors_per_seq), generator=gen)   # [B, A]
            logits = dspark_forward(store, cfg, rope_cfg, taps[idx], tokens[idx], anchors, embed, head)
            labels = nxt[idx].gather(1, (anchors[..., None] + torch.arange(k)).reshape(len(idx), -1))
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
            loss = (nll.view(len(idx), anchors_per_seq, k) * weights).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            total, count = total + loss.item(), count + 1
        curve.append(round(total / count, 4))
        logger.info("DSpark epoch %d: loss %.3f", epoch, curve[-1])
    _save(store.export(), cfg, draft_dir)
    return {"epochs": epochs, "loss": curve}


def _save(tensors: dict[str, torch.Tensor], cfg, draft_dir: Path) -> None:
    from safetensors.torch import save

    from m3serve.kernels.ref.packed import quantize_mxfp8
    from m3serve.spec_decode.dspark import PREFIX

    out = {}
    for name, t in tensors.items():
        if cfg.quant == "mxfp8" and name.startswith("layers.") and name.rsplit(".", 1)[0].endswith(_PROJ):
            codes, scales = quantize_mxfp8(t.float())
            out[PREFIX + name], out[PREFIX + name[:-len("weight")] + "weight_scale_inv"] = codes, scales
        else:
            out[PREFIX + name] = t
    Path(draft_dir, "model.safetensors").write_bytes(save({k: v.contiguous() for k, v in out.items()},
                                                          metadata={"format": "pt"}))
