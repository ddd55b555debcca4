"""`python -m m3serve.bench.index_reuse MODEL --freqs 2 4`: what cross-layer top-k reuse
(`use_index_cache`, docs/model.md §4) does to a model's outputs, against the exact model.

For each prompt (random token ids: long enough that top-k selection matters) the exact model's
greedy continuation of `--gen-len` tokens is generated. Then, for the exact model and each
index_topk_freq F in turn, (a) prompt + that continuation is prefilled in chunks (teacher forcing)
and the next-token distributions at the generated positions are compared with exact's: mean
KL(exact || F) in nats and the fraction whose argmax agrees; (b) F's own greedy continuation is
generated and compared token by token: the fraction of equal tokens and the first divergence;
(c) from the exact model's own selections in (a): the fraction of a skipping layer's blocks that
the selection it would reuse also holds (positions past top-k x block only), the reason for (a)
and (b): trained layers choose alike, random ones do not.
One model is held at a time, all run the same weights (a checkpoint's, or dummy weights, drawn
per tensor name whatever the config). Forwards go through the engine's model runner, eager.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time

import torch

from m3serve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from m3serve.sampling_params import SamplingParams


class _Selections:
    """A probe (layers/probes.py) keeping each sparse layer's selections on the host."""

    def __init__(self):
        self.by_layer: dict[int, list[torch.Tensor]] = {}

    def record(self, name: str, layer_id: int, tensor: torch.Tensor) -> None:
        from m3serve.layers import probes
        if name == probes.SPARSE_BLOCKS:
            self.by_layer.setdefault(layer_id, []).append(tensor.detach().to("cpu", copy=True))

    def whole(self) -> dict[int, torch.Tensor]:
        """layer id -> [tokens, Hi_local, topk] over the calls in order."""
        return {layer: torch.cat(parts) for layer, parts in self.by_layer.items()}


def selection_overlap(cfg, selections: dict[int, torch.Tensor], freq: int, offset: int) -> float | None:
    """Mean over the layers that skip under (freq, offset), their tokens past top-k x block and
    index heads, of the fraction of the layer's own (exact) blocks that its source layer's
    selection also holds. selections: the exact model's, layer id -> [tokens, Hi, topk]."""
    schedule = dataclasses.replace(cfg, index_topk_freq=freq, index_skip_topk_offset=offset)
    first = cfg.index_topk_blocks * cfg.index_block_size
    fractions = []
    for layer in cfg.sparse_layer_ids:
        source = schedule.index_source(layer)
        if source == layer:
            continue
        own, used = selections[layer][first:].long(), selections[source][first:].long()
        if own.shape[0] == 0:
            continue
        kept = (own[..., :, None] == used[..., None, :]).any(-1) & (own >= 0)   # [T, Hi, topk]
        fractions.append((kept.sum(-1) / (own >= 0).sum(-1).clamp(min=1)).float().mean().item())
    return sum(fractions) / len(fractions) if fractions else None


