"""The worker's encoder outputs: per request, each image / video's features from the vision
encoder, computed the first time a step computes one of its placeholder positions and kept until
the request finishes, so chunked prefill and a recompute after preemption never encode twice.

`MediaFeatures.rows(start, end)` gives, for the prompt positions [start, end) of a step, which
positions are placeholders and the feature rows that replace their embeddings.
"""
from __future__ import annotations

import numpy as np
import torch

from m3serve.multimodal.inputs import pixel_values


class MediaFeatures:
    """One request's images and videos. item_of[pos] / row_of[pos]: which input and which of its
    feature rows fills prompt position pos (-1: not a placeholder)."""

    def __init__(self, prompt_ids, inputs, image_id: int, video_id: int):
        self.inputs = list(inputs)
        n = len(prompt_ids)
        ids = np.asarray(prompt_ids)
        self.item_of = np.full(n, -1, dtype=np.int32)
        self.row_of = np.zeros(n, dtype=np.int32)
        for modality, token in (("image", image_id), ("video", video_id)):
            positions = np.flatnonzero(ids == token)
            k = 0
            for i, item in enumerate(self.inputs):
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
        self.features: list[torch.Tensor | None] = [None] * len(self.inputs)
        self.num_encoded = 0

    def rows(self, start: int, end: int, encoder) -> tuple[np.ndarray, torch.Tensor] | None:
        """(offsets in [0, end - start) of the placeholder positions, their features [k, H]),
        or None when the range holds none; encodes the inputs it needs that are not yet."""
        end = min(end, self.end)
        if start >= end:                # decode steps, text after the last image: nothing to do
            return None
        items = self.item_of[start:end]
        offsets = np.flatnonzero(items >= 0)
        if not len(offsets):
            return None
        needed = np.unique(items[offsets])
        for i in needed:
            if self.features[i] is None:
                item = self.inputs[i]
                out = encoder(pixel_values(item), [tuple(g) for g in item.grids])
                if out.shape[0] != item.num_tokens:
                    raise RuntimeError(f"vision encoder gave {out.shape[0]} rows for an input of "
                                       f"{item.num_tokens} tokens")
                self.features[i] = out
                self.num_encoded += 1
        rows = self.row_of[start:end][offsets]
        first = self.features[needed[0]]
        if len(needed) == 1:
            return offsets, first[torch.from_numpy(rows).long().to(first.device)]
        out = first.new_empty(len(offsets), first.shape[1])                    # [k, H]
        of_item = items[offsets]
        for i in needed:
            sel = np.flatnonzero(of_item == i)
            out[torch.from_numpy(sel).to(out.device)] = \
                self.features[i][torch.from_numpy(rows[sel]).long().to(out.device)]
        return offsets, out
