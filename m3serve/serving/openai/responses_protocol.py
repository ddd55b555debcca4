"""The request body of `POST /v1/responses` (OpenAI's Responses API) as pydantic models.

Only the top level is typed here (a wrong type is a 400 naming the field); `input` items and
`tools` are checked by `responses_input`, whose errors name the item and field
(`input[2].call_id`). Unknown top-level fields are accepted and logged, as on the other endpoints.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

# `include` values OpenAI defines; only reasoning.encrypted_content changes what m3serve returns.
KNOWN_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs", "web_search_call.results",
                  "web_search_call.action.sources", "code_interpreter_call.outputs",
                  "computer_call_output.output.image_url", "file_search_call.results",
                  "message.input_image.image_url")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(_Strict):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    """OpenAI's fields, plus vLLM's extras that m3serve's chat endpoint also takes
    (top_k, seed, chat_template_kwargs, cache_salt)."""

    # check_json's paths of arbitrary JSON: function-call arguments and tool schemas
    free_json: ClassVar[tuple] = (("input", "*", "arguments"), ("tools", "*", "parameters"),
                                  ("tools", "*", "tools", "*", "parameters"))     # namespace members

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None          # OpenAI's default is true
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None    # prefix caching is automatic here: accepted, no effect
    client_metadata: dict[str, Any] | None = None     # Codex's per-turn details: accepted, not used
    safety_identifier: str | None = None
    service_tier: str | None = None
    # vLLM extras
    top_k: int | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
