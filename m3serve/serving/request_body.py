"""A request body, read and validated for every dialect: the size limit (413), JSON, what no
field may hold (`check_json`: depth, surrogates, 64-bit integers) and pydantic validation (400
naming the field); unknown fields are logged, once at INFO per request kind and fields.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re

from fastapi import Request
from pydantic import BaseModel, ValidationError

from m3serve.serving.errors import APIError

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64
_INT64 = 1 << 63


def _path(where: tuple) -> str:
    return ".".join(map(str, where))


def _check_text(text: str, where: tuple, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        path = _path(where)
        raise APIError(400, f"{path or 'body'}: {what} an unpaired UTF-16 surrogate (\\ud800-\\udfff)",
                       path or None) from None


def _check_int(value: int, where: tuple) -> None:
    if not -_INT64 <= value < _INT64:
        path = _path(where)
        raise APIError(400, f"{path}: integer out of the 64-bit range", path or None)


def _is_free(where: tuple, free_json: tuple) -> bool:
    return any(len(pattern) == len(where) and all(p == "*" or p == w for p, w in zip(pattern, where))
               for pattern in free_json)


def check_json(data, max_depth: int = MAX_JSON_DEPTH, free_json: tuple = ()) -> None:
    """Refuse what no field may hold, before the models see it (each a 400 naming its path):
    nesting deeper than `max_depth`, strings with unpaired UTF-16 surrogates (they cannot be
    encoded back), integers outside 64 bits. `free_json`: paths ("*" for any key or index) of
    arbitrary JSON (tool-call inputs and arguments, tool schemas), where integers of any size
    pass: the model writes them and clients send them back. Paths are spelled only for the
    error; a list of plain integers (token ids) is checked at C speed."""
    stack = [(data, (), 0, False)]
    while stack:
        value, where, depth, free = stack.pop()
        kind = type(value)
        if kind is str:
            _check_text(value, where, "contains")
        elif kind is int:
            if not free:
                _check_int(value, where)
        elif kind is list or kind is dict:
            if depth >= max_depth:
                path = _path(where)
                raise APIError(400, f"{path or 'body'}: nested deeper than {max_depth} levels", path or None)
            if kind is dict:
                for key, item in value.items():
                    _check_text(key, where, "a key contains")
                    inner = where + (key,)
                    stack.append((item, inner, depth + 1, free or (bool(free_json) and _is_free(inner, free_json))))
            elif value and all(type(v) is int for v in value):
                if not free and (min(value) < -_INT64 or max(value) >= _INT64):
                    index = next(i for i, v in enumerate(value) if not -_INT64 <= v < _INT64)
                    _check_int(value[index], where + (index,))
            else:
                stack.extend((item, where + (i,), depth + 1, free) for i, item in enumerate(value))


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem pydantic found, naming the field path."""
    errors = error.errors()
    first = errors[0]
    path = []
    for part in first.get("loc", ()):
        if isinstance(part, str) and _TYPE_TAG.match(part):
            break  # pydantic names the union member it tried; the field path ends before it
        path.append(str(part))
    loc = ".".join(path)
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return f"{loc} is required", loc or None
    value = first.get("input")
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    # a union reports one error per member, tagged with the member's type: name them all
    depth = len(path)
    members = []
    for e in errors:
        where = e.get("loc", ())
        if tuple(map(str, where[:depth])) == tuple(path) and len(where) > depth:
            tag = str(where[depth])
            if _TYPE_TAG.match(tag) and tag not in members:
                members.append(tag)
    if len(members) > 1:
        return f"{loc}: expected one of {', '.join(members)} (got {shown})", loc or None
    return f"{loc}: {message} (got {shown})", loc or None


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")

_PARSE_ON_LOOP_BYTES = 64 * 1024     # larger bodies are parsed in a thread


async def read_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """The request's body as `model`: at most `limit` bytes (413), JSON (400), no value a field
    may not hold (`check_json`, 400) and valid for the model (400 naming the field)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > _PARSE_ON_LOOP_BYTES:        # a large body is parsed off the event loop
        return await asyncio.to_thread(parse_body, body, model)
    return parse_body(body, model)


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, f"request body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:       # JSONDecodeError, and ints of > 4300 digits
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    check_json(data, free_json=getattr(model, "free_json", ()))
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param) from None
    if parsed.model_extra:
        _log_unknown_fields(model.__name__, sorted(parsed.model_extra))
    return parsed


_unknown_fields_seen: set[tuple] = set()


def _log_unknown_fields(kind: str, names: list[str]) -> None:
    """Unknown fields are logged at INFO the first time a request kind carries them, then at
    debug level (clients such as Codex send the same extra fields on every request)."""
    key = (kind, *names)
    level = logging.DEBUG if key in _unknown_fields_seen else logging.INFO
    if len(_unknown_fields_seen) < 1024:
        _unknown_fields_seen.add(key)
    logger.log(level, "ignoring unknown request fields of %s: %s", kind, names)
