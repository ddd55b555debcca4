"""Engine flags on the command line: one argparse flag per engine config field, with vLLM's
names (`max_num_seqs` <-> `--max-num-seqs`), and the way back to `EngineConfig` keywords.
Shared by every command that starts an engine (`generate`, `serve`, `bench offline`, `plan`).
"""
from __future__ import annotations

import argparse
import dataclasses

from m3serve import envs
from m3serve.config import engine_fields

_SHORT = {"tensor_parallel_size": ["-tp"], "data_parallel_size": ["-dp"]}


def _flag_type(f: dataclasses.Field):
    text = str(f.type)
    if "tuple" in text:
        return str          # comma-separated; the config dataclass parses it
    if "bool" in text:
        return bool
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per engine field. The multi-node flags default to torchrun's variables when it
    started this process (`envs.torchrun_defaults`)."""
    group = parser.add_argument_group("engine")
    launched = envs.torchrun_defaults()
    for f in engine_fields():
        if f.name in skip:
            continue
        names = ["--" + f.name.replace("_", "-")] + _SHORT.get(f.name, [])
        kind = _flag_type(f)
        default = launched.get(f.name, f.default)
        if kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        else:
            group.add_argument(*names, dest=f.name, type=kind, default=default,
                               help=f"(default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}
