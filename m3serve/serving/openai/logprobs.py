"""OpenAI's logprob values: a logprob JSON can carry (no -inf, no NaN), the k best alternatives
of a position, and vLLM's `prompt_logprobs` reply field. Chat and completions format them."""
from __future__ import annotations

import math

from m3serve.outputs import PositionLogprobs

# JSON has no -inf; vLLM reports impossible tokens with this value too.
_MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return _MIN_LOGPROB if math.isnan(value) else max(value, _MIN_LOGPROB)


def top_entries(position: PositionLogprobs, k: int) -> list[tuple[int, float, str]]:
    """The k best alternatives at one position, best first: (token id, logprob, text)."""
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank or 0))
    return [(t, clamp_logprob(lp.logprob), lp.decoded_token or "") for t, lp in ranked[:k]]


def prompt_logprobs_field(state, k: int | None) -> dict:
    """vLLM's `prompt_logprobs` reply field of a finished request `state` (a RequestState), {}
    when the request did not ask (k None): per prompt position None (the first, which nothing
    predicts) or {token id: {logprob, rank, decoded_token}} of the prompt token and the k best."""
    if k is None:
        return {}
    positions = state.sequences[0].prompt_logprobs or []
    out: list[dict | None] = []
    for p, token_id in enumerate(state.prompt_token_ids):
        position = positions[p] if p < len(positions) else None
        out.append(None if position is None else {
            str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in position.items() if t == token_id or (lp.rank or 0) <= k})
    return {"prompt_logprobs": out}
