"""The proposer: loads a draft kind (`spec_decode/drafter.py`: the EAGLE3 head, the MTP modules or the
DSpark block drafter) and after each step proposes k draft tokens per request with it.

After a step the proposer runs the draft over every token the target just processed (its
"first pass", which also writes the draft's KV for every position, prompt chunks included):
EAGLE3 and MTP see token t+1 at position t, so they need the step's verified tokens, and then
take k - 1 one-token steps per request, each at the next position, feeding the previous step's
draft hidden state; DSpark projects the step's target hidden states into its cache, then drafts
all k tokens in one block pass. Draft tokens are the draft's argmax. EAGLE3's and MTP's caches
use the engine's block ids (block b is page b of every group), so they are allocated,
prefix-cached and freed with the target's; DSpark's sliding-window caches are a pool of their
own with block tables of their own (`core/kv_cache/draft_window.py`), which the proposer hands
it in place of the target's. KV a draft writes past the verified tokens is rewritten by a later
first pass.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from m3serve.core.kv_cache.specs import CacheGroupSpec
from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.layers.attention_metadata import AttentionMetadata
from m3serve.model.config import M3Config
from m3serve.spec_decode.drafter import Drafter
from m3serve.layers.attention_metadata import positions_and_slots

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
    draft_block_tables: torch.Tensor | None = None   # [R, W] int32: a window draft's own tables
    draft_valid_from: torch.Tensor | None = None     # [R] int32: ... and where its valid KV starts
    next_media: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows [m] int64, features [m, H]): the rows whose next token is an image or video
    placeholder, and the vision encoder's features for it (`Drafter.first`)."""
    context_rows: torch.Tensor | None = None
    """[T'] int64 (a window draft): the rows whose context K/V the draft writes; the others lie
    below every later query's window (their slots are the null block). None: every row."""


class Proposer:
    """Runs one draft kind (`spec_decode/drafter.py`) after each target step: k draft tokens per request."""

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
        load = _LOADERS[self.method]
        self.drafter: Drafter = load(spec, target, target_cfg, target_dir, parallel, draft_tp, device,
                                     load_format, seed)
        self.taps = self.drafter.taps
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
        return self.drafter.cache_specs(kv_bytes, index_bytes)

    def cache_planes(self) -> list[tuple[str, torch.Tensor]]:
        """The draft's caches as (group, view with the block id first), for the CPU tier."""
        return self.drafter.cache_planes()

    def allocate_caches(self, num_blocks: int, block_size: int, kv_dtype, index_dtype) -> None:
        """`num_blocks`: the engine's, or a window draft's own pool's."""
        self.drafter.allocate_caches(num_blocks, block_size, kv_dtype, index_dtype)

    # ------------------------------------------------------------ proposing

    @torch.inference_mode()
    def propose(self, step: StepForDraft) -> torch.Tensor:
        """-> draft tokens [R, k] int64 (rows whose last position is not a real continuation,
        such as partial prefill chunks, get tokens that the caller discards)."""
        token, prev = self._first_pass_of(step)
        tables = step.block_tables if step.draft_block_tables is None else step.draft_block_tables
        return self.draft_steps(token, prev, step.positions[step.last_index], tables,
                                step.last_position_cpu, step.draft_valid_from)

    @torch.inference_mode()
    def write_only(self, step: StepForDraft) -> None:
        """The draft over every token of the step, writing its KV, and no drafts (the first pass
        of `propose` without the steps after it)."""
        self._first_pass_of(step)

    def _first_pass_of(self, step: StepForDraft):
        """`first_pass` over a step: each row's next token (the step's own, or the emitted one
        after each request's last verified position)."""
        next_ids = torch.roll(step.input_ids.long(), -1)
        next_ids[step.last_index] = step.last_token
        return self.first_pass(next_ids, step.positions, step.meta, step.hidden, step.last_index,
                               step.draft_block_tables, step.next_media, step.context_rows)

    def first_pass(self, next_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   hidden: torch.Tensor, last_index: torch.Tensor,
                   draft_block_tables: torch.Tensor | None = None,
                   next_media: tuple[torch.Tensor, torch.Tensor] | None = None,
                   context_rows: torch.Tensor | None = None):
        """The draft over every token of the step (writing its KV) -> (first draft token or
        anchor [R], the draft kind's state for `draft_steps`). With a window draft's own
        `draft_block_tables` [R, W], the draft sees them and their slots in place of the target's.
        `next_media` (rows, features): vision features in place of those rows' next-token
        embeddings (`StepForDraft.next_media`)."""
        if draft_block_tables is not None:
            _, slots = positions_and_slots(meta.query_start_loc, meta.seq_lens, draft_block_tables,
                                           positions.shape[0], self.block_size, False)
            meta = dataclasses.replace(meta, block_tables=draft_block_tables, slot_mapping=slots)
        return self.drafter.first(next_ids, hidden, positions, meta, last_index, next_media, context_rows)

    def draft_steps(self, token: torch.Tensor, prev, positions: torch.Tensor,
                    block_tables: torch.Tensor, cpu_positions: list[int] | None = None,
                    valid_from: torch.Tensor | None = None) -> torch.Tensor:
        """From `first_pass`'s result at each request's last verified position -> drafts [R, k].
        `block_tables`: the draft's own with a window draft, which reads no key below
        `valid_from` [R]. `cpu_positions` (positions on the host) bound the reference ops;
        without them (CUDA graphs) the kernels run to the context limit."""
        return self.drafter.steps(token, prev, positions, block_tables, cpu_positions, self.k, self._decode_meta,
                                  valid_from=valid_from)

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
    from m3serve.model.checkpoint import LazyTensor

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
    from m3serve.model.checkpoint import iter_checkpoint

    for path, key, tensor in iter_checkpoint(files):
        pairs = canonical(key, tensor)
        if pairs:
            yield path.name, key, pairs


