"""`tool_choice` "required" and named, enforced: an EBNF grammar (xgrammar's dialect) of the
MiniMax-M3 tool-call markup (docs/model.md §7) built from the request's tool schemas, so the
model writes its own format and the tool-call parser reads it back unchanged.

The output the grammar admits: the reasoning block the chat template leaves open or allows
(`thinking_mode`) and the newline the template puts after it, then, with no content, one
`<tool_call>` block of one or more `<invoke>` elements ("required",
any of the tools) or exactly one invoke of the named tool. Each invoke holds the schema's
properties as elements, in schema order, the required ones always; leaf text follows the
property's type (integer, number, boolean, null, enum/const values; strings are any text
without the namespace marker); integers stay within the schema's `minimum`/`maximum` (and the
exclusive forms) and always within 64 bits, what every API here accepts back in the next turn;
numbers have at most 18 integer digits (their bounds are not enforced); objects with properties nest as elements, arrays as `<item>`
elements. Schemas the markup cannot express exactly (`$ref`, `not`, patterns, objects without
properties) admit any marker-free text, which the parser types as it does unconstrained output.
"""
from __future__ import annotations

import json
import math

from m3serve.model.markup import NAMESPACE, THINK_CLOSE, THINK_OPEN

# Deeper schemas than this are admitted as free text below that depth.
MAX_SCHEMA_DEPTH = 16
_WS = "[ \\t\\r\\n]{0,4}"     # between tags: bounded, so whitespace cannot loop forever


def _literal(text: str) -> str:
    """An EBNF string literal of `text`."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "]\\^-[" else ch


class _Rules:
    """The rules of one grammar, named in order of creation."""

    def __init__(self):
        self.rules: dict[str, str] = {}
        self._avoiders: dict[str, str] = {}

    def add(self, stem: str, body: str) -> str:
        name = f"{stem}_{len(self.rules)}"
        self.rules[name] = body
        return name

    def text_without(self, marker: str) -> str:
        """A rule of every string in which `marker` does not occur (the states of the
        marker's prefix automaton, one rule each)."""
        if marker in self._avoiders:
            return self._avoiders[marker]
        n = len(marker)

        def step(state: int, ch: str) -> int:       # longest prefix of marker ending the text + ch
            seen = marker[:state] + ch
            return next(k for k in range(min(len(seen), n), -1, -1) if seen.endswith(marker[:k]))

        names = [f"avoid{len(self._avoiders)}_{s}" for s in range(n)]
        alphabet = sorted(set(marker))
        for state in range(n):
            options, special = ['""'], []
            for ch in alphabet:
                target = step(state, ch)
                if target == 0:
                    continue
                special.append(ch)
                if target < n:
                    options.append(f"{_literal(ch)} {names[target]}")
            options.append(f"[^{''.join(_class_char(c) for c in special)}] {names[0]}")
            self.rules[names[state]] = " | ".join(options)
        self._avoiders[marker] = names[0]
        return names[0]

    def render(self, root: str) -> str:
        return "\n".join([f"root ::= {root}"] + [f"{name} ::= {body}" for name, body in self.rules.items()])


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# 18 integer digits, a bounded fraction and a 2-digit exponent: always a finite float, and an
# integer literal (no fraction) always within 64 bits
_NUMBER = '"-"? ("0" | [1-9] [0-9]{0,17}) ("." [0-9]{1,17})? ([eE] [+-]? [0-9]{1,2})?'


def _digits_between(low: str, high: str) -> list[str]:
    """EBNF sequences of the digit strings of one length from `low` to `high` (inclusive)."""
    if low == high:
        return [" ".join(f'"{d}"' for d in low)]
    rest = len(low) - 1
    if low[0] == high[0]:
        return [f'"{low[0]}" {tail}' for tail in _digits_between(low[1:], high[1:])]
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return [f"[{low[0]}-{high[0]}]" + (f" [0-9]{{{rest}}}" if rest else "")]
    out = [f'"{low[0]}" {tail}' for tail in _digits_between(low[1:], "9" * rest)]
    if int(high[0]) - int(low[0]) > 1:
        out.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}] [0-9]{{{rest}}}")
    out += [f'"{high[0]}" {tail}' for tail in _digits_between("0" * rest, high[1:])]
    return out


def _naturals_between(low: int, high: int) -> list[str]:
    """EBNF sequences of the decimal numbers from `low` to `high` (0 <= low <= high), without
    leading zeros."""
    out = []
    for width in range(len(str(low)), len(str(high)) + 1):
        first, last = max(low, 10 ** (width - 1) if width > 1 else 0), min(high, 10 ** width - 1)
        if first <= last:
            out += _digits_between(str(first), str(last))
    return out


def _bound(schema: dict, key: str, exclusive: str, lower: bool):
    """The schema's integer bound on one side (None: none), from `minimum`/`maximum` and the
    exclusive form (a number, or draft 4's `true` beside the plain bound)."""
    def number(value) -> bool:
        return type(value) in (int, float) and math.isfinite(value)

    found = []
    for value, strict in ((schema.get(key), schema.get(exclusive) is True), (schema.get(exclusive), True)):
        if number(value):
            if lower:
                found.append(math.floor(value) + 1 if strict else math.ceil(value))
            else:
                found.append(math.ceil(value) - 1 if strict else math.floor(value))
    if not found:
        return None
    return max(found) if lower else min(found)


