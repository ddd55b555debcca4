"""Tool-call parsers: turn a model's tool-call markup into OpenAI `tool_calls`.

Owns the `minimax_m3` parser (docs/model.md §7: namespace-prefixed `<tool_call>` / `<invoke>` blocks with
one element per argument), the schema-driven typing of argument values, and the name -> parser
registry behind `--tool-call-parser`. Streaming and non-streaming share one state machine.
"""
from __future__ import annotations

import json
import logging
import math
import re
import uuid
from dataclasses import dataclass, field

from m3serve.model.markup import NAMESPACE
from m3serve.serving.reasoning import partial_suffix_len

logger = logging.getLogger(__name__)
_dropped_kinds: set[tuple[str, str]] = set()


def warn_dropped_tool(api: str, kind: str, why: str) -> None:
    """A request's tool of a kind that runs elsewhere (a hosted or server tool) is left out of the
    prompt: warned once per API and kind, since clients send the same tools on every request."""
    if (api, kind) not in _dropped_kinds and len(_dropped_kinds) < 256:
        _dropped_kinds.add((api, kind))
        logger.warning("%s: dropping tools of type %r: %s (the model is not told about them)", api, kind, why)

TOOL_CALL_START = NAMESPACE + "<tool_call>"
TOOL_CALL_END = NAMESPACE + "</tool_call>"
INVOKE_START = NAMESPACE + "<invoke"
INVOKE_END = NAMESPACE + "</invoke>"
ELEMENT_START = NAMESPACE + "<"
MAX_DEPTH = 128
TEXT_KEY = "$text"
# A tag name or invoke header longer than this without its closing '>' is malformed; the bound
# keeps a runaway tag from holding the stream forever.
MAX_TAG_CHARS = 512

_INVOKE_HEADER = re.compile(r"""\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))\s*""")
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


# ---------------------------------------------------------------------------------------------
# Argument typing from the request's JSON schema


@dataclass(frozen=True)
class _Type:
    """A normalized JSON-schema type: one kind, or a union tried in order."""

    kind: str  # string | integer | number | boolean | null | object | array | union
    properties: dict = field(default_factory=dict)  # object: name -> _Type
    additional: _Type | None = None  # object: type of names not in properties
    items: _Type | None = None  # array: type of every item
    options: tuple = ()  # union: _Type alternatives


_TYPE_ALIASES = {
    "string": "string", "str": "string", "text": "string", "enum": "string",
    "integer": "integer", "int": "integer",
    "number": "number", "float": "number", "double": "number",
    "boolean": "boolean", "bool": "boolean",
    "null": "null",
    "object": "object", "dict": "object",
    "array": "array", "list": "array",
}


