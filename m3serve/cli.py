"""The `m3serve` command: generate | serve | route | plan | bench serve | bench sweep | make-tiny.

Engine flags are generated from the config dataclasses (`--max-num-seqs` <-> `max_num_seqs`),
with vLLM's names, so the CLI, `LLM(**kwargs)` and the server accept the same options.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from m3serve.engine_args import add_engine_args, engine_kwargs

def cmd_generate(args) -> int:
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    prompts = args.prompt or ["The quick brown fox"]
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        print(f"Prompt: {prompt!r}\nCompletion: {out.outputs[0].text!r}")
    return 0


def cmd_serve(args) -> int:
    from m3serve.serving.api_server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree")
        args.model = args.model_tag
    run_server(args)
    return 0


def cmd_make_tiny(args) -> int:
    if args.draft is not None:
        if args.flavor != "m3":
            raise ValueError("--flavor picks the target model's layout; with --draft, write the target "
                             "first (make-tiny DIR --flavor ...) and pass it as --target")
        from m3serve.distill.tiny_drafts import make_draft

        path = make_draft(args.dir, args.draft, args.target, seed=args.seed, weights=not args.no_weights)
        print(f"wrote a random {args.draft} draft checkpoint to {path}")
        if args.train_steps:
            if not args.draft.startswith("eagle3"):
                raise ValueError("--train-steps distils EAGLE3 drafts only")
            from m3serve.model.files import model_directory
            from m3serve.distill.eagle3 import distill_eagle3
            report = distill_eagle3(path, Path(args.target) if args.target else model_directory(None),
                                    args.train_steps, seed=args.seed)
            print(f"distilled it from the target's greedy outputs: {report}")
        return 0
    from m3serve.model.tiny import make_tiny

    path = make_tiny(args.dir, seed=args.seed, flavor=args.flavor, vision=args.vision,
                     quantization=args.quantization)
    name = "MiniMax-M3.1-Flash (MSA in every layer)" if args.flavor == "m3.1-flash" else "MiniMax-M3"
    kind = f" {args.quantization}" if args.quantization else ""
    print(f"wrote the tiny {name}{kind} checkpoint{' with a vision tower' if args.vision else ''} to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3serve", description="Serve MiniMax-M3.")
    from m3serve.version import package_version
    parser.add_argument("--version", action="version", version=f"m3serve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions with the offline API and print them")
    gen.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k best tokens (default: 0, off)")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed of the prompts' sampling (default: none, the engine's --seed)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server (no MODEL: the tiny model)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="checkpoint directory or hub id (default: the embedded tiny model)")
    from m3serve.serving.server_args import add_server_args
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from m3serve import plan as plan_mod
    pl = sub.add_parser("plan", help="weights and KV cache per GPU for a parallel layout, without loading weights")
    plan_mod.add_cli_args(pl)
    pl.set_defaults(func=lambda a: (plan_mod.main(a), 0)[1])

    from m3serve import route as route_mod
    rt = sub.add_parser("route", help="start vllm-router or smg in front of m3serve workers (plain or P/D)")
    route_mod.add_cli_args(rt)
    rt.set_defaults(func=route_mod.main)

    tiny = sub.add_parser("make-tiny", help="write the tiny random MiniMax-M3 checkpoint (the embedded default is trained: docs/tiny_model.md)")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    from m3serve.model.flavor import FLAVORS
    tiny.add_argument("--flavor", default="m3", choices=FLAVORS,
                      help="m3: dense and MSA attention layers mixed; m3.1-flash: MSA in every layer "
                           "(MiniMax-M3.1-Flash's layout, bf16 weights)")
    tiny.add_argument("--draft", default=None, choices=("eagle3", "eagle3-gqa", "mtp", "dspark"),
                      help="write a random draft checkpoint for --target instead")
    tiny.add_argument("--target", default=None, help="the target checkpoint the draft is sized for "
                                                      "(default: the embedded tiny model)")
    tiny.add_argument("--quantization", default=None,    # model/tiny.py QUANTIZED (no torch import here)
                      choices=("mxfp8", "nvfp4-modelopt", "nvfp4-ct", "mxfp4-quark", "mxfp8-nvfp4"),
                      help="write the weights in this quantised checkpoint layout (wider MLPs: every "
                           "scale block stays on one rank at TP 2 and 4); mxfp8-nvfp4 is M3.1-Flash's "
                           "(with --flavor m3.1-flash)")
    tiny.add_argument("--no-weights", action="store_true", help="config.json only (use --load-format dummy)")
    tiny.add_argument("--vision", action="store_true",
                      help="add a small vision tower, projector and patch-merge MLP (images and video)")
    tiny.add_argument("--train-steps", type=int, default=0,
                      help="EAGLE3: distil the draft from the target's greedy outputs for this many epochs")
    tiny.set_defaults(func=cmd_make_tiny)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from m3serve.bench import serve as bench_serve
    from m3serve.bench import sweep as bench_sweep
    bs = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    bench_serve.add_cli_args(bs)
    bs.set_defaults(func=lambda a: (bench_serve.main(a), 0)[1])
    bw = bench_sub.add_parser("sweep", help="concurrency sweep + tok/s/GPU vs tok/s/user chart")
    bench_sweep.add_cli_args(bw)
    bw.set_defaults(func=lambda a: (bench_sweep.main(a), 0)[1])
    from m3serve.bench import offline as bench_offline
    bo = bench_sub.add_parser("offline", help="prefill time and TPOT of the offline engine, with MBU")
    bench_offline.add_cli_args(bo)
    bo.set_defaults(func=lambda a: (bench_offline.main(a), 0)[1])
    mr = bench_sub.add_parser("make-realshape", help="write a real-shape L-layer config dir (serve it with --load-format dummy)")
    mr.add_argument("dir")
    mr.add_argument("--layers", type=int, default=4)
    mr.add_argument("--dense-layers", type=int, default=1,
                    help="leading dense layers (the real MiniMax-M3: --layers 60 --dense-layers 3)")
    mr.add_argument("--tp-rank", type=int, default=None, metavar="N",
                    help="write what one rank of a TP-N deployment holds (heads, widths and the "
                         "vocabulary head cut as the engine cuts them), to measure one rank on one GPU")
    mr.add_argument("--ep", action="store_true",
                    help="with --tp-rank: the rank holds 128/N whole experts (expert parallelism) "
                         "and computes only the rows routed to them")
    mr.add_argument("--full-vocab", action="store_true",
                    help="with --tp-rank: keep the whole vocabulary head (to compare with a peer "
                         "that keeps it)")
    mr.add_argument("--vision", action="store_true",
                    help="add the real vision tower's config (random weights under --load-format dummy)")
    mr.set_defaults(func=cmd_make_realshape)
    for subparsers in (sub, bench_sub):       # each command reports unknown flags with its own usage
        for command in subparsers.choices.values():
            command.set_defaults(command_parser=command)
    return parser


def cmd_make_realshape(args) -> int:
    from m3serve.bench.realshape import write_realshape_dir

    print(f"wrote {write_realshape_dir(args.dir, args.layers, args.dense_layers, args.tp_rank, args.ep, args.full_vocab, args.vision)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import logging
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "log_level", None):
        os.environ["M3SERVE_LOG_LEVEL"] = args.log_level       # the engine and rank processes too
    from m3serve import envs
    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(name)s: %(message)s")
    if unknown:         # reported by the command's own parser, with its usage
        flags = [u for u in unknown if u.startswith("-")] or unknown
        getattr(args, "command_parser", parser).error(
            f"unrecognized argument(s): {' '.join(flags)} (see `{getattr(args, 'command_parser', parser).prog} "
            f"--help`)")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"m3serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