def _integer(schema: dict, where: str) -> str:
    """The EBNF of the integers `schema` allows, within 64 bits. ValueError when none is."""
    low, high = _bound(schema, "minimum", "exclusiveMinimum", True), _bound(schema, "maximum", "exclusiveMaximum", False)
    low = _INT64_MIN if low is None else max(low, _INT64_MIN)
    high = _INT64_MAX if high is None else min(high, _INT64_MAX)
    if low > high:
        raise ValueError(f"tools: {where}: no integer is >= {low} and <= {high} (its minimum and maximum)")
    options = [f'"-" {s}' for s in _naturals_between(max(1, -high), -low)] if low < 0 else []
    if high >= 0:
        options += _naturals_between(max(low, 0), high)
    return "(" + " | ".join(f"({o})" for o in options) + ")"


def _scalar_text(value) -> str:
    """How the chat template writes a leaf value: strings raw, everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class _ToolGrammar:
    def __init__(self):
        self.r = _Rules()
        self.free = self.r.text_without(NAMESPACE)
        self.tag = lambda text: _literal(NAMESPACE + text)
        self._any = None

    def any_elements(self) -> str:
        """Elements of any names (an object the schema does not describe): text, or child
        elements nested to any depth. Closing names are not matched to opening ones; the parser
        ends the invoke at a mismatch as it does for unconstrained output."""
        if self._any is None:
            self._any = name = "element"
            tag_name = "[^<>/ \\t\\r\\n]+"
            close = _literal(">")
            self.r.rules[name] = (f"{self.tag('<')} {tag_name} {close} ({self.free} | ({_WS} {name})+ {_WS}) "
                                  f"{self.tag('</')} {tag_name} {close}")
        return self._any

    def untyped_object(self) -> str:
        return f"({_WS} ({self.any_elements()} {_WS})* | {self.free})"

    def value(self, schema, depth: int, where: str) -> str:
        """The element content of one value of `schema` (`where`: its path, for errors)."""
        if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
            return self.free
        if "const" in schema:
            return _literal(_scalar_text(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(_literal(_scalar_text(v)) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self.value(option, depth + 1, where) for option in schema[key]) + ")"
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return "(" + " | ".join(self.value({**schema, "type": k}, depth + 1, where) for k in kind) + ")"
        if kind == "integer":
            return self.r.add("integer", _integer(schema, where))
        if kind == "number":
            return f"({_NUMBER})"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "object":
            return self.properties(schema, depth + 1, where)
        if kind == "array" or (kind is None and "items" in schema):
            item = self.r.add("item", f"{self.tag('<item>')} {self.value(schema.get('items'), depth + 1, where + '[]')} "
                                      f"{self.tag('</item>')} {_WS}")
            least = schema.get("minItems")
            return f"({_WS} {item}+)" if isinstance(least, int) and least >= 1 else f"({_WS} {item}*)"
        return self.free

    def properties(self, schema: dict, depth: int, where: str) -> str:
        """An object's properties as elements, in schema order; required ones always."""
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return self.untyped_object()
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        parts = []
        for name, sub in properties.items():
            element = self.r.add("arg", f"{self.tag('<' + name + '>')} {self.value(sub, depth, where + '.' + name)} "
                                        f"{self.tag('</' + name + '>')} {_WS}")
            parts.append(element if name in required else element + "?")
        return f"({_WS} {' '.join(parts)})"

    def invoke(self, name: str, parameters) -> str:
        arguments = self.properties(parameters, 1, name) if isinstance(parameters, dict) else self.untyped_object()
        header = self.tag(f'<invoke name="{name}">')
        return self.r.add("invoke", f"{header} {arguments} "
                                    f"{self.tag('</invoke>')} {_WS}")


def _function(tool: dict) -> dict:
    return tool.get("function", tool)


def tool_call_grammar(tools: list[dict], tool_choice, thinking_mode: str | None) -> str:
    """The EBNF grammar that makes the output a tool call: "required" (one block, one or more
    invokes of any of `tools`) or a named choice `{"type": "function", "function": {"name": N}}`
    (exactly one invoke of N). `thinking_mode` is the chat template's: "enabled" means the
    output starts inside the reasoning block; "adaptive" (or unset) allows one reasoning block
    first; "disabled" none."""
    g = _ToolGrammar()
    if tool_choice == "required":
        invokes = [g.invoke(_function(t)["name"], _function(t).get("parameters")) for t in tools]
        body = "(" + " | ".join(invokes) + ")+"
    else:
        wanted = tool_choice["function"]["name"]
        [parameters] = [_function(t).get("parameters") for t in tools if _function(t)["name"] == wanted][:1] or [None]
        body = g.invoke(wanted, parameters)
    block = f"{g.tag('<tool_call>')} {_WS} {body} {g.tag('</tool_call>')}"
    mode = thinking_mode or "adaptive"
    if mode == "disabled":
        return g.r.render(block)
    reasoning = f"{g.r.text_without(THINK_CLOSE)} {_literal(THINK_CLOSE)} \"\\n\"?"
    if mode == "enabled":
        return g.r.render(f"{reasoning} {block}")
    return g.r.render(f"({_literal(THINK_OPEN)} {reasoning})? {block}")
