"""What drafts are distilled from and measured on: the target's own greedy continuations of
prompts, the target's features over them through the engine's runner, and the mean acceptance
length of a draft served beside the target.

A draft that predicts the target's greedy tokens is accepted under greedy verification, so the
training data are greedy sequences (prompt + continuation), and the label after every prefix is
the target's own greedy token there (`next_ids`: inside the continuation, the next token).
The features are what the proposer hands a draft at serving time: the residual streams
entering chosen target layers (EAGLE3, DSpark) and the final hidden states (MTP).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


def greedy_sequences(target_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's `new_tokens` greedy tokens (end-of-text ignored, so
    every sequence has len(prompt) + new_tokens tokens)."""
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams

    llm = LLM(str(target_dir), dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    return [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]


@dataclass
class TargetFeatures:
    """The target over N equal-length sequences of L tokens."""
    tokens: torch.Tensor     # [N, L] int64
    next_ids: torch.Tensor   # [N, L] int64: the target's greedy token after each prefix tokens[:, :p + 1]
    hidden: torch.Tensor     # [N, L, H] final hidden states (after the final norm)
    streams: torch.Tensor    # [N, L, len(taps) * H] the residual streams entering `taps`
    taps: tuple[int, ...]

    def tap_streams(self, taps: tuple[int, ...]) -> torch.Tensor:
        """The streams of `taps` (a sub-sequence of self.taps' layers, any order) -> [N, L, n * H]."""
        H = self.hidden.shape[-1]
        missing = [t for t in taps if t not in self.taps]
        if missing:
            raise ValueError(f"taps {missing} were not computed (have {list(self.taps)})")
        return torch.cat([self.streams[..., self.taps.index(t) * H:(self.taps.index(t) + 1) * H] for t in taps], -1)


def target_features(target_dir: Path, sequences: list[list[int]], taps: tuple[int, ...],
                    batch: int = 64) -> TargetFeatures:
    """The target's final hidden states and tapped streams over equal-length sequences, through
    the engine's runner in fp32 (a batch of requests per step)."""
    from m3serve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
    from m3serve.model.loader import load_model
    from m3serve.sampling_params import SamplingParams
    from m3serve.worker.model_runner import ModelRunner

    if len({len(s) for s in sequences}) != 1:
        raise ValueError("target_features needs sequences of one length")
    taps = tuple(sorted(set(taps)))
    model, cfg, _ = load_model(target_dir, dtype="float32", progress=False)
    bs, L = cfg.index_block_size, len(sequences[0])
    per_seq = -(-L // bs)
    hidden, streams, next_ids = [], [], []
    for start in range(0, len(sequences), batch):
        chunk = sequences[start:start + batch]
        runner = ModelRunner(model, bs, per_seq * len(chunk) + 1, torch.device("cpu"), L, len(chunk), L * len(chunk))
        new = [NewRequestData(f"s{i}", seq, SamplingParams(temperature=0),
                              list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), 0) for i, seq in enumerate(chunk)]
        so = SchedulerOutput(new, CachedRequestData.make_empty(), {f"s{i}": L for i in range(len(chunk))},
                             L * len(chunk), {}, set(), set())
        h, s = runner.forward_hidden(so, taps)
        next_ids.append(model.compute_logits(h).argmax(-1).view(len(chunk), L))
        hidden.append(h.view(len(chunk), L, -1).clone())
        streams.append(s.view(len(chunk), L, -1).clone())
    return TargetFeatures(torch.tensor(sequences), torch.cat(next_ids), torch.cat(hidden), torch.cat(streams), taps)


def acceptance(target_dir: Path, speculative_config: dict, prompts: list[list[int]], max_tokens: int,
               dtype: str = "float32") -> dict:
    """Greedy generation of `max_tokens` per prompt with the draft -> {"mean_acceptance_length",
    "accepted_per_position", "outputs"} (the engine's spec-decode counters)."""
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams

    llm = LLM(str(target_dir), dtype=dtype, speculative_config=speculative_config)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.core.scheduler.spec_stats
    return {"mean_acceptance_length": stats.mean_acceptance_length,
            "accepted_per_position": list(stats.accepted_per_position),
            "outputs": [o.outputs[0].token_ids for o in outs]}