def _normalize(schema) -> _Type | None:
    """Reduces one property schema to a _Type; None when it says nothing usable."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return _from_kind(kind, schema)
    if isinstance(kind, list):
        return _union([_from_kind(k, schema) for k in kind if isinstance(k, str)])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return _union([_normalize(option) for option in schema[key]])
    if isinstance(schema.get("enum"), list):
        return _enum_type(schema["enum"])
    if "const" in schema:
        return _enum_type([schema["const"]])
    if "items" in schema:
        return _from_kind("array", schema)
    if "properties" in schema or "additionalProperties" in schema:
        return _from_kind("object", schema)
    return None


def _enum_type(values: list) -> _Type | None:
    """An enum (or const) without `type` is typed by its values (integers and floats together: number)."""
    kinds: list[str] = []
    for value in values:
        kind = ("null" if value is None else "boolean" if isinstance(value, bool) else
                "integer" if isinstance(value, int) else "number" if isinstance(value, float) else
                "string" if isinstance(value, str) else None)
        if kind is not None and kind not in kinds:
            kinds.append(kind)
    if "number" in kinds and "integer" in kinds:
        kinds.remove("integer")
    return _union([_Type(k) for k in kinds])


def _from_kind(kind: str, schema: dict) -> _Type | None:
    kind = _TYPE_ALIASES.get(kind.strip().lower())
    if kind == "object":
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        return _Type(
            "object",
            properties={name: t for name, sub in properties.items() if (t := _normalize(sub)) is not None},
            additional=_normalize(schema.get("additionalProperties")),
        )
    if kind == "array":
        return _Type("array", items=_normalize(schema.get("items")))
    return _Type(kind) if kind else None


def _union(types: list[_Type | None]) -> _Type | None:
    types = [t for t in types if t is not None]
    if not types:
        return None
    return types[0] if len(types) == 1 else _Type("union", options=tuple(types))


@dataclass
class _Element:
    """One parsed argument element: its raw text, and its child elements (empty for a leaf)."""

    name: str
    text: str
    children: list[_Element]


_NO_VALUE = object()  # "this text does not convert to this type"


def _reject_constant(name: str):
    raise ValueError(f"non-finite JSON constant {name}")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"JSON number {literal} overflows a float")
    return value


def _loads(text: str):
    """json.loads that refuses NaN/Infinity, which json.dumps would write as invalid JSON."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def _convert_text(kind: _Type | None, text: str):
    """Types a leaf's raw text by its schema type only: no schema (a parameter the schema does
    not list, a tool not in the request, a tool without parameters) keeps the raw string. Text
    that fails its type is decoded as JSON, and kept raw if that fails too."""
    if kind is None:
        return text
    stripped = text.strip()
    if stripped.lower() == "null" and kind.kind != "string":
        return None
    value = _try_text(kind, text, stripped)
    if value is not _NO_VALUE:
        return value
    try:
        return _loads(stripped)
    except ValueError:
        return text


def _coerce(kind: _Type | None, value):
    """Types a value of inline JSON by the nested schema, as the element form is typed: strings
    are converted like element text, numbers and booleans become text where a string is wanted,
    objects and arrays are typed member by member."""
    if kind is None or value is None:
        return value
    if kind.kind == "union":
        if isinstance(value, str):
            return _convert_text(kind, value)
        want = "object" if isinstance(value, dict) else "array" if isinstance(value, list) else None
        option = next((o for o in kind.options if o.kind == want), None)
        return _coerce(option, value) if option is not None else value
    if isinstance(value, str):
        return _convert_text(kind, value)
    if kind.kind == "string" and isinstance(value, (bool, int, float)):
        return json.dumps(value)
    if kind.kind == "object" and isinstance(value, dict):
        return {k: _coerce(kind.properties.get(k, kind.additional), v) for k, v in value.items()}
    if kind.kind == "array" and isinstance(value, list):
        return [_coerce(kind.items, v) for v in value]
    return value


def _to_int(text: str):
    if not _INTEGER.fullmatch(text):
        return _NO_VALUE
    try:
        return int(text)
    except ValueError:  # past Python's int-from-string digit limit
        return _NO_VALUE


def _try_text(kind: _Type, text: str, stripped: str):
    """Converts text to exactly `kind`, or returns _NO_VALUE."""
    if kind.kind == "string":
        return text  # strings stay raw, whitespace included
    if kind.kind == "integer":
        return _to_int(stripped)
    if kind.kind == "number":
        if not _NUMBER.fullmatch(stripped):
            return _NO_VALUE
        if _INTEGER.fullmatch(stripped):
            return _to_int(stripped)
        number = float(stripped)
        return number if math.isfinite(number) else _NO_VALUE
    if kind.kind == "boolean":
        return {"true": True, "1": True, "false": False, "0": False}.get(stripped.lower(), _NO_VALUE)
    if kind.kind == "null":
        return _NO_VALUE  # "null" itself was handled by the caller
    if kind.kind in ("object", "array"):
        empty, expected = ({}, dict) if kind.kind == "object" else ([], list)
        if not stripped:
            return empty
        try:
            value = _loads(stripped)
        except ValueError:
            return _NO_VALUE
        return _coerce(kind, value) if isinstance(value, expected) else _NO_VALUE
    for option in kind.options:
        value = _try_text(option, text, stripped)
        if value is not _NO_VALUE:
            return value
    return _NO_VALUE


