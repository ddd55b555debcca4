"""Chat-template loading and rendering for the API server.

Owns the sandboxed jinja2 environment (configured like transformers' `apply_chat_template`, so a
template renders the same here and there), validation of OpenAI-style messages with errors that
name the message index and field, the normalisation of content parts and tool-call arguments,
and the template variables the APIs set (`thinking_mode`, MiniMax-M3.1's `reasoning_effort`).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from m3serve.multimodal.parts import PART_TYPES, part_marker

VALID_ROLES = ("system", "developer", "user", "assistant", "tool")
THINKING_MODES = ("enabled", "disabled", "adaptive")
# MiniMax-M3.1's reasoning-effort levels, most to least; the template writes the level into the
# system prompt as <effort>LEVEL</effort>
REASONING_EFFORTS = ("max", "xhigh", "high", "medium", "low")
# OpenAI's reasoning efforts (Chat's `reasoning_effort`, Responses' `reasoning.effort`) and the
# thinking_mode each sets: M3 has no graded effort, so the lowest turn thinking off, the middle
# ones let the model decide (M3's own default), the highest always think. low..max are also
# MiniMax-M3.1's levels of the same name.
OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
EFFORT_TO_THINKING_MODE = {"none": "disabled", "minimal": "disabled", "low": "adaptive", "medium": "adaptive",
                           "high": "enabled", "xhigh": "enabled", "max": "enabled"}
# Older or alternative names clients use for an assistant message's reasoning text.
_REASONING_ALIASES = ("reasoning_content", "reasoning", "thinking")


def load_chat_template(model_dir: str | Path) -> str:
    """The chat template of a model directory: chat_template.jinja, else tokenizer_config.json's."""
    directory = Path(model_dir)
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str) and template:
            return template
    raise ValueError(
        f"no chat template in {str(directory)!r}: expected chat_template.jinja or a "
        f"'chat_template' string in tokenizer_config.json"
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's built-in tojson HTML-escapes <, > and &, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _join_text_parts(content: list, index: int) -> str:
    texts = []
    for part_index, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"messages[{index}].content[{part_index}] must be an object, got {part!r}")
        part_type = part.get("type")
        if part_type in PART_TYPES:               # the modality's marker; pixels come separately
            texts.append(part_marker(part, f"messages[{index}].content[{part_index}]"))
            continue
        if part_type != "text":
            raise ValueError(
                f"messages[{index}].content[{part_index}].type {part_type!r} is not supported "
                f"(text, image_url, video_url)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{index}].content[{part_index}].text must be a string, got {text!r}")
        texts.append(text)
    return "".join(texts)


def _normalize_tool_call(call: Any, index: int, call_index: int) -> dict:
    where = f"messages[{index}].tool_calls[{call_index}]"
    if not isinstance(call, dict):
        raise ValueError(f"{where} must be an object, got {call!r}")
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object, got {function!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r}")
    arguments = function.get("arguments", {})
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        # OpenAI clients send arguments as a JSON string; the template renders an object.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {arguments!r} ({exc})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, got {arguments!r}")
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


def _normalize_message(message: Any, index: int) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object, got {message!r}")
    if "role" not in message:
        raise ValueError(f"messages[{index}].role is missing")
    role = message["role"]
    if role not in VALID_ROLES:
        raise ValueError(f"messages[{index}].role {role!r} is not one of {list(VALID_ROLES)}")
    out = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        out["content"] = _join_text_parts(content, index)
    elif content is None:
        if role != "assistant":
            raise ValueError(f"messages[{index}].content is missing for role {role!r}")
        out["content"] = ""
    elif not isinstance(content, str):
        raise ValueError(
            f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
        )
    if role == "assistant":
        reasoning = next((message[k] for k in _REASONING_ALIASES if message.get(k) is not None), None)
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"messages[{index}].reasoning_content must be a string, got {type(reasoning).__name__}")
        out["reasoning_content"] = reasoning
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise ValueError(f"messages[{index}].tool_calls must be a list, got {type(tool_calls).__name__}")
            out["tool_calls"] = [_normalize_tool_call(c, index, i) for i, c in enumerate(tool_calls)]
    elif message.get("tool_calls"):
        raise ValueError(f"messages[{index}].tool_calls is only allowed on assistant messages, not role {role!r}")
    return out


def _validate_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{index}] must be an object, got {tool!r}")
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{index}].function.name must be a string, got {tool!r}")
    return tools


def check_reasoning_effort(effort: Any, where: str = "reasoning_effort") -> str:
    """`effort` if it is one of REASONING_EFFORTS, else a ValueError naming `where` and the levels."""
    if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
        raise ValueError(f"{where} must be one of {list(REASONING_EFFORTS)} (MiniMax-M3.1's levels), got {effort!r}")
    return effort


def template_kwargs(defaults: dict, own: dict | None, effort: str | None = None,
                    where: str = "reasoning_effort") -> dict:
    """A request's template variables: the server's `defaults`, then the request's own
    chat_template_kwargs, then its OpenAI reasoning effort (`where` names the field, one of
    OPENAI_EFFORTS): the thinking_mode of EFFORT_TO_THINKING_MODE unless chat_template_kwargs
    sets one, and for low..max M3.1's `reasoning_effort` of the same name. An effort and a
    different chat_template_kwargs.reasoning_effort in the same request are a ValueError."""
    kwargs = {**defaults, **(own or {})}
    if effort is None:
        return kwargs
    if not isinstance(effort, str) or effort not in OPENAI_EFFORTS:
        raise ValueError(f"{where} must be one of {list(OPENAI_EFFORTS)}, got {effort!r}")
    if "thinking_mode" not in (own or {}):
        kwargs["thinking_mode"] = EFFORT_TO_THINKING_MODE[effort]
    if effort not in REASONING_EFFORTS:
        return kwargs
    given = (own or {}).get("reasoning_effort")
    if given is not None and given != effort:
        raise ValueError(f"{where} {effort!r} and chat_template_kwargs.reasoning_effort {given!r} disagree")
    return {**kwargs, "reasoning_effort": effort}


def render_chat(
    template: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
    bos_token: str = "]~b]",
    eos_token: str = "[e~[",
) -> str:
    """Renders messages (OpenAI chat format) into the prompt text.

    Content may be a string or a list of {"type": "text", "text": ...} parts (joined). Assistant
    tool-call arguments may be a JSON string or an object; both render identically. Extra template
    variables (e.g. thinking_mode, reasoning_effort) come from chat_template_kwargs. Raises ValueError for malformed
    input, naming the message index and field.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {messages!r}")
    normalized = [_normalize_message(m, i) for i, m in enumerate(messages)]
    kwargs = dict(chat_template_kwargs or {})
    thinking_mode = kwargs.get("thinking_mode")
    if thinking_mode is not None and thinking_mode not in THINKING_MODES:
        raise ValueError(
            f"chat_template_kwargs.thinking_mode must be one of {list(THINKING_MODES)}, got {thinking_mode!r}"
        )
    effort = kwargs.get("reasoning_effort")
    if effort is not None:
        check_reasoning_effort(effort, "chat_template_kwargs.reasoning_effort")
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & kwargs.keys()
    if reserved:
        raise ValueError(f"chat_template_kwargs may not override {sorted(reserved)}")
    variables = {
        **kwargs,
        "messages": normalized,
        "tools": _validate_tools(tools) if tools else None,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    compiled = _compile(template)  # a broken template is a server bug: let its syntax error propagate
    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template rejected the request: {exc}") from exc
