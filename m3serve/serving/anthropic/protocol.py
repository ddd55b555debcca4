"""Anthropic Messages API request bodies and error shape.

The pydantic models check the top-level fields' types strictly (a wrong type is a 400 naming the
field); content blocks, tools, `tool_choice` and `thinking` stay plain JSON here and are checked
block by block in `convert.py`, so an error can name the exact path (`messages.2.content.0.type`).
Unknown top-level fields (what newer clients add: `context_management`, `service_tier`, ...) are
accepted and logged at debug level.
"""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

# Anthropic's error `type` per HTTP status (its API reference, "Errors").
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "api_error", 529: "overloaded_error"}

# Anthropic answers an overloaded service with 529 (its SDKs and Claude Code retry on it).
OVERLOADED_STATUS = 529


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body: `{"type": "error", "error": {"type": ..., "message": ...}}`."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "invalid_request_error"),
                                       "message": message}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


# Fields Anthropic's API defines that do not apply to a local model: accepted, logged at debug
# level, otherwise ignored (Claude Code sends several of them on every request).
NOT_APPLICABLE = ("service_tier", "container", "mcp_servers", "betas",
                  "inference_geo")


class CountTokensRequest(_Body):
    """`POST /v1/messages/count_tokens`: what the prompt of a Messages request would hold."""

    # check_json's paths of arbitrary JSON: tool_use inputs (a tool loop sends back what the
    # model wrote, integers of any size included) and tool schemas
    free_json: ClassVar[tuple] = (("messages", "*", "content", "*", "input"), ("tools", "*", "input_schema"))

    model: str = Field(min_length=1)
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None
    context_management: Any = None
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None
    output_config: Any = None          # its `effort` is MiniMax-M3.1's reasoning effort; the rest is ignored
    betas: Any = None
    inference_geo: Any = None

    def not_applicable(self) -> list[str]:
        """The NOT_APPLICABLE fields this request set."""
        return [name for name in NOT_APPLICABLE if getattr(self, name) is not None]


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
