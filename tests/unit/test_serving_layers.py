"""The serving package's import direction: the API dialects (`serving/openai`,
`serving/anthropic`) import the chat turn and the shared pieces below it; nothing below imports
a dialect, and no dialect imports another. Only the app (`api_server`) and the server's own
routes (`ops_router`, answering in the default OpenAI shape) sit above the dialects."""
import ast
from pathlib import Path

import m3serve.serving

SERVING = Path(m3serve.serving.__file__).parent
DIALECTS = ("openai", "anthropic")
ABOVE_DIALECTS = {"api_server.py", "ops_router.py"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _dialects_of(names: set[str]) -> set[str]:
    return {d for d in DIALECTS for n in names if n == f"m3serve.serving.{d}" or n.startswith(f"m3serve.serving.{d}.")}


def test_nothing_below_the_dialects_imports_one():
    below = [p for p in SERVING.glob("*.py") if p.name not in ABOVE_DIALECTS]
    assert {"chat_turn.py", "output_parsers.py", "sampling.py", "context.py", "errors.py"} <= {p.name for p in below}
    offenders = {p.name: sorted(_dialects_of(_imports(p))) for p in below if _dialects_of(_imports(p))}
    assert offenders == {}


def test_no_dialect_imports_another():
    for dialect in DIALECTS:
        for path in (SERVING / dialect).glob("*.py"):
            assert _dialects_of(_imports(path)) <= {dialect}, path


def test_no_dialect_imports_private_names_of_another_module():
    """A dialect uses the turn and the shared modules through their public names."""
    for dialect in DIALECTS:
        for path in (SERVING / dialect).glob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            private = [f"{node.module}.{alias.name}" for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("m3serve.serving")
                       for alias in node.names if alias.name.startswith("_")]
            assert private == [], path
