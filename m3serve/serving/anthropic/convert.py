"""Anthropic request → the chat form the template renders: messages, tools, tool_choice and the
thinking mode.

Every block is checked here and a problem is a ValueError whose message starts with the block's
path (`messages.1.content.0.input: ...`). What maps where:
- `system` (string or text blocks) → a leading system message; a message of role `system` inside
  `messages` (Claude Code sends them) → a system message where it stands;
- `text` blocks → message content; `thinking` blocks of assistant turns → `reasoning_content`,
  which M3's template renders back as `<mm:think>…</mm:think>` on every earlier turn (a block
  whose text was left out, `thinking.display: "omitted"`, gets it back from the signature this
  server issued; a block with a foreign signature is taken as given);
  `redacted_thinking` holds no readable text and is skipped; `tool_use` → `tool_calls` (input as
  the argument object); each `tool_result` → a `tool` message (text content; `is_error` marks it;
  its `tool_use_id` must be a tool_use of an earlier assistant turn);
- `image` blocks of user turns (base64 or url sources) → `image_url` parts in place (the
  prompt's image markers; the pixels are fetched and decoded by the media front);
- `document` blocks → a 400 naming the block (documents are not supported, on any model);
- server tools (a `type` other than `custom`: web search, code execution, ...) → dropped with a
  warning (they run on Anthropic's side);
- `cache_control` on any block or tool is accepted (prefix caching is automatic);
- `output_config.effort` → the template's `reasoning_effort` (MiniMax-M3.1's levels);
- `context_management` edits that clear earlier thinking are applied (`apply_context_edits`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from m3serve.serving.chat_template import REASONING_EFFORTS
from m3serve.serving.signing import ReasoningSigner
from m3serve.serving.tool_parser import warn_dropped_tool

logger = logging.getLogger(__name__)

# Claude Code sends roles outside Anthropic's two for context it injects; they are user turns.
_USER_ROLES = ("user", "ctx", "msg")
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_TOOL_ERROR_PREFIX = "Error: "


@dataclass
class ChatForm:
    """What the chat template and the generation need from a Messages request."""

    messages: list[dict]
    tools: list[dict] | None              # OpenAI shape, for the template and the tool parser
    tool_choice: object                   # "auto" | "none" | "required" | {"type": "function", ...}
    thinking_mode: str | None             # the template's; None = the server's default
    budget_tokens: int | None             # thinking budget (thinking.type "enabled")
    reasoning_effort: str | None = None   # output_config.effort: the template's reasoning_effort
    show_thinking: bool = True            # thinking.display != "omitted": the response carries its text


def _fail(path: str, message: str):
    raise ValueError(f"{path}: {message}")


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _obj(value, path: str) -> dict:
    if not isinstance(value, dict):
        _fail(path, f"must be an object, got {_kind(value)}")
    return value


def _string(block: dict, key: str, path: str, required: bool = True) -> str | None:
    value = block.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        _fail(f"{path}.{key}", f"must be a string, got {_kind(value)}")
    return value


def _block_type(block: dict, path: str) -> str:
    kind = block.get("type")
    if not isinstance(kind, str):
        _fail(f"{path}.type", f"must be a string naming the block type, got {_kind(kind)}")
    if kind == "document":
        _fail(f"{path}.type", "'document' blocks (PDFs, text documents) are not supported by this server; "
                              "send the document's text in a text block")
    return kind


def _texts(content, path: str) -> str:
    """A system prompt or tool result: a string, or a list of text blocks (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(path, f"must be a string or a list of text blocks, got {_kind(content)}")
    parts = []
    for i, block in enumerate(content):
        block = _obj(block, f"{path}.{i}")
        kind = _block_type(block, f"{path}.{i}")
        if kind != "text":
            _fail(f"{path}.{i}.type", f"expected 'text', got {kind!r}")
        parts.append(_string(block, "text", f"{path}.{i}"))
    return "\n".join(parts)


def _tool_result(block: dict, path: str) -> dict:
    tool_use_id = _string(block, "tool_use_id", path)
    content = block.get("content")
    text = "" if content is None else _texts(content, f"{path}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        _fail(f"{path}.is_error", f"must be a boolean, got {_kind(is_error)}")
    if is_error:
        text = _TOOL_ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _image_part(block: dict, path: str) -> dict:
    """An `image` block -> an `image_url` part (a data URL for base64 sources)."""
    source = _obj(block.get("source"), f"{path}.source")
    kind = _string(source, "type", f"{path}.source")
    if kind == "base64":
        media_type = _string(source, "media_type", f"{path}.source")
        if media_type not in _IMAGE_TYPES:
            _fail(f"{path}.source.media_type", f"must be one of {', '.join(_IMAGE_TYPES)}, got {media_type!r}")
        url = f"data:{media_type};base64,{_string(source, 'data', f'{path}.source')}"
    elif kind == "url":
        url = _string(source, "url", f"{path}.source")
    else:
        _fail(f"{path}.source.type", f"must be 'base64' or 'url', got {kind!r}")
    return {"type": "image_url", "image_url": {"url": url}, "_where": path}


def _user_content(texts: list) -> str | list:
    """Joined text, or (with images) text and image parts in order, texts joined by newlines."""
    if all(isinstance(t, str) for t in texts):
        return "\n".join(texts)
    parts, previous_text = [], False
    for t in texts:
        if isinstance(t, str):
            parts.append({"type": "text", "text": ("\n" if previous_text else "") + t})
        else:
            parts.append(t)
        previous_text = isinstance(t, str)
    return parts


def _user_messages(content: list, path: str, call_ids: set[str]) -> list[dict]:
    """A user turn: runs of text (and images) become user messages, each tool_result a tool
    message, in order. A tool_result must answer a tool_use of an earlier assistant turn
    (`call_ids`), as Responses' function_call_output must."""
    out: list[dict] = []
    texts: list = []
    for i, block in enumerate(content):
        where = f"{path}.{i}"
        block = _obj(block, where)
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "image":
            texts.append(_image_part(block, where))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": _user_content(texts)})
                texts = []
            result = _tool_result(block, where)
            if result["tool_call_id"] not in call_ids:
                _fail(f"{where}.tool_use_id", f"no tool_use with id {result['tool_call_id']!r} comes before it "
                                              "(a tool_result answers a tool_use of an earlier assistant turn)")
            out.append(result)
        else:
            _fail(f"{where}.type", f"{kind!r} is not a user content block (expected text, image or tool_result)")
    if texts or not out:
        out.append({"role": "user", "content": _user_content(texts)})
    return out


def _assistant_message(content: list, path: str, signer: ReasoningSigner) -> dict:
    texts, thoughts, calls = [], [], []
    for i, block in enumerate(content):
        where = f"{path}.{i}"
        block = _obj(block, where)
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "thinking":
            thought = _string(block, "thinking", where)
            signature = _string(block, "signature", where, required=False)
            signed = signer.open(signature) if signature else None
            thoughts.append(thought or signed or "")
        elif kind == "redacted_thinking":
            _string(block, "data", where)        # opaque to this server: nothing to render
        elif kind == "tool_use":
            call_id, name = _string(block, "id", where), _string(block, "name", where)
            if not name:
                _fail(f"{where}.name", "must not be empty")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                _fail(f"{where}.input", f"must be an object, got {_kind(arguments)}")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        else:
            _fail(f"{where}.type", f"{kind!r} is not an assistant content block "
                                   "(expected text, thinking, redacted_thinking or tool_use)")
    message = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def messages_of(system, messages: list, signer: ReasoningSigner) -> list[dict]:
    """The chat messages of `system` plus Anthropic `messages`."""
    out, call_ids = [], set()
    if system is not None:
        text = _texts(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for index, message in enumerate(messages):
        path = f"messages.{index}"
        message = _obj(message, path)
        role = message.get("role")
        if role not in (*_USER_ROLES, "assistant", "system"):
            # Anthropic's own wording, which clients recognise
            _fail(f"{path}.role", f"Unexpected role {role!r}. The roles are 'user', 'assistant' and 'system'")
        content = message.get("content")
        if role == "system":
            out.append({"role": "system", "content": _texts(content, f"{path}.content")})
            continue
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            _fail(f"{path}.content", f"must be a string or a list of content blocks, got {_kind(content)}")
        if role == "assistant":
            out.append(_assistant_message(content, f"{path}.content", signer))
            call_ids.update(call["id"] for call in out[-1].get("tool_calls", ()))
        else:
            out.extend(_user_messages(content, f"{path}.content", call_ids))
    return out


def tools_of(tools: list | None) -> list[dict] | None:
    """Anthropic client tools (`name`, `description`, `input_schema`) in OpenAI function shape."""
    if tools is None:
        return None
    out, seen = [], set()
    for i, tool in enumerate(tools):
        path = f"tools.{i}"
        tool = _obj(tool, path)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str):
                _fail(f"{path}.type", f"must be a string, got {_kind(kind)}")
            warn_dropped_tool("messages", kind, "server tools do not run here, only client tools "
                                                "with an input_schema")
            continue
        name = _string(tool, "name", path)
        if not name:
            _fail(f"{path}.name", "must not be empty")
        if name in seen:
            _fail(f"{path}.name", f"{name!r} is defined twice")
        seen.add(name)
        description = _string(tool, "description", path, required=False)
        schema = _obj(tool.get("input_schema"), f"{path}.input_schema")
        schema_type = schema.get("type", "object")
        if schema_type != "object":
            _fail(f"{path}.input_schema.type", f"must be 'object', got {schema_type!r}")
        properties = schema.get("properties")
        if properties is not None and not isinstance(properties, dict):
            _fail(f"{path}.input_schema.properties", f"must be an object, got {_kind(properties)}")
        required = schema.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            _fail(f"{path}.input_schema.required", "must be a list of property names")
        function = {"name": name, "parameters": {**schema, "type": "object"}}
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out or None


def tool_choice_of(choice, tools: list[dict] | None):
    """Anthropic `tool_choice` in chat form: auto → "auto", any → "required", tool → named,
    none → "none". Without tools only auto and none are allowed."""
    if choice is None:
        return "auto" if tools else "none"
    choice = _obj(choice, "tool_choice")
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        _fail("tool_choice.type", f"must be one of 'auto', 'any', 'tool', 'none', got {kind!r}")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        _fail("tool_choice.disable_parallel_tool_use", f"must be a boolean, got {_kind(parallel)}")
    if kind == "none" or (kind == "auto" and not tools):
        return "none"
    if not tools:
        _fail("tool_choice.type", f"{kind!r} needs a non-empty tools list")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    name = _string(choice, "name", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        _fail("tool_choice.name", f"{name!r} is not one of the tools {names}")
    return {"type": "function", "function": {"name": name}}


def thinking_of(thinking) -> tuple[str | None, int | None, bool]:
    """(M3 thinking mode, budget, whether the response shows the thinking text) of `thinking`:
    enabled → ("enabled", budget_tokens), disabled → ("disabled", None), adaptive →
    ("adaptive", None), absent → (None, None); `display` "omitted" hides the text (it still
    travels in the block's signature); any other display ("summarized", "updates", ... : M3
    writes no summaries) shows the text as it is."""
    if thinking is None:
        return None, None, True
    thinking = _obj(thinking, "thinking")
    kind = thinking.get("type")
    display = thinking.get("display")
    if display is not None and not isinstance(display, str):
        _fail("thinking.display", f"must be a string, got {_kind(display)}")
    show = display != "omitted"
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1:
            _fail("thinking.budget_tokens", f"must be a positive integer, got {budget!r}")
        return "enabled", budget, show
    if kind in ("disabled", "adaptive"):
        return kind, None, show
    _fail("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")


def effort_of(output_config) -> str | None:
    """`output_config.effort` (Anthropic's levels low, medium, high, xhigh, max are MiniMax-M3.1's
    too) or None; its other keys do not apply here and are logged."""
    if output_config is None:
        return None
    output_config = _obj(output_config, "output_config")
    other = sorted(set(output_config) - {"effort"})
    if other:
        logger.debug("messages: ignoring output_config keys that do not apply here: %s", other)
    effort = output_config.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        _fail("output_config.effort", f"must be one of {list(REASONING_EFFORTS)}, got {effort!r}")
    return effort


_CLEAR_THINKING = "clear_thinking_20251015"


def apply_context_edits(messages: list[dict], context_management) -> None:
    """`context_management.edits` that change what the prompt holds, applied in place:
    `clear_thinking_20251015` drops the thinking of all but the last `keep.value` assistant
    turns that have some (`keep` "all" keeps every one; absent, the last one). Other edits
    (clearing old tool results past a token trigger) are accepted and logged: the prompt keeps
    what the client sent."""
    if context_management is None:
        return
    edits = _obj(context_management, "context_management").get("edits") or []
    if not isinstance(edits, list):
        _fail("context_management.edits", f"must be a list, got {_kind(edits)}")
    for i, edit in enumerate(edits):
        path = f"context_management.edits.{i}"
        edit = _obj(edit, path)
        if edit.get("type") != _CLEAR_THINKING:
            logger.debug("messages: %s of type %r accepted, not applied", path, edit.get("type"))
            continue
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all":
            continue
        keep = _obj(keep, f"{path}.keep")
        value = keep.get("value")
        if keep.get("type") != "thinking_turns" or type(value) is not int or value < 0:
            _fail(f"{path}.keep", f"must be 'all' or {{'type': 'thinking_turns', 'value': N >= 0}}, got {keep!r}")
        thinking = [m for m in messages if m["role"] == "assistant" and m.get("reasoning_content")]
        for message in thinking[:len(thinking) - value]:
            del message["reasoning_content"]


def chat_form(request, signer: ReasoningSigner) -> ChatForm:
    """The chat form of a MessagesRequest or CountTokensRequest (ValueError naming the field);
    `signer` opens the signatures of thinking blocks this server issued."""
    messages = messages_of(request.system, request.messages, signer)
    apply_context_edits(messages, request.context_management)
    tools = tools_of(request.tools)
    tool_choice = tool_choice_of(request.tool_choice, tools)
    mode, budget, show = thinking_of(request.thinking)
    return ChatForm(messages, tools, tool_choice, mode, budget, effort_of(request.output_config), show)