def _load_eagle3(spec, target, target_cfg, target_dir, parallel, draft_tp, device, load_format, seed):
    from m3serve.model.draft_files import eagle3_draft_dir
    from m3serve.model.checkpoint import weight_files
    from m3serve.model.loader import fill_parameters
    from m3serve.spec_decode.eagle3 import (Eagle3Draft, Eagle3Drafter, canonical_eagle3_name, eagle3_shapes,
                                     eagle3_to_param, load_eagle3_config)

    tp, dtype = (parallel.tp if draft_tp > 1 else GroupInfo()), target.dtype
    draft_dir = eagle3_draft_dir(spec.model, str(target_dir))
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
    return Eagle3Drafter(draft.eval(), target, device, tuple(cfg.aux_layer_ids))


def _load_mtp(spec, target, target_cfg, target_dir, parallel, draft_tp, device, load_format, seed):
    from m3serve.model.config import load_config
    from m3serve.model.files import resolve_model_dir
    from m3serve.model.checkpoint import weight_files
    from m3serve.model.loader import fill_parameters
    from m3serve.spec_decode.mtp import MTPDraft, MTPDrafter, canonical_mtp_names, mtp_shapes, mtp_to_param

    if parallel.dp.size > 1:
        raise ValueError("MTP drafting with data_parallel_size > 1 is not supported (its MoE "
                         "layers would need the replicas' lock step); use EAGLE3")
    if draft_tp != parallel.tp.size:
        raise ValueError("MTP modules are split like the target: draft_tensor_parallel_size "
                         "must equal tensor_parallel_size")
    model, k, dtype = spec.model, spec.num_speculative_tokens, target.dtype
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
    return MTPDrafter(draft.eval(), target, device)


def _num_mtp_modules(source: Path, target_cfg: M3Config) -> int:
    from m3serve.model.config import read_config_json

    raw = read_config_json(source, "MTP")
    text = raw.get("text_config", raw)
    n = text.get("num_mtp_modules", 0)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{source}/config.json: num_mtp_modules is {n!r}; MTP drafting needs >= 1 module")
    return n


def _dspark_dir(spec, target_dir) -> Path:
    """The DSpark draft's folder: speculative_config.model, else the target's `dspark/`."""
    from m3serve.model.files import resolve_model_dir

    path = resolve_model_dir(spec.model) if spec.model else Path(target_dir) / "dspark"
    if not (path / "config.json").is_file():
        raise ValueError(f"DSpark draft {path}: no config.json (speculative_config.model names the draft "
                         f"folder; without it the target's dspark/ folder is used)")
    return path


def _dspark_dummy_entries(shapes: dict, dtypes: dict, seed: int, device):
    """Random DSpark weights (`--load-format dummy`, `_dummy_entries`' draws); the packed
    projections quantised from them, codes and scales."""
    from m3serve.kernels.ref.packed import quantize_mxfp8
    from m3serve.model.checkpoint import LazyTensor

    plain = {n: s for n, s in shapes.items() if not n.endswith("weight_scale_inv")}
    for source, name, [(cname, lazy)] in _dummy_entries(plain, seed, device):
        if name not in dtypes:
            yield source, name, [(cname, lazy)]
            continue
        scale = name[:-len("weight")] + "weight_scale_inv"
        yield source, name, [
            (name, LazyTensor(lazy.shape, lambda lazy=lazy: quantize_mxfp8(lazy.load())[0], torch.float8_e4m3fn)),
            (scale, LazyTensor(shapes[scale], lambda lazy=lazy: quantize_mxfp8(lazy.load())[1], torch.uint8))]


def _load_dspark(spec, target, target_cfg, target_dir, parallel, draft_tp, device, load_format, seed):
    from m3serve.model.checkpoint import weight_files
    from m3serve.model.loader import fill_parameters
    from m3serve.spec_decode.dspark import (DSparkDraft, DSparkDrafter, canonical_dspark_name, dspark_dtypes,
                                     dspark_shapes, dspark_to_param, load_dspark_config)

    draft_dir = _dspark_dir(spec, target_dir)
    cfg = load_dspark_config(draft_dir, target_cfg)
    k = spec.num_speculative_tokens
    if k > cfg.block_size:
        raise ValueError(f"speculative_config.num_speculative_tokens {k} exceeds the DSpark draft's "
                         f"dspark_block_size {cfg.block_size} ({draft_dir})")
    tp = parallel.tp if draft_tp > 1 else GroupInfo()
    with torch.device(device):
        draft = DSparkDraft(cfg, target_cfg, tp, parallel.tp, target.dtype)
    if cfg.quant is not None:
        draft.pack_()
    shapes, dtypes = dspark_shapes(cfg, target_cfg.hidden_size), dspark_dtypes(cfg)
    if load_format == "dummy":
        entries = _dspark_dummy_entries(shapes, dtypes, seed, device)
    else:
        entries = _checkpoint_entries(weight_files(draft_dir), lambda key, t: [(canonical_dspark_name(key), t)])
    fill_parameters(draft, target_cfg, entries, f"DSpark draft {draft_dir}", progress=False,
                    expected=shapes, dtypes=dtypes, to_param=dspark_to_param)
    return DSparkDrafter(draft.eval(), target, device, k)


_LOADERS = {"eagle3": _load_eagle3, "mtp": _load_mtp, "dspark": _load_dspark}   # method -> its loader
