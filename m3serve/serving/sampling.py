"""A request's sampling fields + the server's sampling defaults -> `SamplingParams`: the one
place every API dialect's sampling ends up.

A dialect passes its fields as `SamplingParams` keywords (None = the request left it unset):
those named as `SamplingParams` names them (`SHARED`) by name, whichever of them its request
model declares (`shared_fields`), the rest translated by the dialect. The fields the generation
config may set (`DEFAULTED`) fall back to the server's defaults, the others to
`SamplingParams`' own. Range checks are `SamplingParams`', whose ValueError names the field.
"""
from __future__ import annotations

from m3serve.sampling_params import SamplingParams

# Request fields named as SamplingParams names them: passed on by name by every dialect whose
# request model declares them
SHARED = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty")
# SamplingParams fields whose unset value is the server's default (sampling_defaults), not
# SamplingParams' own
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty")


def build_sampling_params(fields: dict, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
    """`fields`: SamplingParams keywords the request gives (None: unset); `max_tokens`: already
    resolved against the context; `defaults`: the server's sampling defaults (its max_tokens
    is applied when max_tokens is resolved, not here)."""
    values = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
    values |= {k: v for k, v in fields.items() if v is not None or k not in DEFAULTED}
    return SamplingParams(max_tokens=max_tokens, **values)


def shared_fields(request) -> dict:
    """The `SHARED` fields `request`'s (pydantic) model declares, with their values (None:
    unset); fields a client sends that the model does not declare are not among them."""
    declared = type(request).model_fields
    return {name: getattr(request, name) for name in SHARED if name in declared}
