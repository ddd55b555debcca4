"""The interface every draft kind implements (EAGLE3 in `spec_decode/eagle3.py`, MTP in `spec_decode/mtp.py`,
DSpark in `spec_decode/dspark.py`): its cache groups, its first pass over the target's step (`first`)
and how it turns that into k drafts (`steps`). `spec_decode/proposer.py` loads one and runs it: it
builds the first pass's inputs and the one-token steps' attention metadata, so a draft kind
knows nothing of the engine's batch. Sequential drafts (EAGLE3, MTP) implement `prepare` and
`propose` and inherit the loop; a block-parallel one (DSpark) overrides `first` and `steps`.
"""
from __future__ import annotations

import abc
from typing import Callable

import torch

from m3serve.core.kv_cache.specs import CacheGroupSpec
from m3serve.layers.attention_metadata import AttentionMetadata


class Drafter(abc.ABC):
    """One loaded draft for one rank, beside the target it drafts for."""

    taps: tuple[int, ...] = ()
    """Target layers whose entering residual streams the draft reads (concatenated, [T, n x H]);
    () = the target's final hidden states [T, H]."""

    sliding_window: int = 0
    """0: the draft's caches are pages of the engine's block ids (kept, prefix-cached, offloaded
    and freed with the target's). > 0: its queries read only the last `sliding_window` keys, and
    its caches are a pool of their own holding each running request's window
    (`core/kv_cache/draft_window.py`); `first` and `steps` then get the draft's block tables."""

    def __init__(self, draft: torch.nn.Module, target, device: torch.device):
        self.draft, self.target, self.device = draft, target, device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, H]: the target's, unless the draft brings its own."""
        return self.target.model.embed_tokens(ids)

    @abc.abstractmethod
    def cache_specs(self, kv_bytes: int, index_bytes: int) -> list[CacheGroupSpec]:
        """The draft's cache groups (counted when the KV pool is sized: per block of the
        engine's, or with `sliding_window` per block of the draft's own pool)."""

    @abc.abstractmethod
    def cache_planes(self) -> list[tuple[str, torch.Tensor]]:
        """The draft's caches on the engine's block ids as (group, view with the block id
        first), for the CPU tier ([] with `sliding_window`: its own pool stays on the GPU)."""

    @abc.abstractmethod
    def allocate_caches(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                        index_dtype: torch.dtype) -> None:
        """Allocate the caches `cache_specs` describes, `num_blocks` pages each."""

    def attention_kernels(self) -> list[tuple]:
        """(query heads, a K/V cache, sparse path, per-token left edge, k_scale, v_scale) of each
        way the draft calls the paged-attention kernel, for the start-up warm-up."""
        return []

    def first(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata, last_index: torch.Tensor,
              next_media: tuple[torch.Tensor, torch.Tensor] | None = None,
              context_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """The first pass over the target's step: next_ids [T] (token t + 1 at row t), hidden
        [T, ...] what `taps` asks for -> (first draft token or anchor [R], state for `steps`).
        `next_media` (rows [m], features [m, H]): where token t + 1 is an image or video
        placeholder, row t embeds the vision encoder's features for it -- what the target's
        own input held at position t + 1 -- not the placeholder's embedding row.
        `context_rows` (`StepForDraft.context_rows`): set only for a draft with a
        `sliding_window`, whose `first` then writes the context K/V of those rows alone."""
        return self.prepare(with_media(self.embed(next_ids), next_media), hidden, positions, meta, last_index)

    def steps(self, token: torch.Tensor, state, positions: torch.Tensor, block_tables: torch.Tensor,
              cpu_positions: list[int] | None, k: int,
              decode_meta: Callable[..., AttentionMetadata],
              valid_from: torch.Tensor | None = None) -> torch.Tensor:
        """From `first`'s result at each request's last verified position `positions` [R] ->
        drafts [R, k]: k - 1 one-token `propose` steps, each at the next position.
        `valid_from` [R] (a window draft): no query reads a key below it (holes in its KV).
        `decode_meta(positions, block_tables, cpu_positions)` builds a one-token step's metadata;
        `cpu_positions` (host copies of the positions) bound the reference ops, None under CUDA
        graphs."""
        tokens = [token]
        for i in range(1, k):
            positions = positions + 1
            if cpu_positions is not None:
                cpu_positions = [p + 1 for p in cpu_positions]
            meta = decode_meta(positions, block_tables, cpu_positions)
            token, state = self.propose(i, self.embed(tokens[-1]), state, positions, meta)
            tokens.append(token)
        return torch.stack(tokens, dim=1)

    def prepare(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, last_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first pass over every token of the target's step, writing the draft's KV:
        embeds [T, H] of the next tokens, hidden [T, ...] what `taps` asks for ->
        (first draft token [R], the draft's state at each request's last verified position [R, H])."""
        raise NotImplementedError(f"{type(self).__name__} overrides `first` instead")

    def propose(self, step: int, embeds: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step `step` (1 .. k - 1), one token per request: embeds [R, H] of the previous
        draft token, state [R, H] -> (draft token [R], new state [R, H])."""
        raise NotImplementedError(f"{type(self).__name__} has no one-token draft step")


def with_media(embeds: torch.Tensor, media: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """embeds [T, H] with rows `media[0]` [m] replaced by the features `media[1]` [m, H]."""
    if media is None:
        return embeds
    rows, features = media
    out = embeds.clone()
    out[rows] = features.to(out.dtype)
    return out