def _convert(kind: _Type | None, element: _Element):
    """Types one element: a leaf from its text, a parent as an object or (schema says) array."""
    if not element.children:
        return _convert_text(kind, element.text)
    children = list(element.children)
    if element.text.strip():
        name = TEXT_KEY
        while any(child.name == name for child in children):
            name = "$" + name
        children.append(_Element(name, element.text, []))
    while kind is not None and kind.kind == "union":
        kind = next((o for o in kind.options if o.kind in ("object", "array", "union")), None)
    if kind is not None and kind.kind == "array":
        return [_convert(kind.items, child) for child in children]
    # Without an object schema (none, or a scalar one) children still make an untyped object.
    return _object_from(children, kind if kind is not None and kind.kind == "object" else None)


def _object_from(children: list[_Element], kind: _Type | None) -> dict:
    """Builds an object from elements; a repeated name collects its values into a list."""
    result: dict = {}
    repeated: set[str] = set()
    for child in children:
        child_kind = None if kind is None else kind.properties.get(child.name, kind.additional)
        value = _convert(child_kind, child)
        if child.name not in result:
            result[child.name] = value
        elif child.name in repeated:
            result[child.name].append(value)
        else:
            result[child.name] = [result[child.name], value]
            repeated.add(child.name)
    return result


# ---------------------------------------------------------------------------------------------
# Markup scanning helpers (all take a cursor so a long buffer is never copied per step)

_SPACE = re.compile(r"\s*")


def _waits_for(text: str, pos: int, *markers: str) -> bool:
    """Whether text[pos:] is a proper prefix of one of `markers` (more text may complete it)."""
    rest = len(text) - pos
    return any(rest < len(m) and m.startswith(text[pos:]) for m in markers)


def _safe_end(text: str, pos: int, *markers: str) -> int:
    """End of text[pos:] that can be consumed without cutting into a partial marker."""
    tail = text[max(pos, len(text) - max(len(m) for m in markers)):]
    return len(text) - max(partial_suffix_len(tail, m) for m in markers)


# ---------------------------------------------------------------------------------------------
# The parser


@dataclass
class ToolParseResult:
    """Non-streaming result: the visible content and OpenAI-shaped tool calls."""

    content: str | None
    tool_calls: list[dict]


@dataclass
class StreamDelta:
    """What one streamed text delta produced: a content delta and tool-call deltas."""

    content: str | None = None
    tool_call_deltas: list[dict] = field(default_factory=list)


@dataclass
class _OpenElement:
    """An argument element whose closing tag has not arrived yet."""

    name: str
    pieces: list[str] = field(default_factory=list)  # its own text, in arrival order
    children: list[_Element] = field(default_factory=list)


@dataclass
class _Call:
    index: int
    id: str
    name: str
    elements: list[_Element] = field(default_factory=list)  # completed top-level arguments


# Parser modes.
_TEXT = "text"  # plain content until a <tool_call> opens
_BLOCK = "block"  # inside <tool_call>, between invokes
_INVOKE = "invoke"  # inside <invoke>: between arguments, or inside one (see _open_elements)
_SKIP = "skip"  # after a malformed element or header: drop text up to </invoke> or </tool_call>
_DONE = "done"  # after </tool_call>: text is dropped, another <tool_call> may still open
_OFF = "off"  # tool_choice "none": everything is content


def _check_tool_choice(tool_choice, tool_names: set[str]) -> str:
    """Validates tool_choice; returns "auto", "none", "required" or "named"."""
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    if tool_choice is None:
        return "auto"
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ValueError(
            f"tool_choice must be 'auto', 'none', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    if tool_names and name not in tool_names:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools {sorted(tool_names)}")
    return "named"


def _tool_schemas(tools: list[dict] | None) -> dict[str, _Type | None]:
    schemas: dict[str, _Type | None] = {}
    for index, tool in enumerate(tools or []):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"tools[{index}] has no function name: {tool!r}")
        schemas[name] = _normalize(function.get("parameters") or {"type": "object"})
    return schemas


