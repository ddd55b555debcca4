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
    """The whole sampler: logprobs, penalties, logit bias, or stop tokens held back while
    min_tokens is unmet (with or without a grammar). Never deferred; verifies no drafts
    (rejection sampling applies none of these)."""
    GRAMMAR = 3
    """Greedy or drawn as LOGITS, from this step's logits under the request's grammar mask.
    Never deferred (the mask comes from the grammar's matcher on the host, which must have seen
    the previous token); its drafts are verified on logits masked, at each verified position,
    for the grammar state after the drafts before it (greedy: equality with the masked argmax;
    sampled: rejection sampling of the masked distribution)."""


def sampling_mode(params: SamplingParams, num_output_tokens: int) -> SamplingMode:
    """The mode of a request's next token, with `num_output_tokens` outputs before it (in-flight
    ones included)."""
    if not params.samples_from_masked_logits or num_output_tokens < params.min_tokens:
        return SamplingMode.FULL
    if params.structured_outputs is not None:
        return SamplingMode.GRAMMAR
    return SamplingMode.ARGMAX if params.is_greedy else SamplingMode.LOGITS
