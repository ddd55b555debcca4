"""The worker's encoder outputs: the rank's store of vision-encoder features by key
(`EncoderOutputs`, whose keys the scheduler's encoder cache decides, `core/encoder_cache.py`),
and per request which prompt positions they fill (`MediaFeatures`).

An item is encoded the first time a step computes one of its placeholder positions, unless the
store has its output; from then on the request reads it from the store (chunked prefill and a
recompute after preemption never encode twice) and its pixels are dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from m3serve.multimodal.inputs import encoder_key, pixel_values


class EncoderOutputs:
    """key -> features [num_tokens, hidden] in the model's dtype, on the rank's device. Outputs
    are added by the steps that encode them and dropped only when the scheduler says so
    (`SchedulerOutput.encoder_cache_frees`)."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self._features: dict[str, torch.Tensor] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._features

    def __len__(self) -> int:
        return len(self._features)

    def __iter__(self):
        return iter(self._features)

    def get(self, key: str) -> torch.Tensor:
        return self._features[key]

    def put(self, key: str, features: torch.Tensor) -> None:
        self._features[key] = features if self.dtype is None else features.to(self.dtype)

    def free(self, keys) -> None:
        for key in keys:
            self._features.pop(key, None)   # an output a failed step never made is absent

    @property
    def num_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self._features.values())


class MediaFeatures:
    """One request's images and videos. item_of[pos] / row_of[pos]: which input and which of its
    feature rows fills prompt position pos (-1: not a placeholder). An input keeps its pixels
    until the request holds its output in the store (some come without: the scheduler found
    their output in the store at admission)."""

    def __init__(self, prompt_ids, inputs, image_id: int, video_id: int):
        self.keys = [encoder_key(x) for x in inputs]
        self.grids = [[tuple(g) for g in x.grids] for x in inputs]
        self.num_tokens = [x.num_tokens for x in inputs]
        self.pixels = [x if x.pixel_values else None for x in inputs]   # protocol.MultiModalInput
        self.held: set[int] = set()           # inputs whose output this request reads from the store
        n = len(prompt_ids)
        ids = np.asarray(prompt_ids)
        self.item_of = np.full(n, -1, dtype=np.int32)
        self.row_of = np.zeros(n, dtype=np.int32)
        for modality, token in (("image", image_id), ("video", video_id)):
            positions = np.flatnonzero(ids == token)
            k = 0
            for i, item in enumerate(inputs):
                if item.modality == modality:
                    where = positions[k:k + item.num_tokens]
                    self.item_of[where] = i
                    self.row_of[where] = np.arange(item.num_tokens, dtype=np.int32)
                    k += item.num_tokens
            if k != len(positions):     # the engine checked the spans at admission
                raise RuntimeError(f"{len(positions)} {modality} placeholders for {k} tokens of "
                                   f"{modality} features")
        placeholders = np.flatnonzero(self.item_of >= 0)
        self.end = int(placeholders[-1]) + 1 if len(placeholders) else 0   # past the last one
        self.num_encoded = 0

    def _needed(self, start: int, end: int) -> np.ndarray:
        """The inputs with placeholders in prompt positions [start, end)."""
        end = min(end, self.end)
        if start >= end:                # decode steps, text after the last image: nothing to do
            return np.zeros(0, dtype=np.int32)
        items = self.item_of[start:end]
        return np.unique(items[items >= 0])

    def missing(self, start: int, end: int, store: EncoderOutputs) -> list[int]:
        """The inputs with placeholders in [start, end) that this request does not hold and the
        store lacks: the ones a step must encode (from this request's pixels, or from another
        request of the step that has the same input's pixels)."""
        return [int(i) for i in self._needed(start, end) if i not in self.held and self.keys[i] not in store]

    def hold(self, start: int, end: int, store: EncoderOutputs) -> None:
        """Hold every input with placeholders in [start, end) (the store has their outputs now)
        and drop their pixels."""
        for i in self._needed(start, end):
            if self.keys[i] not in store:
                raise RuntimeError(f"encoder output {self.keys[i][:16]} missing from the store after encoding")
            self.held.add(int(i))
            self.pixels[i] = None

    def rows(self, start: int, end: int, store: EncoderOutputs) -> tuple[np.ndarray, torch.Tensor] | None:
        """(offsets in [0, end - start) of the placeholder positions, their features [k, H]),
        or None when the range holds none; `encode` made the store hold them."""
        needed = self._needed(start, end)
        if not len(needed):
            return None
        end = min(end, self.end)
        items = self.item_of[start:end]
        offsets = np.flatnonzero(items >= 0)
        rows = self.row_of[start:end][offsets]
        first = store.get(self.keys[needed[0]])
        if len(needed) == 1:
            return offsets, first[torch.from_numpy(rows).long().to(first.device)]
        out = first.new_empty(len(offsets), first.shape[1])                    # [k, H]
        of_item = items[offsets]
        for i in needed:
            sel = np.flatnonzero(of_item == i)
            out[torch.from_numpy(sel).to(out.device)] = \
                store.get(self.keys[i])[torch.from_numpy(rows[sel]).long().to(out.device)]
        return offsets, out


def encode_step(ranges, encoder, store: EncoderOutputs) -> int:
    """Give the store the output of every input that the step's requests need, in one encoder
    forward: `ranges` is [(MediaFeatures, first position, end position)] of the step's requests;
    each distinct key is encoded once, however many requests need it; then every request holds
    its inputs. Returns how many inputs were encoded."""
    todo: dict[str, tuple[MediaFeatures, int]] = {}
    without: dict[str, MediaFeatures] = {}           # needed by a request that has no pixels for it
    for media, first, end in ranges:
        for i in media.missing(first, end, store):
            if media.pixels[i] is None:
                without.setdefault(media.keys[i], media)
            else:
                todo.setdefault(media.keys[i], (media, i))
    for key in without.keys() - todo.keys():
        raise RuntimeError(f"encoder output {key[:16]} is neither in this rank's store nor encodable "
                           f"(no pixels in this step): the scheduler's encoder cache and the rank disagree")
    if todo:
        items = list(todo.items())
        pixels = torch.cat([pixel_values(media.pixels[i]) for _, (media, i) in items])   # [patches, 1176]
        grids = [g for _, (media, i) in items for g in media.grids[i]]
        out = encoder(pixels, grids)                                                 # [tokens, H]
        want = sum(media.num_tokens[i] for _, (media, i) in items)
        if out.shape[0] != want:
            raise RuntimeError(f"vision encoder gave {out.shape[0]} rows for inputs of {want} tokens")
        for (key, (media, i)), features in zip(items, out.split([m.num_tokens[j] for _, (m, j) in items])):
            store.put(key, features)
            media.num_encoded += 1
    for media, first, end in ranges:
        media.hold(first, end, store)
    return len(todo)
