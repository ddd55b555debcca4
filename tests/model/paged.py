"""Test helper: run the serving model over whole sequences through the engine's own model runner
(persistent input batch, staged inputs, attention metadata built on the device), driven by
hand-made `SchedulerOutput`s instead of a scheduler.
"""
from __future__ import annotations

import torch

from m3serve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from m3serve.sampling_params import SamplingParams
from m3serve.worker.model_runner import ModelRunner


class PagedRunner:
    """Feeds one or more sequences through `model` chunk by chunk, each with its own blocks.

    Pages are handed out in a scrambled order so that logical and physical block ids differ.
    """

    def __init__(self, model, num_blocks: int = 256, seed: int = 0, device: str = "cpu",
                 max_model_len: int = 8192, max_tokens: int = 8192):
        cfg = model.cfg
        self.model, self.cfg, self.bs = model, cfg, cfg.index_block_size
        self.runner = ModelRunner(model, self.bs, num_blocks, torch.device(device), max_model_len,
                                  max_num_reqs=16, max_num_tokens=max_tokens)
        # page 0 is the null page, as in the engine
        self.free = (1 + torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))).tolist()
        self.lens: dict[int, int] = {}
        self.num_blocks: dict[int, int] = {}
        self.hidden: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """chunks: seq id -> new token ids. Returns fp32 logits [total new tokens, V]. (What the
        layers chose: install a `m3serve.layers.probes.Recorder` around the call.)"""
        new, cached = [], CachedRequestData.make_empty()
        scheduled = {}
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            have = self.num_blocks.get(sid, 0)
            blocks = [self.free.pop() for _ in range(-(-end // self.bs) - have)]
            self.num_blocks[sid] = have + len(blocks)
            rid = f"seq{sid}"
            if sid not in self.lens:
                new.append(NewRequestData(rid, list(toks), SamplingParams(temperature=0.0), blocks, 0))
            else:
                cached.req_ids.append(rid)
                cached.resumed_from_preemption.append(False)
                cached.new_token_ids.append(list(toks))
                cached.new_block_ids.append(blocks)
                cached.num_computed_tokens.append(start)
            scheduled[rid] = len(toks)
            self.lens[sid] = end
        so = SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), {}, set(), set())
        self.hidden = self.runner.forward_hidden(so)   # final hidden states [T, H] of this step
        return self.model.compute_logits(self.hidden)

    def greedy(self, prompt: list[int], n: int, sid: int = 0) -> list[int]:
        logits = self.step({sid: prompt})
        out = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            out.append(int(self.step({sid: [out[-1]]})[-1].argmax()))
        return out
