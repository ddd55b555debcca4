"""Training the embedded tiny MiniMax-M3 (`scripts/train_tiny.py` runs it, then the drafts):
the tiny model's architecture at wider widths (`TRAINED_WIDTHS`), the stored tokenizer, the
pinned corpus of `model/train_corpus.py`, and `model/trainable.py`'s forward.

Batches are windows of `seq_len + 1` tokens at seeded random offsets of the code stream (files
joined by the end-of-text marker), a `docs_fraction` of them from the docs stream. The loss is
next-token cross-entropy plus the indexers' KL loss; AdamW with linear warm-up and cosine decay;
the MoE routing biases follow the auxiliary-loss-free balancing rule. One seed, one thread
count and one machine give the same weights (the training forward avoids the CPU kernels whose
sums depend on thread timing: `model/trainable.py`).
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from m3serve.model.config import M3Config, canonical_shapes, parse_config
from m3serve.model.trainable import TrainableM3, init_weights

logger = logging.getLogger(__name__)

# the embedded tiny model's shape (model/tiny.py) at these widths: about 2.4M parameters
TRAINED_WIDTHS = {"hidden_size": 128, "intermediate_size": 128, "dense_intermediate_size": 384,
                  "shared_intermediate_size": 128}


def trained_config_dict() -> dict:
    """config.json of the trained tiny model: `tiny_config_dict` ("m3" flavor, the stored
    tokenizer's special ids) with `TRAINED_WIDTHS`."""
    from m3serve.model.tiny import TINY_VOCAB, tiny_config_dict
    from m3serve.model.tokenizer_build import SPECIAL_TOKENS

    names = list(SPECIAL_TOKENS)
    first = TINY_VOCAB - len(names)
    raw = tiny_config_dict(TINY_VOCAB, bos_token_id=first + names.index("bos"),
                           eos_token_id=first + names.index("eos"))
    raw["text_config"].update(TRAINED_WIDTHS)
    return raw


@dataclass(frozen=True)
class TrainSettings:
    """One training run's knobs (the defaults made the shipped model)."""
    seed: int = 0
    steps: int = 1500
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    docs_fraction: float = 0.1
    index_loss_weight: float = 1.0
    balance_rate: float = 1e-3
    log_every: int = 50

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.docs_fraction <= 1.0:
            raise ValueError(f"docs_fraction must be in [0, 1], got {self.docs_fraction!r}")


def token_stream(tokenizer, texts: list[str], separator: int) -> torch.Tensor:
    """texts -> one int64 stream [N], each text followed by `separator`."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids + [separator]
    return torch.tensor(ids, dtype=torch.int64)


class WindowSampler:
    """Seeded windows of `length` tokens from a code stream and a docs stream."""

    def __init__(self, code: torch.Tensor, docs: torch.Tensor, length: int, docs_fraction: float, seed: int):
        for what, stream in (("code", code), ("docs", docs)):
            if stream.numel() <= length:
                raise ValueError(f"the {what} stream has {stream.numel()} tokens, fewer than a window of {length + 1}")
        self.code, self.docs, self.length, self.docs_fraction = code, docs, length, docs_fraction
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, size: int) -> torch.Tensor:
        """-> [size, length] int64."""
        from_docs = torch.rand(size, generator=self.gen) < self.docs_fraction
        rows = []
        for d in from_docs.tolist():
            stream = self.docs if d else self.code
            start = int(torch.randint(0, stream.numel() - self.length, (1,), generator=self.gen))
            rows.append(stream[start:start + self.length])
        return torch.stack(rows)


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    done = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))


def train_target(cfg: M3Config, sampler: WindowSampler, s: TrainSettings) -> tuple[TrainableM3, dict]:
    """Train the tiny model from its seeded initialisation -> (model, report: losses, timing)."""
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    model = TrainableM3(cfg, init_weights(canonical_shapes(cfg), cfg.num_hidden_layers, gen))
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    curve, start, window = [], time.perf_counter(), []
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        batch = sampler.batch(s.batch_size)                                       # [B, seq_len + 1]
        out = model(batch[:, :-1])
        lm = F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1))
        loss = lm + s.index_loss_weight * out.stats.index_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.w.balance_experts_(out.stats.expert_load, s.balance_rate)
        window.append(lm.item())
        if (step + 1) % s.log_every == 0 or step + 1 == s.steps:
            mean = sum(window) / len(window)
            curve.append({"step": step + 1, "loss": round(mean, 4), "index_loss": round(out.stats.index_loss.item(), 4),
                          "seconds": round(time.perf_counter() - start, 1)})
            logger.info("step %d/%d: loss %.3f, index KL %.3f, %.0f s", step + 1, s.steps, mean,
                        out.stats.index_loss.item(), time.perf_counter() - start)
            window = []
    return model, {"settings": asdict(s), "curve": curve, "seconds": round(time.perf_counter() - start, 1),
                   "final_loss": curve[-1]["loss"]}


@torch.no_grad()
def perplexity(model: TrainableM3, ids: torch.Tensor, window: int) -> float:
    """exp(mean next-token NLL) over consecutive windows of `window` tokens of ids [N] (each
    window scored from its own start; the tail that fills no window is dropped)."""
    n = (ids.numel() - 1) // window
    if n < 1:
        raise ValueError(f"{ids.numel()} tokens do not fill one window of {window + 1}")
    rows = torch.stack([ids[i * window:(i + 1) * window + 1] for i in range(n)])
    logits = model(rows[:, :-1]).logits
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item())


def write_target(out_dir: Path, raw: dict, weights: dict[str, torch.Tensor]) -> Path:
    """The checkpoint in the embedded model's format: config.json, generation_config.json (its
    sampling default: greedy), model.safetensors (original names, bf16 with fp32 routers), the
    stored tokenizer."""
    from safetensors.torch import save

    from m3serve.model.tokenizer_build import write_tiny_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(out)
    tensors = {"language_model." + k: v for k, v in weights.items()}
    (out / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    text = raw["text_config"]
    # greedy unless a request says otherwise: at temperature 1 a model this small writes near-words
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "temperature": 0.0},
        indent=2) + "\n")
    parse_config(raw)                 # the written config is one the engine reads
    from m3serve.model.tokenizer_build import special_token_ids
    ids = special_token_ids(out)
    if (ids["bos"], ids["eos"]) != (text["bos_token_id"], text["eos_token_id"]):
        raise RuntimeError(f"config's bos/eos ids {text['bos_token_id']}/{text['eos_token_id']} are not "
                           f"the tokenizer's {ids['bos']}/{ids['eos']}")
    return out
