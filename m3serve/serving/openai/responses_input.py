"""What a Responses API request means in chat terms: `input` items -> chat messages (with the
earlier reasoning on assistant turns, so the chat template renders it back into the prompt),
function tools and `tool_choice` -> the chat shapes, `text.format` -> `response_format`,
`reasoning.effort` -> M3's thinking mode; plus the signed reasoning blob
(`encrypted_content`) and the bounded store behind `previous_response_id`.

Every malformed item is an `APIError(400)` whose `param` names the item and field.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from m3serve.serving.errors import APIError
from m3serve.serving.signing import ReasoningSigner
from m3serve.serving.tool_parser import warn_dropped_tool

logger = logging.getLogger(__name__)

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class ResponseStore:
    """Stored responses for `previous_response_id`: id -> (response body, the conversation as
    chat messages including the response's own output). Bounded by count and by the characters
    held; the oldest entries go first."""

    def __init__(self, max_entries: int = 1000, max_chars: int = 64 << 20):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, response: dict, messages: list[dict]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if size > self.max_chars:
            return
        with self._lock:
            self._entries[response_id] = (response, messages, size)
            self._chars += size
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._chars -= dropped

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry[0], entry[1]

    def __len__(self) -> int:
        return len(self._entries)


def _text_of_parts(content: Any, param: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    """A string, or a list of text parts joined; anything else is a 400 naming the part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, f"must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(where, f"must be an object, got {_shown(part)}")
        kind = part.get("type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in kinds:
            raise _bad(f"{where}.type", f"{_shown(kind)} is not supported (m3serve takes text only: "
                                        f"{', '.join(kinds)})")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.text", f"must be a string, got {_shown(part.get('text'))}")
        texts.append(part["text"])
    return "".join(texts)


def _user_content(content: Any, param: str):
    """A user / system message's content: its text, or (with `input_image` parts) the text and
    `image_url` parts in order; the image parts keep their request path for errors."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of_parts(content, param)
    parts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad(f"{where}.image_url", "must be a URL string (file_id inputs are not supported)")
            parts.append({"type": "image_url", "image_url": {"url": url}, "_where": where})
        else:
            parts.append({"type": "text", "text": _text_of_parts([part], param)})
    return parts


def _reasoning_text(item: dict, param: str, signer: ReasoningSigner) -> str:
    blob = item.get("encrypted_content")
    if blob is not None:
        if not isinstance(blob, str):
            raise _bad(f"{param}.encrypted_content", f"must be a string, got {type(blob).__name__}")
        text = signer.open(blob)
        if text is None:
            raise _bad(f"{param}.encrypted_content", "not an encrypted_content blob issued by this server (altered, "
                                                     "truncated, or signed with another key; see "
                                                     "--responses-signing-key)")
        return text
    for field, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise _bad(f"{param}.{field}", f"must be a list, got {type(parts).__name__}")
        if parts:
            return "\n".join(_text_of_parts([p], f"{param}.{field}", (kind, "text")) for p in parts)
    return ""


def _known_call_ids(messages: list[dict]) -> set[str]:
    return {call.get("id") for m in messages for call in (m.get("tool_calls") or []) if isinstance(call, dict)}


def _string_field(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise _bad(f"{param}.{name}", f"must be a non-empty string, got {_shown(value)}")
    return value


def input_messages(items: Any, prior: list[dict], signer: ReasoningSigner) -> list[dict]:
    """The chat messages of `input` (a string, or a list of items) following `prior` (the
    stored conversation of previous_response_id). Consecutive reasoning, assistant message and
    function_call items form one assistant turn, as the model produced them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    known = _known_call_ids(prior)
    turn: dict | None = None       # the assistant turn items are still being added to
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(param, f"must be an object, got {_shown(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_TYPES:
            raise _bad(f"{param}.type", f"{_shown(kind)} is not supported; the item types are "
                                        f"{', '.join(_ITEM_TYPES)}")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{param}.role", f"must be one of {', '.join(_ROLES)}, got {_shown(role)}")
            if "content" not in item:
                raise _bad(f"{param}.content", "is required")
            text = (_text_of_parts(item["content"], f"{param}.content") if role == "assistant"
                    else _user_content(item["content"], f"{param}.content"))
            if role == "assistant":
                if turn is not None and not turn["content"] and not turn.get("tool_calls"):
                    turn["content"] = text
                else:
                    turn = {"role": "assistant", "content": text}
                    out.append(turn)
            else:
                turn = None
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item, param, signer)
            if turn is not None and not turn["content"] and not turn.get("tool_calls"):
                turn["reasoning_content"] = "\n".join(t for t in (turn.get("reasoning_content"), text) if t)
            else:
                turn = {"role": "assistant", "content": "", "reasoning_content": text}
                out.append(turn)
        elif kind == "function_call":
            call_id = _string_field(item, "call_id", param)
            name = _string_field(item, "name", param)
            arguments = item.get("arguments", "{}")
            if not isinstance(arguments, str):
                raise _bad(f"{param}.arguments", f"must be a JSON string, got {type(arguments).__name__}")
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise _bad(f"{param}.arguments", f"is not valid JSON ({e})") from None
            if not isinstance(parsed, dict):
                raise _bad(f"{param}.arguments", f"must be a JSON object, got {_shown(arguments)}")
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}})
            known.add(call_id)
        else:   # function_call_output
            call_id = _string_field(item, "call_id", param)
            if call_id not in known:
                raise _bad(f"{param}.call_id", f"no function_call with call_id {call_id!r} comes before it")
            if "output" not in item:
                raise _bad(f"{param}.output", "is required")
            turn = None
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text_of_parts(item["output"], f"{param}.output")})
    return out


