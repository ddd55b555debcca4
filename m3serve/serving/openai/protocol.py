"""Pydantic models of the OpenAI-compatible request bodies, the OpenAI error body, and the
translation of a request's sampling fields into `SamplingParams` keywords.

Types are checked here (a wrong type is a 400 naming the field); value ranges are checked by
`SamplingParams`, whose ValueError names the field. Unknown fields are accepted and logged.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from m3serve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from m3serve.serving.sampling import build_sampling_params, shared_fields

MAX_N = 128  # parallel samples per request; more is a client bug, not a workload

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


# Paths of arbitrary JSON in chat-form requests (check_json's `free_json`): tool-call arguments
# given as objects, and tool schemas.
CHAT_FREE_JSON = (("messages", "*", "tool_calls", "*", "function", "arguments"),
                  ("tools", "*", "function", "parameters"))


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


_LEADING_NAME = re.compile(r"^([a-z_]+)")


def param_of(message: str, fields) -> str | None:
    """The request field a ValueError message starts with ("temperature must be ..."), if any."""
    match = _LEADING_NAME.match(message)
    return match.group(1) if match and match.group(1) in fields else None


class _Strict(BaseModel):
    """Strict types, as the OpenAI API checks them: no `true` for a token id, no `"yes"` for a
    boolean, no `"5"` for a number (an integer is still a valid float)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM extras)."""

    model_config = ConfigDict(extra="allow", strict=True)
    free_json: ClassVar[tuple] = ()                 # check_json's: paths of arbitrary JSON

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None   # P/D legs (vLLM's NIXL protocol)
    return_token_ids: bool = False     # vLLM's: the prompt's and each choice's token ids in the reply
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the k best
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint (ValueError naming the field when malformed)."""
        given = {}
        fmt = self.response_format
        if fmt is not None:
            if "type" not in fmt:
                raise ValueError("response_format.type is required: text, json_object or json_schema")
            kind = fmt["type"]
            if kind == "json_object":
                given["response_format"] = {"json_object": True, "source": "response_format"}
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format.json_schema.schema is required: a JSON schema object")
                given["response_format"] = {"json": schema, "source": "response_format.json_schema.schema"}
            elif kind != "text":
                raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
        if self.structured_outputs is not None:
            if "source" in self.structured_outputs:
                raise ValueError("structured_outputs: unexpected key 'source'")
            given["structured_outputs"] = dict(self.structured_outputs)
        for name, field in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                            ("grammar", "guided_grammar")):
            # constant names: CPython's type-attribute cache holds on to (up to 4096) name strings,
            # which a memory-growth check would read as growth
            value = getattr(self, field)
            if value is not None:
                given[field] = {name: value, "source": field}
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"structured_outputs: give one constraint, got {sorted(given)}")
        [spec] = given.values()
        try:
            return StructuredOutputsParams(**spec)
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """ValueError names the offending field. `defaults`: the server's sampling defaults
        (generation config) for the fields the request leaves unset."""
        return build_sampling_params(self.sampling_fields(logprobs), max_tokens, defaults)

    def sampling_fields(self, logprobs: int | None) -> dict:
        """The request's SamplingParams keywords (None: unset; see `serving.sampling`), checked
        where the request's own rules apply (ValueError names the field)."""
        if not isinstance(self.n, int) or self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:5]}") from None
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {logprobs}")
        if self.prompt_logprobs is not None:        # (its range: SamplingParams checks it)
            if self.stream:
                raise ValueError("prompt_logprobs is not available with stream=true")
            if self.kv_transfer_params is not None:
                raise ValueError("prompt_logprobs needs the prompt computed here: not with kv_transfer_params")
        return dict(
            shared_fields(self), n=self.n, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured(), logit_bias=bias,
            prompt_logprobs=self.prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingRequest):
    free_json: ClassVar[tuple] = CHAT_FREE_JSON
    messages: list[dict[str, Any]] = Field(min_length=1)
    mm_processor_kwargs: dict[str, Any] | None = None   # per-request image / video processor options
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # OpenAI's effort (none, minimal, low, medium, high, xhigh, max): M3's thinking_mode, and
    # for low..max MiniMax-M3.1's level (chat_template.template_kwargs); checked when rendered
    reasoning_effort: str | None = None


class TokenizeRequest(_Strict):
    """`/tokenize`: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    free_json: ClassVar[tuple] = CHAT_FREE_JSON

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None          # as in chat completions
    tools: list[ToolDefinition] | None = None


class DetokenizeRequest(_Strict):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]