class SequenceDriver:
    """One sequence at a time through a model's own `ModelRunner`: prefill in chunks, then
    greedy decode steps; each sequence gets the same blocks, the previous one finished first."""

    def __init__(self, model, max_len: int, chunk: int, device):
        from m3serve.worker.model_runner import ModelRunner

        self.model, self.chunk = model, chunk
        self.bs = model.cfg.index_block_size
        self.blocks = list(range(1, -(-max_len // self.bs) + 1))           # block 0 is the null page
        self.runner = ModelRunner(model, self.bs, len(self.blocks) + 1, torch.device(device), max_len,
                                  max_num_reqs=1, max_num_tokens=chunk)
        self.num_seqs = 0
        self.rid: str | None = None
        self.length = 0

    def _step(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` to the current sequence -> final hidden states [len(tokens), H]."""
        new, cached = [], CachedRequestData.make_empty()
        finished = set()
        if self.length == 0:
            if self.rid is not None:
                finished.add(self.rid)
            self.num_seqs += 1
            self.rid = f"seq{self.num_seqs}"
            new.append(NewRequestData(self.rid, list(tokens), SamplingParams(temperature=0.0), self.blocks, 0))
        else:
            cached.req_ids.append(self.rid)
            cached.resumed_from_preemption.append(False)
            cached.new_token_ids.append(list(tokens))
            cached.new_block_ids.append([])
            cached.num_computed_tokens.append(self.length)
        so = SchedulerOutput(new, cached, {self.rid: len(tokens)}, len(tokens), {}, finished, set())
        self.length += len(tokens)
        return self.runner.forward_hidden(so)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    def prefill(self, ids: list[int], keep_last: int) -> torch.Tensor:
        """A new sequence `ids` -> fp32 logits [keep_last, V] of its last keep_last positions."""
        self.length = 0
        kept = []
        for start in range(0, len(ids), self.chunk):
            hidden = self._step(ids[start:start + self.chunk])
            first = max(0, len(ids) - keep_last - start)                   # rows of this chunk kept
            if first < hidden.shape[0]:
                kept.append(self.logits(hidden[first:]))
        return torch.cat(kept)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """A new sequence: the greedy continuation of `prompt`, n tokens."""
        out = [int(self.prefill(prompt, 1)[-1].argmax())]
        while len(out) < n:
            out.append(int(self.logits(self._step([out[-1]]))[-1].argmax()))
        return out


def _load(args, freq: int | None):
    from m3serve.model.loader import load_model

    overrides = None
    if freq is not None:
        overrides = {"text_config": {"use_index_cache": True, "index_topk_freq": freq,
                                     "index_skip_topk_offset": args.offset}}
    model, cfg, _ = load_model(args.model, dtype=args.dtype, device=args.device, progress=False,
                               load_format=args.load_format, seed=args.seed, hf_overrides=overrides)
    return model, cfg


def compare(args) -> dict:
    """The measurement (see the module docstring) -> the JSON-ready result."""
    g = torch.Generator().manual_seed(args.seed)
    prompts = None
    max_len = args.prompt_len + args.gen_len + 1
    exact_tokens, exact_logits, exact_selections = [], [], []
    rows = []
    for freq in [None, *args.freqs]:
        model, cfg = _load(args, freq)
        if prompts is None:
            vocab = min(cfg.vocab_size, args.max_token_id)
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
                       for _ in range(args.num_prompts)]
        driver = SequenceDriver(model, max_len, args.chunk, args.device)
        start = time.perf_counter()
        kl, top1, equal, first_diff = [], [], [], []
        for i, prompt in enumerate(prompts):
            if freq is None:
                exact_tokens.append(driver.greedy(prompt, args.gen_len))
            # logits predicting each generated token: positions prompt_len - 1 .. prompt_len + gen_len - 2
            from m3serve.layers import probes
            with probes.installed(_Selections() if freq is None else None) as chosen:
                logits = driver.prefill(prompt + exact_tokens[i][:-1], args.gen_len).cpu()   # [gen_len, V]
            if freq is None:
                exact_logits.append(logits)
                exact_selections.append(chosen.whole())
                exact_cfg = cfg
                continue
            ref = torch.log_softmax(exact_logits[i], -1)
            got = torch.log_softmax(logits, -1)
            kl.append((ref.exp() * (ref - got)).sum(-1).mean().item())
            top1.append((ref.argmax(-1) == got.argmax(-1)).float().mean().item())
            own = driver.greedy(prompt, args.gen_len)
            same = [a == b for a, b in zip(own, exact_tokens[i])]
            equal.append(sum(same) / len(same))
            first_diff.append(same.index(False) if False in same else len(same))
        seconds = time.perf_counter() - start
        if freq is not None:
            overlaps = [selection_overlap(exact_cfg, sel, freq, args.offset) for sel in exact_selections]
            overlaps = [o for o in overlaps if o is not None]
            rows.append({"index_topk_freq": freq, "index_skip_topk_offset": args.offset,
                         "selection_overlap": sum(overlaps) / len(overlaps) if overlaps else None,
                         "indexer_layers": len(cfg.index_layer_ids), "sparse_layers": len(cfg.sparse_layer_ids),
                         "mean_kl_nats": sum(kl) / len(kl), "max_prompt_kl_nats": max(kl),
                         "teacher_forced_top1_agreement": sum(top1) / len(top1),
                         "greedy_agreement": sum(equal) / len(equal),
                         "first_divergence": first_diff, "seconds": round(seconds, 1)})
        del driver, model
        gc.collect()          # parameters point back at their modules' loaders: cycles hold the weights
        if args.device != "cpu":
            torch.cuda.empty_cache()
    return {"model": str(args.model), "load_format": args.load_format, "dtype": args.dtype,
            "device": args.device, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "num_prompts": args.num_prompts, "block_size": cfg.index_block_size,
            "topk_blocks": cfg.index_topk_blocks, "results": rows}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (e.g. one from make-tiny or bench make-realshape)")
    p.add_argument("--freqs", type=int, nargs="+", default=[2, 4], help="index_topk_freq values to compare")
    p.add_argument("--offset", type=int, default=0, help="index_skip_topk_offset")
    p.add_argument("--prompt-len", type=int, default=8192,
                   help="tokens per prompt; top-k selection matters past top-k x block tokens")
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens per forward)")
    p.add_argument("--max-token-id", type=int, default=2000,
                   help="prompts draw ids below this (the tiny tokenizer's ordinary tokens)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(p)
    args = p.parse_args(argv)
    if any(f < 1 for f in args.freqs):
        p.error("--freqs must be integers >= 1")
    result = compare(args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
