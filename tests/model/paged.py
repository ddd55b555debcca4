"""Test helper: run the serving model over whole sequences with a private paged cache."""
from __future__ import annotations

import torch

from m3serve.layers.attention_metadata import AttentionMetadata


class PagedRunner:
    """Feeds one or more sequences through `model` chunk by chunk, each with its own block table.

    Pages are handed out in a scrambled order so that logical and physical block ids differ.
    """

    def __init__(self, model, num_blocks: int = 256, seed: int = 0, device: str = "cpu"):
        cfg = model.cfg
        self.model, self.cfg, self.bs = model, cfg, cfg.index_block_size
        g = model.model.layers[0].self_attn.num_kv_heads
        dt = model.dtype
        self.device = device
        self.kv = [torch.zeros(2, num_blocks, self.bs, g, cfg.head_dim, dtype=dt, device=device)
                   for _ in range(cfg.num_hidden_layers)]
        self.idx = [torch.zeros(num_blocks, self.bs, cfg.index_head_dim, dtype=dt, device=device)
                    if cfg.is_sparse(i) else None for i in range(cfg.num_hidden_layers)]
        model.bind_kv_caches(self.kv, self.idx)
        # page 0 is the null page, as in the engine
        self.free = (1 + torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]], record: list | None = None) -> torch.Tensor:
        """chunks: seq id -> new token ids. Returns fp32 logits [total new tokens, V]."""
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            end = start + len(toks)
            while len(table) * self.bs < end:
                table.append(self.free.pop())
            for i, t in enumerate(toks):
                p = start + i
                ids.append(t)
                pos.append(p)
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
            self.lens[sid] = end
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_tables=bt.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens, block_size=self.bs, record_selections=record)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta)
        self.hidden = hidden                      # final hidden states [T, H] of this step
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: list[int], n: int, sid: int = 0) -> list[int]:
        logits = self.step({sid: prompt})
        out = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            out.append(int(self.step({sid: [out[-1]]})[-1].argmax()))
        return out