# Tool kinds OpenAI runs on its own servers (or on the client, for local_shell / computer use)
# that a local model server cannot run: dropped from the prompt with a warning, as clients such
# as Codex send some of them by default (`web_search`).
_HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                 "code_interpreter", "image_generation", "computer_use_preview", "computer_use", "mcp",
                 "local_shell", "shell", "apply_patch", "custom", "tool_search")


def _function_tool(tool: dict, param: str) -> dict:
    """One `{type: function, name, description?, parameters?}` in chat shape."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{param}.name", f"must be a non-empty string, got {_shown(name)}")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{param}.parameters", f"must be a JSON schema object, got {_shown(parameters)}")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{param}.description", f"must be a string, got {_shown(description)}")
    function = {"name": name, **({"description": description} if description else {}),
                **({"parameters": parameters} if parameters is not None else {})}
    return {"type": "function", "function": function}


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, dict[str, str]]:
    """Responses tools in chat shape, and the namespace of each function that came from one.

    `function` tools pass; a `namespace` entry ({name, description?, tools: [function, ...]})
    contributes its functions under their own names (the call the model makes is reported back
    with the namespace); tools that run elsewhere (`_HOSTED_TOOLS`) are dropped with a warning."""
    if tools is None:
        return None, {}
    out, namespaces = [], {}
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(param, f"must be an object, got {_shown(tool)}")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool, param))
        elif kind == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace:
                raise _bad(f"{param}.name", f"must be a non-empty string, got {_shown(namespace)}")
            if not isinstance(members, list):
                raise _bad(f"{param}.tools", f"must be a list of function tools, got {_shown(members)}")
            for j, member in enumerate(members):
                where = f"{param}.tools[{j}]"
                if not isinstance(member, dict):
                    raise _bad(where, f"must be an object, got {_shown(member)}")
                if member.get("type", "function") != "function":
                    logger.warning("responses: dropping %s of type %r (only functions run here)",
                                   where, member.get("type"))
                    continue
                function = _function_tool(member, where)
                out.append(function)
                namespaces[function["function"]["name"]] = namespace
        elif kind in _HOSTED_TOOLS:
            warn_dropped_tool("responses", kind, "m3serve runs no hosted tools, only functions")
        else:
            raise _bad(f"{param}.type", f"{_shown(kind)} is not a tool type m3serve knows (function, "
                                        f"namespace; hosted tools such as web_search are dropped)")
    names = [t["function"]["name"] for t in out]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise _bad("tools", f"function name {duplicate!r} appears more than once")
    return out, namespaces


def chat_tool_choice(tool_choice: str | dict | None):
    """Responses tool_choice -> chat's: strings pass; {type: function, name} -> the named form."""
    if tool_choice is None or isinstance(tool_choice, str):
        if tool_choice not in (None, "auto", "none", "required"):
            raise _bad("tool_choice", f"must be auto, none, required or {{'type': 'function', 'name': ...}}, "
                                      f"got {_shown(tool_choice)}")
        return tool_choice
    if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
        raise _bad("tool_choice", f"must be auto, none, required or {{'type': 'function', 'name': ...}}, "
                                  f"got {_shown(tool_choice)}")
    return {"type": "function", "function": {"name": tool_choice["name"]}}


def response_format(fmt: dict | None) -> dict | None:
    """text.format -> chat's response_format (json_schema goes through xgrammar)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema", f"must be a JSON schema object, got {_shown(schema)}")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema}}
    raise _bad("text.format.type", f"must be text, json_object or json_schema, got {_shown(kind)}")


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later turn renders (one assistant turn)."""
    turn: dict = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = item["content"][0]["text"] if item["content"] else ""
        elif item["type"] == "message":
            turn["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": json.loads(item["arguments"] or "{}")}})
    return [turn]
