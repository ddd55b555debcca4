"""The proposer: loads a draft (EAGLE3 head or MTP modules), owns its cache group(s), and after
each step proposes k draft tokens per request.

After a step the proposer runs the draft over every token the target just processed (its
"first pass": at position t the draft sees token t+1, so it needs the step's verified tokens;
the first pass also writes the draft's KV for every position, prompt chunks included), then
k - 1 one-token steps per request, each at the next position, feeding the previous step's draft
hidden state. Draft tokens are the draft's argmax. The draft's caches use the engine's block
ids (block b is page b of every group), so they are allocated, prefix-cached and freed with the
target's; KV it writes past the verified tokens is rewritten by a later first pass.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from m3serve.core.kv_cache.specs import CacheGroupSpec
from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.layers.attention_metadata import AttentionMetadata
from m3serve.model.config import M3Config
from m3serve.worker.attn_metadata import positions_and_slots

logger = logging.getLogger(__name__)


@dataclass
class StepForDraft:
    """What the proposer needs of one target step (flattened tokens T, requests R)."""
    input_ids: torch.Tensor        # [T] the step's input tokens
    positions: torch.Tensor        # [T] int64
    meta: AttentionMetadata        # the target step's metadata (reused by the first pass)
    hidden: torch.Tensor           # [T, 3H] taps (EAGLE3) or [T, H] final hidden states (MTP)
    last_index: torch.Tensor       # [R] int64: each request's last verified position in the step
    last_token: torch.Tensor       # [R] int64: the token after it (emitted, or the next prompt token)
    last_position_cpu: list[int]   # [R] positions of last_index, for host-side bounds
    block_tables: torch.Tensor     # [R, W] int32


class Proposer:
    def __init__(self, spec, target, target_cfg: M3Config, target_dir: Path, parallel: ParallelInfo,
                 device: torch.device, load_format: str, seed: int, max_model_len: int):
        self.method, self.k = spec.method, spec.num_speculative_tokens
        self.target, self.target_cfg, self.device = target, target_cfg, device
        self.max_model_len = max_model_len
        self.block_size = target_cfg.index_block_size
        draft_tp = spec.draft_tensor_parallel_size or parallel.tp.size
        if draft_tp not in (1, parallel.tp.size):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1 or the target's "
                             f"tensor_parallel_size {parallel.tp.size}, got {draft_tp}")
        tp = parallel.tp if draft_tp > 1 else GroupInfo()
        dtype = target.dtype
        if self.method == "eagle3":
            self.draft, self.taps = _load_eagle3(spec.model, target_cfg, tp, dtype, device, load_format, seed)
        else:
            if parallel.dp.size > 1:
                raise ValueError("MTP drafting with data_parallel_size > 1 is not supported (its MoE "
                                 "layers would need the replicas' lock step); use EAGLE3")
            if draft_tp != parallel.tp.size:
                raise ValueError("MTP modules are split like the target: draft_tensor_parallel_size "
                                 "must equal tensor_parallel_size")
            self.draft = _load_mtp(spec.model, target_dir, target_cfg, self.k, parallel, dtype, device,
                                   load_format, seed)
            self.taps = ()
        logger.info("speculative decoding: %s, %d draft tokens per step, %s", self.method, self.k,
                    spec.rejection_sample_method)
        if spec.not_applicable:
            logger.info("speculative_config keys not applicable here, ignored: %s", spec.not_applicable)
        if spec.rejection_sample_method == "synthetic":
            logger.warning("SYNTHETIC ACCEPTANCE: drafts are accepted by a fixed rule with mean %.2f "
                           "tokens per verify step, NOT by the model; outputs are not the model's. "
                           "For benchmarks only.", spec.synthetic_acceptance_length)

    # ------------------------------------------------------------ caches

    def cache_specs(self, kv_bytes: int, index_bytes: int) -> list[CacheGroupSpec]:
        D = self.target_cfg.head_dim
        if self.method == "eagle3":
            d = self.draft
            return [CacheGroupSpec("draft", (0,), 2 * d.num_kv_heads * d.cfg.head_dim * kv_bytes)]
        layers = tuple(range(len(self.draft.modules_)))
        kv_heads = self.draft.attention_layers[0].num_kv_heads
        return [CacheGroupSpec("mtp", layers, 2 * kv_heads * D * kv_bytes),
                CacheGroupSpec("mtp_index", layers, self.target_cfg.index_head_dim * index_bytes)]

    def cache_planes(self) -> list[tuple[str, torch.Tensor]]:
        """The draft's caches as (group, view with the block id first), for the CPU tier."""
        if self.method == "eagle3":
            return [("draft", self.draft.kv_cache[0]), ("draft", self.draft.kv_cache[1])]
        planes = []
        for attn in self.draft.attention_layers:
            planes += [("mtp", attn.kv_cache[0]), ("mtp", attn.kv_cache[1]), ("mtp_index", attn.index_cache)]
        return planes

    def allocate_caches(self, num_blocks: int, block_size: int, kv_dtype, index_dtype) -> None:
        dev = self.device
        if self.method == "eagle3":
            d = self.draft
            d.kv_cache = torch.zeros(2, num_blocks, block_size, d.num_kv_heads, d.cfg.head_dim,
                                     dtype=kv_dtype, device=dev)
            return
        cfg = self.target_cfg
        for attn in self.draft.attention_layers:
            attn.kv_cache = torch.zeros(2, num_blocks, block_size, attn.num_kv_heads, cfg.head_dim,
                                        dtype=kv_dtype, device=dev)
            attn.index_cache = torch.zeros(num_blocks, block_size, cfg.index_head_dim, dtype=index_dtype,
                                           device=dev)
            if kv_dtype == torch.float8_e4m3fn:
                attn.k_scale = torch.ones(1, dtype=torch.float32, device=dev)
                attn.v_scale = torch.ones(1, dtype=torch.float32, device=dev)

    # ------------------------------------------------------------ proposing

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = getattr(self.draft, "embed_tokens", None)
        return (own if own is not None else self.target.model.embed_tokens)(ids)

    @torch.inference_mode()
    def propose(self, step: StepForDraft) -> torch.Tensor:
        """-> draft tokens [R, k] int64 (rows whose last position is not a real continuation,
        such as partial prefill chunks, get tokens that the caller discards)."""
        next_ids = torch.roll(step.input_ids.long(), -1)
        next_ids[step.last_index] = step.last_token
        token, prev = self.first_pass(next_ids, step.positions, step.meta, step.hidden, step.last_index)
        return self.draft_steps(token, prev, step.positions[step.last_index], step.block_tables,
                                step.last_position_cpu)

    def first_pass(self, next_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   hidden: torch.Tensor, last_index: torch.Tensor):
        """The draft over every token of the step (writing its KV) -> (first draft token [R],
        the draft hidden state at each request's last verified position [R, H])."""
        embeds = self._embed(next_ids)
        head = self.target.lm_head
        if self.method == "eagle3":
            out, prenorm = self.draft(embeds, self.draft.combine(hidden), positions, meta)
            return self.draft.next_tokens(out[last_index], head), prenorm[last_index]
        module = self.draft.modules_[0]
        cos, sin = self.target.model.rotary.cos_sin(positions, embeds.dtype)
        last = module(embeds, hidden, positions, cos, sin, meta)[last_index]
        return head.logits_and_greedy(module.final_layernorm(last))[1], last

    def draft_steps(self, token: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor,
                    block_tables: torch.Tensor, cpu_positions: list[int] | None = None) -> torch.Tensor:
        """k - 1 one-token draft steps from (token, hidden state, position) per request ->
        drafts [R, k]. `cpu_positions` (positions on the host) bound the reference ops; without
        them (CUDA graphs) the kernels run to the context limit."""
        head = self.target.lm_head
        rotary = self.target.model.rotary
        tokens = [token]
        for i in range(1, self.k):
            positions = positions + 1
            if cpu_positions is not None:
                cpu_positions = [p + 1 for p in cpu_positions]
            meta = self._decode_meta(positions, block_tables, cpu_positions)
            embeds = self._embed(tokens[-1])
            if self.method == "eagle3":
                out, prev = self.draft(embeds, prev, positions, meta)
                tokens.append(self.draft.next_tokens(out, head))
            else:
                module = self.draft.modules_[i % len(self.draft.modules_)]
                cos, sin = rotary.cos_sin(positions, embeds.dtype)
                prev = module(embeds, prev, positions, cos, sin, meta)
                tokens.append(head.logits_and_greedy(module.final_layernorm(prev))[1])
        return torch.stack(tokens, dim=1)

    def _decode_meta(self, positions: torch.Tensor, block_tables: torch.Tensor,
                     cpu_positions: list[int] | None) -> AttentionMetadata:
        R, bs = positions.shape[0], self.block_size
        seq_lens = (positions + 1).to(torch.int32)
        qsl = torch.arange(R + 1, dtype=torch.int32, device=positions.device)
        _, slots = positions_and_slots(qsl, seq_lens, block_tables, R, bs, True)
        seq_cpu = [p + 1 for p in cpu_positions] if cpu_positions is not None else [1] * R
        max_seq = max(seq_cpu, default=1) if cpu_positions is not None else self.max_model_len + self.k
        return AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables,
                                 slot_mapping=slots, query_start_loc_cpu=list(range(R + 1)),
                                 seq_lens_cpu=seq_cpu, block_size=bs, max_query_len=1, max_seq_len=max_seq)


