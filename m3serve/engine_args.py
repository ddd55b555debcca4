"""Engine flags on the command line: one argparse flag per engine config field, with vLLM's
names (`max_num_seqs` <-> `--max-num-seqs`), and the way back to `EngineConfig` keywords.
Shared by every command that starts an engine (`generate`, `serve`, `bench offline`, `plan`).
"""
from __future__ import annotations

import argparse
import dataclasses

from m3serve import envs
from m3serve.config import EngineConfig, engine_fields
from m3serve.config_docs import field_docs

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
    """One flag per engine field, its help the field's docstring (`config_docs`) and its default,
    its choices and metavar from the field's metadata. The multi-node flags default to torchrun's
    variables when it started this process (`envs.torchrun_defaults`)."""
    group = parser.add_argument_group("engine")
    launched = envs.torchrun_defaults()
    docs = engine_field_docs()
    for f in engine_fields():
        if f.name in skip:
            continue
        names = ["--" + f.name.replace("_", "-")] + _SHORT.get(f.name, [])
        kind = _flag_type(f)
        default = launched.get(f.name, f.default)
        text = flag_help(docs.get(f.name, ""), default, kind is bool)
        if kind is bool:
            action = group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                                        default=default)
        else:
            action = group.add_argument(*names, dest=f.name, type=kind, default=default,
                                        choices=f.metadata.get("choices"), metavar=f.metadata.get("metavar"))
        action.help = text        # as written (BooleanOptionalAction may append its own default)


def engine_field_docs() -> dict[str, str]:
    """{engine field name: its attribute docstring} over every part of `EngineConfig`."""
    docs: dict[str, str] = {}
    for part in dataclasses.fields(EngineConfig):
        docs.update(field_docs(part.default_factory))      # type: ignore[arg-type]
    return docs


def flag_help(doc: str, default, is_bool: bool) -> str:
    """A flag's help: the field's docstring, then its default unless the docstring explains what
    an unset value (None) means; `%` escaped for argparse."""
    text = doc
    if default is not None:
        shown = ("on" if default else "off") if is_bool else default
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}


def build_engine_config(**kwargs) -> EngineConfig:
    """`EngineConfig` from flat keywords, completed from the files it names: a DSpark draft's
    default number of speculative tokens (its `dspark_block_size`), the check that an EAGLE3
    target without a named draft has an eagle3/ folder, and `mm_processor_kwargs`' keys. The
    config classes themselves read no file; every front end builds its engine config here."""
    from m3serve.config import synthetic_length
    from m3serve.model.draft_files import dspark_block_size, eagle3_draft_dir

    config = EngineConfig.from_kwargs(**kwargs)
    spec = config.speculative
    if spec.method == "dspark" and spec.num_speculative_tokens == 0:
        k = dspark_block_size(spec.model, config.model.model)
        if spec.synthetic_acceptance_length is not None:
            synthetic_length(spec.synthetic_acceptance_length, k)
        object.__setattr__(spec, "num_speculative_tokens", k)
    if spec.method == "eagle3" and spec.model is None:
        eagle3_draft_dir(None, config.model.model)     # the target's eagle3/ folder, or the error naming it
    if config.model.mm_processor_kwargs is not None:
        from m3serve.multimodal.processor import ProcessorOptions
        ProcessorOptions.from_kwargs(config.model.mm_processor_kwargs)     # checked here, applied per request
    return config
