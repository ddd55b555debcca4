"""How a request's next token is drawn: one rule, `sampling_mode`, applied by the scheduler once
per step to every scheduled request and sent to the worker in `SchedulerOutput.sampling_modes`.

The worker picks its sampling path from the mode and never re-derives it; the scheduler uses
the same mode to decide whether a step can be deferred (async scheduling) and whether a request
verifies drafts (speculative decoding).
"""
from __future__ import annotations

import enum

from m3serve.sampling_params import SamplingParams


class SamplingMode(enum.IntEnum):
    ARGMAX = 0
    """The next token is the argmax of the logits: greedy, and nothing changes the logits or
    reads the history. A step whose sampling rows are all ARGMAX takes the (distributed) argmax
    alone; it can be deferred at any TP size; its drafts are verified by equality."""
    LOGITS = 1
    """Drawn from this step's logits alone (temperature, top-k, top-p, min-p; a seeded request's
    own generator). It can be deferred on one rank; its drafts go through rejection sampling."""
    FULL = 2
    """The whole sampler: logprobs, penalties, logit bias, a grammar, or stop tokens held back
    while min_tokens is unmet. Never deferred; verifies no drafts (rejection sampling applies
    none of these)."""


def sampling_mode(params: SamplingParams, num_output_tokens: int) -> SamplingMode:
    """The mode of a request's next token, with `num_output_tokens` outputs before it (in-flight
    ones included)."""
    if not params.samples_from_logits_alone or num_output_tokens < params.min_tokens:
        return SamplingMode.FULL
    return SamplingMode.ARGMAX if params.is_greedy else SamplingMode.LOGITS