# ---------------------------------------------------------------- loading

def _dummy_entries(shapes: dict, seed: int, device):
    """Random draft weights (`--load-format dummy`), each tensor from its own seed."""
    from m3serve.model.loader import LazyTensor

    for index, (name, shape) in enumerate(shapes.items()):
        def make(name=name, shape=shape, index=index):
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 7919 + index)
            if name == "d2t":
                return torch.zeros(shape, dtype=torch.int64, device=device)
            if name.endswith("e_score_correction_bias"):
                return torch.zeros(shape, device=device)
            if len(shape) == 1:
                base = 0.0 if ("enorm" in name or "hnorm" in name or "final_layernorm" in name
                               or ".layer." in name) else 1.0     # Gemma offsets vs standard norms
                return torch.empty(shape, device=device).normal_(base, 0.02, generator=gen)
            return torch.empty(shape, device=device).normal_(0.0, shape[-1] ** -0.5, generator=gen)
        yield "dummy", name, [(name, LazyTensor(shape, make))]


def _checkpoint_entries(files, canonical):
    from m3serve.model.loader import iter_checkpoint

    for path, key, tensor in iter_checkpoint(files):
        pairs = canonical(key, tensor)
        if pairs:
            yield path.name, key, pairs


def _load_eagle3(model, target_cfg, tp, dtype, device, load_format, seed):
    from m3serve.model.files import resolve_model_dir
    from m3serve.model.loader import fill_parameters, weight_files
    from m3serve.spec.eagle3 import (Eagle3Draft, canonical_eagle3_name, eagle3_shapes, eagle3_to_param,
                                     load_eagle3_config)

    draft_dir = resolve_model_dir(model)
    cfg = load_eagle3_config(draft_dir, target_cfg)
    if load_format == "dummy":
        own_head, own_embed, files = cfg.draft_vocab_size != cfg.vocab_size, False, None
    else:
        files = weight_files(draft_dir)
        names = set()
        from safetensors import safe_open
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                names.update(canonical_eagle3_name(k) for k in handle.keys())
        own_head, own_embed = "lm_head.weight" in names, "embed_tokens.weight" in names
        if cfg.draft_vocab_size != cfg.vocab_size and not own_head:
            raise ValueError(f"EAGLE3 draft {draft_dir}: draft_vocab_size {cfg.draft_vocab_size} differs "
                             f"from the target's {cfg.vocab_size}, but the checkpoint has no lm_head.weight")
    with torch.device(device):
        draft = Eagle3Draft(cfg, tp, dtype, own_head, own_embed)
    shapes = eagle3_shapes(cfg, own_head, own_embed)
    if load_format == "dummy":
        entries = _dummy_entries(shapes, seed, device)
    else:
        entries = _checkpoint_entries(
            files, lambda key, t: [(c, t)] if (c := canonical_eagle3_name(key)) else [])
    fill_parameters(draft, target_cfg, entries, f"EAGLE3 draft {draft_dir}", progress=False,
                    expected=shapes, to_param=eagle3_to_param)
    return draft.eval(), tuple(cfg.aux_layer_ids)


