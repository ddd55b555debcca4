"""Distilling MiniMax-M3 MTP modules for a target from its own greedy sequences (the trained
tiny model's MTP draft, `scripts/train_tiny.py`).

Module m's forward is `spec_decode/mtp.py`'s, written over canonical tensors with
`model/trainable.py`'s decoder layer (MSA + MoE, the indexer trained by its own loss):
  e = embed(token[p + 1]) (0 at position 0), z = eh_proj([enorm(e), hnorm(h_prev[p])]),
  h_new = layer(z), logits = lm_head(final_layernorm(h_new)) -> token p + 2,
with the target's embedding and head frozen. The proposer chains module 0 on its own output:
draft step j at position p reads the step before's h_new at p - 1 (the target's final hidden
state at p for j = 0), so training unrolls the same chain over whole sequences, each step with
dense causal attention over its own states (at serving time the keys of earlier positions are
the first pass's, a close match). The module starts from the target's last MSA + MoE layer
(`initial_tensors`).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from m3serve.model.reference import gemma_rms_norm, rope_cos_sin

logger = logging.getLogger(__name__)

PREFIX = "model.mtp.layers.0."


def _module_forward(w, cfg, embeds: torch.Tensor, h_prev: torch.Tensor, stats) -> torch.Tensor:
    """embeds, h_prev: [B, T, H] at positions 0 .. T - 1 -> h_new [B, T, H]."""
    from m3serve.model.trainable import decoder_layer

    B, T, _ = embeds.shape
    eps = cfg.rms_norm_eps
    z = torch.cat([gemma_rms_norm(embeds, w[PREFIX + "enorm.weight"], eps),
                   gemma_rms_norm(h_prev, w[PREFIX + "hnorm.weight"], eps)], dim=-1) @ w[PREFIX + "eh_proj.weight"].t()
    cos, sin = rope_cos_sin(cfg, torch.arange(T).repeat(B), z.dtype)
    return decoder_layer(w, PREFIX + "transformer_layer.", cfg, z, cos, sin, True, True, stats)


def initial_tensors(cfg, target: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The module's starting point: its decoder layer a copy of the target's last MSA + MoE layer,
    its final norm the target's, `eh_proj` passing the hidden half through (plus a little of the
    embedding half), enorm and hnorm at 0 (Gemma: scale 1)."""
    from m3serve.model.trainable import init_weights, mtp_layer_shapes

    out = init_weights(mtp_layer_shapes(cfg, PREFIX), 1, gen)
    source = max(i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i) and cfg.is_moe(i))
    layer = f"model.layers.{source}."
    for name in list(out):
        if name.startswith(PREFIX + "transformer_layer."):
            out[name] = target[layer + name[len(PREFIX + "transformer_layer."):]].clone()
    out[PREFIX + "final_layernorm.weight"] = target["model.norm.weight"].clone()
    H = cfg.hidden_size
    out[PREFIX + "eh_proj.weight"] = torch.cat([0.1 * out[PREFIX + "eh_proj.weight"][:, :H], torch.eye(H)], dim=1)
    return out


def distill_mtp(target_dir: Path, data, epochs: int, seed: int = 0, unroll: int = 3, batch_size: int = 32,
                lr: float = 2e-3, balance_rate: float = 1e-3, head_fraction: float = 0.25
                ) -> tuple[dict[str, torch.Tensor], dict]:
    """Train one MTP module on `data` (`draft_data.TargetFeatures`: tokens and final hidden
    states, T a multiple of the index block size) -> (its tensors in the standalone checkpoint's
    names, bf16 with fp32 routers; report). The loss of each step is taken at a random
    `head_fraction` of the positions (the head is most of the cost)."""
    from m3serve.model.config import load_config
    from m3serve.model.trainable import ForwardStats, ParamStore, read_canonical

    cfg = load_config(target_dir)
    tokens, hidden = data.tokens, data.hidden                                # [N, T], [N, T, H]
    N, T = tokens.shape
    if T % cfg.index_block_size or T < unroll + 2:
        raise ValueError(f"sequence length {T}: must be a multiple of {cfg.index_block_size} and >= unroll + 2")
    target = read_canonical(target_dir)
    embed, head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    gen = torch.Generator().manual_seed(seed)
    store = ParamStore(initial_tensors(cfg, target, gen))
    params = [p for p in store.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = epochs * -(-N // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / total_steps)))
    # the embedding of token p + 1 at position p (zeros past the end; 0 at position 0 as served)
    nxt = torch.cat([embed[tokens[:, 1:]], torch.zeros(N, 1, embed.shape[1])], dim=1)       # [N, T, H]
    first = nxt.clone()
    first[:, 0] = 0.0
    labels = torch.cat([data.next_ids[:, 1:], torch.full((N, 1), -100)], dim=1)             # token p + 2
    eps = cfg.rms_norm_eps
    curve = []
    for epoch in range(epochs):
        perm, total, count = torch.randperm(N, generator=gen), 0.0, 0
        for i in range(0, N, batch_size):
            idx = perm[i:i + batch_size]
            stats, loss, h_prev = ForwardStats(), 0.0, hidden[idx]
            for j in range(unroll):
                h_new = _module_forward(store, cfg, first[idx] if j == 0 else nxt[idx], h_prev, stats)
                lab = labels[idx].clone()
                lab[:, :j] = -100                       # step j starts at position j
                # the head over a sample of the positions (the layer ran over all of them)
                rows = (lab.reshape(-1) != -100).nonzero()[:, 0]
                rows = rows[torch.randperm(rows.numel(), generator=gen)[:int(rows.numel() * head_fraction)]]
                h = gemma_rms_norm(h_new.reshape(-1, h_new.shape[-1])[rows], store[PREFIX + "final_layernorm.weight"], eps)
                loss = loss + F.cross_entropy(h @ head.t(), lab.reshape(-1)[rows])
                # step j + 1 at position p reads step j's h_new at p - 1
                h_prev = torch.cat([torch.zeros_like(h_new[:, :1]), h_new[:, :-1]], dim=1)
            opt.zero_grad(set_to_none=True)
            (loss + stats.index_loss).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            store.balance_experts_(stats.expert_load, balance_rate)
            total, count = total + loss.item() / unroll, count + 1
        curve.append(round(total / count, 4))
        logger.info("MTP epoch %d: loss per step %.3f", epoch, curve[-1])
    return store.export(), {"epochs": epochs, "unroll": unroll, "loss_per_step": curve}


def write_mtp_bundled(target_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Bundle the module into the target checkpoint: `mtp.safetensors` (prefix
    `language_model.`) and `num_mtp_modules` in config.json's text_config, as MiniMax-M3 ships it."""
    import json

    from safetensors.torch import save

    target_dir = Path(target_dir)
    (target_dir / "mtp.safetensors").write_bytes(
        save({"language_model." + k: v for k, v in tensors.items()}, metadata={"format": "pt"}))
    raw = json.loads((target_dir / "config.json").read_text())
    raw["text_config"]["num_mtp_modules"] = 1 + max(int(k.split(".")[3]) for k in tensors)
    (target_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
