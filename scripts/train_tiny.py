"""Train the embedded tiny MiniMax-M3 and its EAGLE3, MTP and DSpark drafts on the CPU, and write
them where the package ships them (docs/tiny_model.md says what this makes and what it measured):

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/train_tiny.py [--out DIR] [--threads 2]

1. The corpus (`m3serve/model/train_corpus.py`): this interpreter's standard library and the
   package's docs snapshot, checked against the shipped manifest; a difference stops the run
   with the files named (`--accept-corpus-changes` trains anyway and writes the new manifest).
2. The target (`m3serve/model/train_tiny.py`), written as a checkpoint with the held-out text.
3. The drafts' data: the target's greedy continuations of corpus windows, and corpus windows as
   they are, with the target's features over them (`m3serve/distill/draft_data.py`); then EAGLE3 (`distill/eagle3.py`, in DIR/eagle3), MTP
   (`distill/mtp.py`, bundled as DIR/mtp.safetensors) and DSpark (`distill/dspark.py`,
   in DIR/dspark).
4. Measurements: held-out perplexity of the trained and the random (`make-tiny`) model, each
   draft's mean acceptance length on held-out prompts; written to DIR/training_report.json and
   into the model card DIR/MODEL_CARD.md.
One seed and one thread count give the same files on one machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from m3serve.model.train_corpus import corpus_files, manifest_differences, split_corpus, write_manifest
from m3serve.model.train_tiny import (TrainSettings, WindowSampler, perplexity, token_stream, train_target,
                                      trained_config_dict, write_target)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "m3serve" / "model" / "tiny_trained"
# draft data: NUM_GREEDY corpus windows of PROMPT_LEN tokens, each continued greedily by
# NEW_TOKENS, and NUM_PLAIN corpus windows of as many tokens; DOCS_SHARE of each from the docs
PROMPT_LEN, NEW_TOKENS, NUM_GREEDY, NUM_PLAIN, DOCS_SHARE = 32, 96, 512, 1536, 0.25
DRAFT_BATCH = 8                # sequences per draft training step
DSPARK_MARKOV_RANK = 64        # make-tiny's DSpark for a tiny target has 16
# acceptance: held-out windows, greedy, EAGLE3 and MTP at k = 3, DSpark at its block size
NUM_EVAL_PROMPTS, EVAL_TOKENS = 16, 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=SHIPPED, help=f"where to write (default: {SHIPPED})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (the shipped files: 2)")
    p.add_argument("--steps", type=int, default=TrainSettings.steps, help="target training steps")
    p.add_argument("--draft-epochs", type=int, default=6, help="epochs over the draft data, per draft")
    p.add_argument("--accept-corpus-changes", action="store_true",
                   help="train on a corpus that differs from the shipped manifest, and write the new one")
    return p.parse_args()


def check_corpus(files, out: Path, accept: bool) -> list[str]:
    manifest = SHIPPED / "corpus.json"
    diffs = manifest_differences(files, manifest) if manifest.is_file() else [f"no manifest at {manifest}"]
    if diffs and not accept:
        shown = "\n  ".join(diffs[:20]) + (f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else "")
        sys.exit(f"the corpus on this machine differs from the pinned one ({manifest}):\n  {shown}\n"
                 f"a model trained on it is not the shipped one; --accept-corpus-changes trains anyway "
                 f"and writes the new manifest")
    write_manifest(files, out / "corpus.json")
    return diffs


def machine() -> str:
    """The CPU's model name and core count, e.g. "Intel(R) Xeon(R) Processor, 2 cores (x86_64)"."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores ({platform.machine()})"


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> list[list[int]]:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen).tolist()
    return [stream[s:s + length].tolist() for s in starts]


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "threads": args.threads,
                    "machine": machine(), "seed": args.seed}

    # 1. corpus
    files = corpus_files()
    report["corpus_differences"] = check_corpus(files, out, args.accept_corpus_changes)
    text = split_corpus(files)
    (out / "heldout.txt").write_text(text.heldout, encoding="utf-8")
    from m3serve.model.files import load_tokenizer
    from m3serve.model.tokenizer_build import write_tiny_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_tokenizer(tmp)
        tokenizer = load_tokenizer(Path(tmp))
    eos = tokenizer.token_to_id("[e~[")
    code, docs = token_stream(tokenizer, text.code, eos), token_stream(tokenizer, text.docs, eos)
    heldout = torch.tensor(tokenizer.encode(text.heldout, add_special_tokens=False).ids)
    report["corpus"] = {"files": len(files), "train_code_tokens": code.numel(), "train_docs_tokens": docs.numel(),
                        "heldout_tokens": heldout.numel()}

    # 2. target
    from m3serve.model.config import parse_config
    settings = replace(TrainSettings(), seed=args.seed, steps=args.steps)
    raw = trained_config_dict()
    sampler = WindowSampler(code, docs, settings.seq_len + 1, settings.docs_fraction, settings.seed)
    model, report["target"] = train_target(parse_config(raw), sampler, settings)
    write_target(out, raw, model.w.export())
    report["target"]["parameters"] = sum(p.numel() for p in model.parameters())
    del model

    # 3. drafts
    report["drafts"] = train_drafts(out, code, docs, args)

    # 4. measurements
    report["heldout"] = measure_heldout(out, heldout)
    report["acceptance"] = measure_acceptance(out, heldout, args.seed)
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    write_model_card(out, report)
    print(json.dumps({k: report[k] for k in ("heldout", "acceptance", "total_seconds")}, indent=1))