def _load_mtp(model, target_dir, target_cfg, k, parallel, dtype, device, load_format, seed):
    from m3serve.model.config import load_config
    from m3serve.model.files import resolve_model_dir
    from m3serve.model.loader import fill_parameters, weight_files
    from m3serve.spec.mtp import MTPDraft, canonical_mtp_names, mtp_shapes, mtp_to_param

    source = resolve_model_dir(model) if model else Path(target_dir)
    modules = _num_mtp_modules(source, target_cfg)
    if model:
        standalone = load_config(source)
        if standalone.hidden_size != target_cfg.hidden_size or standalone.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"MTP checkpoint {source}: hidden_size/vocab_size {standalone.hidden_size}/"
                             f"{standalone.vocab_size} differ from the target's {target_cfg.hidden_size}/"
                             f"{target_cfg.vocab_size}")
    used = min(k, modules)
    with torch.device(device):
        draft = MTPDraft(target_cfg, used, parallel, dtype)
    shapes = mtp_shapes(target_cfg, used)
    if load_format == "dummy":
        entries = _dummy_entries(shapes, seed, device)
    else:
        entries = _checkpoint_entries(weight_files(source), lambda key, t: canonical_mtp_names(key, t, used))
    fill_parameters(draft, target_cfg, entries, f"MTP modules of {source}", progress=False,
                    expected=shapes, to_param=mtp_to_param)
    return draft.eval()


def _num_mtp_modules(source: Path, target_cfg: M3Config) -> int:
    from m3serve.model.config import read_config_json

    raw = read_config_json(source, "MTP")
    text = raw.get("text_config", raw)
    n = text.get("num_mtp_modules", 0)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{source}/config.json: num_mtp_modules is {n!r}; MTP drafting needs >= 1 module")
    return n
