"""Attention metadata for one forward over a flattened batch, each query token's position and
cache slot, and the reference ops' slot write into a paged cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.layers.dispatch import use_triton


@dataclass
class AttentionMetadata:
    """Flattened batch description shared by every attention layer in one forward.

    Requests are laid out back to back: request r owns query tokens
    `query_start_loc[r] : query_start_loc[r+1]`, which are the LAST tokens of its context of
    `seq_lens[r]` tokens (so query i of r sits at position seq_lens[r] - q_len + i).
    """
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32
    seq_lens: torch.Tensor          # [num_reqs] int32, context length including this step's tokens
    block_tables: torch.Tensor      # [num_reqs, max_blocks] int32, logical block -> page id
    slot_mapping: torch.Tensor      # [num_tokens] int64, page id * block_size + offset; -1 = skip
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    max_query_len: int = 0          # host-side bounds for kernel launch shapes; 0 = derive
    max_seq_len: int = 0
    dp_padded_tokens: int = 0       # with several DP replicas: tokens each one brings to the MoE

    def __post_init__(self):
        if not self.max_query_len and len(self.query_start_loc_cpu) > 1:
            q = self.query_start_loc_cpu
            self.max_query_len = max(b - a for a, b in zip(q, q[1:]))
        if not self.max_seq_len and self.seq_lens_cpu:
            self.max_seq_len = max(self.seq_lens_cpu)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def write_cache_ref(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
                    scale: torch.Tensor | None = None) -> None:
    """cache: [num_blocks, block_size, *rest]; values: [T, *rest]; slots < 0 are skipped.
    An fp8 cache with a scale stores values / scale (saturated to the e4m3 range)."""
    flat = cache.view(-1, *cache.shape[2:])
    keep = slot_mapping >= 0
    v = values[keep]
    if scale is not None:
        v = (v.float() / scale).clamp(-448.0, 448.0)
    flat[slot_mapping[keep]] = v.to(cache.dtype)


def positions_and_slots(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, num_tokens: int, block_size: int,
                        one_token_each: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Position [T] int64 and cache slot [T] int64 of every query token, on the device. The
    queries of request r are the last tokens of its context of seq_lens[r] tokens."""
    n = seq_lens.shape[0]
    if one_token_each and use_triton("step_inputs", seq_lens):
        from m3serve.kernels.step_inputs import decode_positions_slots
        return decode_positions_slots(seq_lens, block_tables, block_size)
    if one_token_each:
        req = torch.arange(n, device=seq_lens.device)                          # [T = R]
        positions = (seq_lens - 1).long()
    else:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]                    # [R]
        req = torch.repeat_interleave(torch.arange(n, device=seq_lens.device), q_lens,
                                      output_size=num_tokens)                  # [T]
        offset = torch.arange(num_tokens, device=seq_lens.device) - query_start_loc[:-1][req]
        positions = (seq_lens - q_lens)[req].long() + offset
    pages = block_tables[req, positions // block_size].long()
    return positions, pages * block_size + positions % block_size
