"""What the OpenAI endpoints share: SSE framing and error events, usage blocks and the
`kv_transfer_params` reply field.
"""
from __future__ import annotations

import json

from m3serve.engine.errors import EngineDeadError, RequestFailed
from m3serve.serving.errors import internal_error
from m3serve.serving.openai.protocol import error_body
from m3serve.serving.output_processor import RequestState


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(status: int, message: str) -> str:
    return sse(error_body(status, message))


def engine_error_event(e: BaseException) -> str:
    """The SSE error event of a stream the engine ended: 503 when it is not running (the
    message says why), else a generic 500."""
    if isinstance(e, EngineDeadError):
        return sse_error(503, str(e))
    if isinstance(e, RequestFailed):
        return sse_error(400, str(e))
    return sse_error(500, internal_error(e))


def kv_transfer_field(states: list[RequestState], asked: bool) -> dict:
    """The top-level `kv_transfer_params` of a response whose request carried some."""
    if not asked:
        return {}
    return {"kv_transfer_params": next((s.sequences[0].kv_transfer_params for s in states
                                        if s.sequences[0].kv_transfer_params), None)}


def usage_block(states: list[RequestState]) -> dict:
    """OpenAI usage over all prompts and choices; a prompt counts once however large n is."""
    prompt = sum(len(s.prompt_token_ids) for s in states)
    completion = sum(len(seq.token_ids) for s in states for seq in s.sequences)
    cached = sum(s.sequences[0].num_cached_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
