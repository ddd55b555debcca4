"""The architecture contract (pyproject.toml, `[tool.importlinter]`): imports only flow down the
package's layers. It holds for the code as it is, and it breaks when one import climbs, even
one hidden inside a function."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the package under `root`, with `root`'s pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_imports_flow_down():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_import_that_climbs_breaks_the_contract(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "m3serve", tmp_path / "m3serve",
                    ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.txt", "*.md"))
    planted = tmp_path / "m3serve" / "kernels" / "swiglu.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from m3serve.serving import api_server\n"
                       "    return api_server\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "m3serve.kernels is not allowed to import m3serve.serving" in result.stdout
    assert "m3serve.kernels.swiglu -> m3serve.serving.api_server" in result.stdout