class MiniMaxM3ToolParser:
    """Parses MiniMax-M3 tool-call markup into OpenAI tool calls (docs/model.md §7).

    `tools` are the request's tools (OpenAI shape, `{"type": "function", "function": {...}}`);
    their `parameters` schemas type the argument values. With tool_choice "none" nothing is
    parsed and all text is content; "auto", "required" and a named function parse alike (the
    choice itself is enforced at generation, not here).

    Behaviour: text before the first `<tool_call>` is content, verbatim (its trailing whitespace
    included), except that whitespace alone before a call is no content (None, as vLLM); tool
    markup never reaches content. Each `<invoke>` is one call whose arguments are emitted once,
    at its `</invoke>`. Text after `</tool_call>` is dropped, but a further `<tool_call>` block
    is still parsed. A malformed element (wrong closing tag, stray text or bare namespace marker
    where a tag belongs, nesting past 128) ends its invoke: earlier arguments are kept and the
    text up to `</invoke>` (or `</tool_call>`) is skipped.

    Output cut off (max_tokens) inside markup: an invoke whose header is complete is a call with
    the arguments completed before the cut (valid JSON, never a half-written value); a cut-off
    header yields no call; a cut-off `<tool_call>` opener is dropped, with the whitespace before
    it. The opener counts as cut off when the held tail starts with the namespace marker (one
    token of M3's vocabulary, so plain text rarely holds it) or, with a forced choice, whatever
    its length (the grammar admits nothing else there); a shorter tail under "auto" (`]`, `]<`)
    stays content.

    One instance parses one output: `extract` for a whole text, or `stream` per delta then
    `finish`. The streamed deltas assemble to the `extract` result whatever the chunk
    boundaries (except the random call ids). Work is linear in the output length.
    """

    def __init__(self, tools: list[dict] | None = None, tool_choice="auto"):
        self._schemas = _tool_schemas(tools)
        self._tools = tools
        self.tool_choice = tool_choice
        self._choice = _check_tool_choice(tool_choice, set(self._schemas))
        self._mode = _OFF if self._choice == "none" else _TEXT
        self._pending = ""  # received text not yet consumed, from self._pos on
        self._pos = 0
        self._calls: list[_Call] = []
        self._current: _Call | None = None
        self._open_elements: list[_OpenElement] = []  # the argument being parsed, outermost first
        self._finished = False
        self._forced = self._choice in ("required", "named")
        # Content is whitespace only so far: held, and dropped if a call follows it.
        self._held_space = ""
        self._sent_text = False

    def extract(self, text: str) -> ToolParseResult:
        """Whole-output parse; leaves this instance's streaming state untouched."""
        parser = MiniMaxM3ToolParser(self._tools, self.tool_choice)
        first = parser.stream(text)
        last = parser.finish()
        content = (first.content or "") + (last.content or "")
        calls = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": parser._arguments(call)}}
            for call in parser._calls
        ]
        return ToolParseResult(content or None, calls)

    def stream(self, delta_text: str) -> StreamDelta:
        """Feeds one text delta; returns the content and tool-call deltas now complete."""
        if self._finished:
            raise ValueError("stream() called after finish(); use a new parser per output")
        self._pending = self._pending[self._pos:] + delta_text
        self._pos = 0
        out = StreamDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> StreamDelta:
        """Ends the output: flushes held text and closes a call cut off mid-invoke."""
        self._finished = True
        out = StreamDelta()
        tail = self._pending[self._pos:]
        if self._mode == _OFF:
            self._emit_content(out, tail)
        elif self._mode == _TEXT:
            if tail and (self._forced or tail.startswith(NAMESPACE)):
                self._held_space = ""       # a cut-off <tool_call> opener: markup, not content
            else:
                self._emit_text(out, tail)
            self._emit_content(out, self._held_space)   # no call followed the whitespace
            self._held_space = ""
        elif self._current is not None:
            self._close_call(out)
        self._pending, self._pos = "", 0
        return out

    @property
    def has_tool_calls(self) -> bool:
        """Whether any call has been opened so far."""
        return bool(self._calls)

    def _step(self, out: StreamDelta) -> bool:
        """Advances the state machine once; returns False when it must wait for more text."""
        mode = self._mode
        if mode == _OFF:
            self._emit_content(out, self._pending[self._pos:])
            self._pos = len(self._pending)
            return False
        if mode == _TEXT:
            return self._step_text(out)
        if mode == _DONE:
            return self._step_done()
        if mode == _SKIP:
            return self._step_skip(out)
        if self._open_elements:
            return self._step_element_body()
        self._pos = _SPACE.match(self._pending, self._pos).end()  # layout between tags
        if self._pos == len(self._pending):
            return False
        return self._step_block(out) if mode == _BLOCK else self._step_invoke(out)

    def _step_text(self, out: StreamDelta) -> bool:
        text, pos = self._pending, self._pos
        index = text.find(TOOL_CALL_START, pos)
        if index >= 0:
            self._emit_text(out, text[pos:index])       # verbatim, trailing whitespace included
            self._held_space = ""                       # ... but whitespace alone is no content
            self._pos = index + len(TOOL_CALL_START)
            self._mode = _BLOCK
            return True
        safe = _safe_end(text, pos, TOOL_CALL_START)
        self._emit_text(out, text[pos:safe])
        self._pos = safe
        return False

    def _step_done(self) -> bool:
        index = self._pending.find(TOOL_CALL_START, self._pos)
        if index >= 0:
            self._pos = index + len(TOOL_CALL_START)
            self._mode = _BLOCK
            return True
        self._pos = _safe_end(self._pending, self._pos, TOOL_CALL_START)
        return False

    def _step_skip(self, out: StreamDelta) -> bool:
        text, pos = self._pending, self._pos
        ends = [(i, m) for m in (INVOKE_END, TOOL_CALL_END) if (i := text.find(m, pos)) >= 0]
        if not ends:
            self._pos = _safe_end(text, pos, INVOKE_END, TOOL_CALL_END)
            return False
        index, marker = min(ends)
        self._pos = index + len(marker)
        if self._current is not None:
            self._close_call(out)
        self._mode = _BLOCK if marker == INVOKE_END else _DONE
        return True

    def _step_block(self, out: StreamDelta) -> bool:
        text, pos = self._pending, self._pos
        if text.startswith(TOOL_CALL_END, pos):
            self._pos = pos + len(TOOL_CALL_END)
            self._mode = _DONE
            return True
        if text.startswith(INVOKE_START, pos):
            return self._open_invoke(out)
        if _waits_for(text, pos, TOOL_CALL_END, INVOKE_START):
            return False
        # Stray text between invokes is dropped up to the next namespace marker.
        index = text.find(NAMESPACE, pos + 1)
        self._pos = index if index >= 0 else _safe_end(text, pos + 1, NAMESPACE)
        return True

    def _open_invoke(self, out: StreamDelta) -> bool:
        text = self._pending
        header_start = self._pos + len(INVOKE_START)
        header_end = text.find(">", header_start, header_start + MAX_TAG_CHARS)
        if header_end < 0:
            if len(text) - header_start < MAX_TAG_CHARS:
                return False
            self._mode = _SKIP
            return True
        match = _INVOKE_HEADER.fullmatch(text, header_start, header_end)
        name = next((g for g in match.groups() if g is not None), "").strip() if match else ""
        self._pos = header_end + 1
        if not name:
            self._mode = _SKIP
            return True
        call = _Call(len(self._calls), f"call_{uuid.uuid4().hex[:24]}", name)
        self._calls.append(call)
        self._current = call
        out.tool_call_deltas.append(
            {"index": call.index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}
        )
        self._mode = _INVOKE
        return True

    def _step_invoke(self, out: StreamDelta) -> bool:
        text, pos = self._pending, self._pos
        if text.startswith(INVOKE_END, pos):
            self._pos = pos + len(INVOKE_END)
            self._close_call(out)
            self._mode = _BLOCK
            return True
        if text.startswith(ELEMENT_START, pos) and not text.startswith(ELEMENT_START + "/", pos):
            return self._open_element()
        if _waits_for(text, pos, INVOKE_END, ELEMENT_START):
            return False
        self._malformed()  # text or a foreign closing tag where an argument was expected
        return True

    def _open_element(self) -> bool:
        """Consumes an element's opening tag at the cursor, or waits for its '>'."""
        text = self._pending
        name_start = self._pos + len(ELEMENT_START)
        name_end = text.find(">", name_start, name_start + MAX_TAG_CHARS)
        if name_end < 0:
            if len(text) - name_start >= MAX_TAG_CHARS:
                self._malformed()
                return True
            return False
        name = text[name_start:name_end]
        if not name.strip() or name.startswith("/") or "<" in name or len(self._open_elements) >= MAX_DEPTH:
            self._malformed()
            return True
        self._open_elements.append(_OpenElement(name))
        self._pos = name_end + 1
        return True

    def _step_element_body(self) -> bool:
        """Inside an open element: collects text, opens children, or closes the element."""
        text, pos = self._pending, self._pos
        element = self._open_elements[-1]
        marker = text.find(NAMESPACE, pos)
        if marker < 0:
            safe = _safe_end(text, pos, NAMESPACE)
            element.pieces.append(text[pos:safe])
            self._pos = safe
            return False
        element.pieces.append(text[pos:marker])
        self._pos = marker
        closing = f"{NAMESPACE}</{element.name}>"
        if text.startswith(closing, marker):
            self._pos = marker + len(closing)
            self._open_elements.pop()
            parent = self._open_elements[-1].children if self._open_elements else self._current.elements
            parent.append(_Element(element.name, "".join(element.pieces), element.children))
            return True
        if _waits_for(text, marker, closing):
            return False
        if text.startswith(ELEMENT_START, marker) and not text.startswith(ELEMENT_START + "/", marker):
            return self._open_element()
        self._malformed()  # another element's closing tag, or a bare namespace marker
        return True

    def _malformed(self) -> None:
        """Ends the current invoke's argument parsing; the text up to its end is skipped."""
        self._open_elements.clear()
        self._mode = _SKIP

    def _close_call(self, out: StreamDelta) -> None:
        call, self._current = self._current, None
        self._open_elements.clear()
        out.tool_call_deltas.append({"index": call.index, "function": {"arguments": self._arguments(call)}})

    def open_call_arguments(self) -> tuple[int, dict] | None:
        """(index, typed arguments completed so far) of the call being parsed, None when no
        invoke is open: lets a stream send each argument as it completes. A later element
        of a name already seen turns that name's value into a list, as at the call's close."""
        if self._current is None:
            return None
        return self._current.index, self._argument_object(self._current)

    def _argument_object(self, call: _Call) -> dict:
        schema = self._schemas.get(call.name)
        kind = schema if schema is not None and schema.kind == "object" else None
        return _object_from(call.elements, kind)

    def _arguments(self, call: _Call) -> str:
        return json.dumps(self._argument_object(call), ensure_ascii=False)

    def _emit_text(self, out: StreamDelta, text: str) -> None:
        """Content before any call: whitespace is held until other text comes (then sent with
        it) or a call opens (then dropped)."""
        if not self._sent_text:
            if not text or text.isspace():
                self._held_space += text
                return
            text, self._held_space, self._sent_text = self._held_space + text, "", True
        self._emit_content(out, text)

    def _emit_content(self, out: StreamDelta, text: str) -> None:
        if text:
            out.content = (out.content or "") + text


_TOOL_PARSERS = {"minimax_m3": MiniMaxM3ToolParser}


def get_tool_parser(name: str) -> type[MiniMaxM3ToolParser]:
    """Returns the parser class registered as `name` (the `--tool-call-parser` value)."""
    if name not in _TOOL_PARSERS:
        raise ValueError(f"tool call parser {name!r} is not known; known parsers: {sorted(_TOOL_PARSERS)}")
    return _TOOL_PARSERS[name]