def train_drafts(out: Path, code: torch.Tensor, docs: torch.Tensor, args) -> dict:
    from m3serve.model.config import load_config
    from m3serve.distill.eagle3 import distill_eagle3
    from m3serve.distill.dspark import distill_dspark
    from m3serve.distill.mtp import distill_mtp, write_mtp_bundled
    from m3serve.distill.draft_data import TargetFeatures, greedy_sequences, target_features
    from m3serve.spec_decode.dspark import load_dspark_config
    from m3serve.spec_decode.eagle3 import load_eagle3_config
    from m3serve.distill.tiny_drafts import make_draft

    start = time.perf_counter()
    target_cfg = load_config(out)
    eagle_dir = make_draft(out / "eagle3", "eagle3", out, seed=args.seed)
    dspark_dir = make_draft(out, "dspark", out, seed=args.seed)          # its weights are replaced below
    raw = json.loads((dspark_dir / "config.json").read_text())
    raw["text_config"]["dspark_markov_rank"] = DSPARK_MARKOV_RANK
    (dspark_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    taps = load_eagle3_config(eagle_dir, target_cfg).aux_layer_ids + load_dspark_config(dspark_dir, target_cfg).taps
    gen = torch.Generator().manual_seed(args.seed + 2)

    def corpus_windows(n: int, length: int) -> list[list[int]]:
        num_docs = int(n * DOCS_SHARE)
        return windows(code, n - num_docs, length, gen) + windows(docs, num_docs, length, gen)

    # the target's greedy continuations of corpus windows, then corpus windows as they are
    # (the labels are the target's greedy token after every prefix either way)
    greedy = target_features(out, greedy_sequences(out, corpus_windows(NUM_GREEDY, PROMPT_LEN), NEW_TOKENS), taps)
    plain = target_features(out, corpus_windows(NUM_PLAIN, PROMPT_LEN + NEW_TOKENS), taps)
    data = TargetFeatures(*(torch.cat([getattr(greedy, f), getattr(plain, f)])
                            for f in ("tokens", "next_ids", "hidden", "streams")), greedy.taps)
    report = {"greedy_sequences": NUM_GREEDY, "corpus_sequences": NUM_PLAIN, "tokens_per_sequence": PROMPT_LEN + NEW_TOKENS,
              "epochs": args.draft_epochs, "batch_size": DRAFT_BATCH, "data_seconds": round(time.perf_counter() - start, 1)}
    t = time.perf_counter()
    report["eagle3"] = distill_eagle3(eagle_dir, out, args.draft_epochs, seed=args.seed, data=data, unroll=3,
                                      batch_size=DRAFT_BATCH)
    report["eagle3"]["seconds"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    tensors, report["mtp"] = distill_mtp(out, data, args.draft_epochs, seed=args.seed, batch_size=DRAFT_BATCH)
    write_mtp_bundled(out, tensors)
    report["mtp"]["seconds"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    report["dspark"] = distill_dspark(dspark_dir, out, data, args.draft_epochs, seed=args.seed, batch_size=DRAFT_BATCH)
    report["dspark"]["seconds"] = round(time.perf_counter() - t, 1)
    return report


def measure_heldout(out: Path, heldout: torch.Tensor) -> dict:
    """Perplexity of the written (bf16) weights and of the random make-tiny model on the held-out
    text, through the training forward in fp32."""
    from m3serve.model.config import load_config
    from m3serve.model.tiny import make_tiny
    from m3serve.model.trainable import TrainableM3, read_canonical

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("trained", out), ("random", make_tiny(Path(tmp) / "random", seed=0))):
            model = TrainableM3(load_config(path), read_canonical(path))
            result[f"{name}_perplexity"] = round(perplexity(model, heldout, 256), 3)
    result["ratio"] = round(result["trained_perplexity"] / result["random_perplexity"], 5)
    return result


def measure_acceptance(out: Path, heldout: torch.Tensor, seed: int) -> dict:
    from m3serve.distill.draft_data import acceptance

    prompts = windows(heldout, NUM_EVAL_PROMPTS, PROMPT_LEN, torch.Generator().manual_seed(seed + 3))
    configs = {"eagle3": {"method": "eagle3", "model": str(out / "eagle3"), "num_speculative_tokens": 3},
               "mtp": {"method": "mtp", "num_speculative_tokens": 3}, "dspark": {"method": "dspark"}}
    result = {}
    for name, spec in configs.items():
        r = acceptance(out, spec, prompts, EVAL_TOKENS)
        result[name] = {"mean_acceptance_length": round(r["mean_acceptance_length"], 3),
                        "accepted_per_position": r["accepted_per_position"]}
    return result


def write_model_card(out: Path, report: dict) -> None:
    t, h, a = report["target"], report["heldout"], report["acceptance"]
    size = sum(f.stat().st_size for f in out.rglob("*.safetensors")) / 1e6
    card = f"""# m3serve's embedded tiny MiniMax-M3 (trained)

A toy. A {t['parameters'] / 1e6:.2f}M-parameter MiniMax-M3 (5 layers: dense and MSA attention, dense and MoE
MLPs, the index cache; hidden size 128; a 2,048-token byte-level BPE) trained for
{t['settings']['steps']} steps of {t['settings']['batch_size']} x {t['settings']['seq_len']} tokens on Python {report['python']}'s standard library and
m3serve's docs snapshot (`corpus.json` lists the files and their sha256; `heldout.txt` is text it
never trained on; the docs also as chat turns, "Tell me about <heading>." answered by the
section). It writes Python-looking code and docs-looking prose; it knows nothing, follows no
instructions and must not be used for anything but exercising m3serve. Its
`generation_config.json` makes requests greedy unless they set a temperature (sampled at
temperature 1, a model this small writes near-words).

Made by `scripts/train_tiny.py` (docs/tiny_model.md): torch {report['torch']}, {report['threads']} threads, seed {report['seed']},
{report['total_seconds'] / 60:.1f} minutes on {report['machine']}.

| measured | value |
|---|---|
| final training loss (nats per token, last {t['settings']['log_every']} steps) | {t['final_loss']} |
| held-out perplexity, trained / random (`make-tiny`) | {h['trained_perplexity']} / {h['random_perplexity']} |
| EAGLE3 mean acceptance length, k = 3 | {a['eagle3']['mean_acceptance_length']} |
| MTP mean acceptance length, k = 3 | {a['mtp']['mean_acceptance_length']} |
| DSpark mean acceptance length, block of 7 | {a['dspark']['mean_acceptance_length']} |

Acceptance: greedy, {NUM_EVAL_PROMPTS} held-out prompts of {PROMPT_LEN} tokens, {EVAL_TOKENS} new tokens each, fp32.

Files: the checkpoint (config.json, model.safetensors, the tokenizer); `mtp.safetensors`, one
MTP module, bundled (`--speculative-config '{{"method": "mtp", "num_speculative_tokens": 3}}'`);
`dspark/`, DSpark with MXFP8 projections (`'{{"method": "dspark"}}'`); `eagle3/`, EAGLE3
(`'{{"method": "eagle3", "num_speculative_tokens": 3}}'`). Each draft is distilled from the
target's greedy token after every prefix, over its greedy continuations of corpus windows and
over corpus windows. {size:.1f} MB of weights in all; `training_report.json` holds every figure
of the run.
"""
    (out / "MODEL_CARD.md").write_text(card)


if __name__ == "__main__":
    main()
