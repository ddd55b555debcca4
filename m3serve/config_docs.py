"""Documentation of configuration fields, read from the code: a dataclass field's attribute
docstring (the string literal on the line after it) is its help text, so `--help`, `LLM(**kwargs)`
and the field itself cannot say different things. Reads source files only; imports nothing of
m3serve.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its attribute docstring, whitespace collapsed to single spaces} of the
    dataclass `cls`; fields without one are left out. Raises OSError when the class's source
    cannot be read (a build without .py files)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body          # the class statement's body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
