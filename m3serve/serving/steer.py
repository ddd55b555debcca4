"""Test-only steering of token choice, for end-to-end tests of real agent clients against a model
with random weights (M3SERVE_TEST_STEER, docs/serving.md "Testing with real clients").

A steering file is JSON: `{"rules": [{"when": [TEXT, ...], "output": TEXT}, ...]}`. The first rule
all of whose `when` texts occur in a request's prompt (the rendered text; an empty list matches
every prompt) constrains that request's output to exactly its `output`, through the same structured-output mechanism as
`structured_outputs.choice`: the engine still runs the model, masks the vocabulary with the
compiled grammar before each sampled token, and the detokenizer, reasoning and tool-call parsers
read the tokens it chose. A prompt no rule matches is not steered. The server logs a warning at
start-up while steering is on; it is never on unless the variable names a file.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from m3serve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    when: tuple[str, ...]
    output: str

    def matches(self, prompt: str) -> bool:
        return all(text in prompt for text in self.when)


def load_rules(path: str) -> list[Rule]:
    """The rules of a steering file; ValueError names what is malformed."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"M3SERVE_TEST_STEER: cannot read {path!r}: {e}") from None
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, list) or not rules:
        raise ValueError(f"M3SERVE_TEST_STEER: {path!r} must hold {{\"rules\": [...]}} with at least one rule")
    out = []
    for i, rule in enumerate(rules):
        when = rule.get("when") if isinstance(rule, dict) else None
        if not (isinstance(when, list) and all(isinstance(t, str) for t in when)
                and isinstance(rule.get("output"), str) and rule["output"]):
            raise ValueError(f"M3SERVE_TEST_STEER: rules[{i}] must be "
                             f"{{\"when\": [str, ...], \"output\": non-empty str}}")
        out.append(Rule(tuple(when), rule["output"]))
    return out


class Steering:
    """The loaded rules; `apply` returns the params a prompt is generated with."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        logger.warning("TEST STEERING IS ON (M3SERVE_TEST_STEER): %d rules constrain matching requests' "
                       "outputs to fixed texts; never set this outside tests", len(rules))

    def apply(self, prompt: str, params: SamplingParams) -> SamplingParams:
        for index, rule in enumerate(self.rules):
            if rule.matches(prompt):
                logger.info("steering: rule %d applies (%d characters of output)", index, len(rule.output))
                return replace(params, structured_outputs=StructuredOutputsParams(choice=[rule.output]))
        return params
