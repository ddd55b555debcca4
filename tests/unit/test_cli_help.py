"""`--help` of the commands that start an engine: every engine flag's help is its config field's
docstring, every flag says what it does and its default, closed sets of values are listed, and
the CLI, `m3serve plan` and the config accept and name the same values."""
import argparse
import dataclasses

import pytest

from m3serve import config
from m3serve.cli import build_parser
from m3serve.config_docs import field_docs
from m3serve.engine_args import engine_field_docs, flag_help


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[-1] if a.option_strings[0] == "-h" else a.option_strings[0]: a
            for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}


def test_every_engine_field_has_a_docstring():
    docs = engine_field_docs()
    missing = [f.name for f in config.engine_fields() if not docs.get(f.name)]
    assert missing == []


def test_field_docs_reads_the_string_under_each_field():
    @dataclasses.dataclass
    class Example:
        size: int = 3
        """How big,
        in units."""
        bare: int = 0
        other: str = "x"
        """Another."""

    assert field_docs(Example) == {"size": "How big, in units.", "other": "Another."}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_help_with_its_default(command):
    parser = _subcommand(command)
    for flag, action in _options(parser).items():
        text = action.help or ""
        assert len(text) > 10, f"{flag} has no help"
        plain_switch = isinstance(action, argparse._StoreTrueAction) or action.default is None
        if not plain_switch and action.default not in ({}, ""):
            assert "default" in text.lower(), f"{flag}: its default is not shown: {text!r}"
    help_text = parser.format_help()          # renders: every % in a help text is escaped
    assert "--kv-offloading-size GiB" in help_text


def test_serve_help_names_units_values_and_the_listening_defaults():
    options = _options(_subcommand("serve"))
    assert "(default: 0.0.0.0" in options["--host"].help and "(default: 8000)" in options["--port"].help
    assert options["--kv-offloading-size"].metavar == "GiB"
    assert options["--kv-cache-memory"].metavar == "BYTES"
    assert tuple(options["--quantization"].choices) == config.QUANTIZATION_METHODS
    assert tuple(options["--kv-cache-dtype"].choices) == config.CACHE_DTYPES
    assert options["--max-num-seqs"].help.startswith(field_docs(config.SchedulerConfig)["max_num_seqs"])
    assert "(default: 256)" in options["--max-num-seqs"].help


def test_plan_accepts_the_quantizations_serve_accepts():
    plan_options = _options(_subcommand("plan"))
    assert tuple(plan_options["--quantization"].choices) == config.QUANTIZATION_METHODS
    assert tuple(plan_options["--kv-cache-dtype"].choices) == config.CACHE_DTYPES


def test_a_bad_quantization_names_every_supported_value():
    with pytest.raises(ValueError) as e:
        config.ModelConfig(quantization="int4")
    assert "'int4'" in str(e.value)
    for value in config.QUANTIZATION_METHODS:
        assert value in str(e.value)


def test_a_bad_quantization_on_the_command_line_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int4"])
    err = capsys.readouterr().err
    assert "invalid choice: 'int4'" in err and all(v in err for v in config.QUANTIZATION_METHODS)


def test_flag_help_shows_defaults_and_escapes_percent():
    assert flag_help("Share of 5 %.", 0.9, False) == "Share of 5 %%. (default: 0.9)"
    assert flag_help("Switch.", True, True) == "Switch. (default: on)"
    assert flag_help("Unset means the model's.", None, False) == "Unset means the model's."


def test_the_listening_url_the_server_logs():
    from m3serve.serving.server_args import ServerConfig
    assert ServerConfig().url == "http://0.0.0.0:8000"
    assert ServerConfig(host="::1", port=8080).url == "http://[::1]:8080"
