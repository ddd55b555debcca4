"""The trained tiny model's text, pinned: Python source of the running interpreter's standard
library and the project's docs snapshot shipped in the package (`model/tiny_corpus.md`).

Every file is named (`stdlib/<path>` or `m3serve/model/tiny_corpus.md`) and listed with its
sha256 in a manifest (`tiny_trained/corpus.json`); a run whose files differ from the manifest
(another Python version, a patched library) is refused with the differences named, unless the
caller accepts them and writes a new manifest. A fixed share of the files, and of the docs'
sections, is held out by a hash of its name: never trained on, and cut into `heldout.txt`, which
ships beside the weights so that the perplexity checks need no standard library of a given
version. The docs also train the chat turn: each section as the answer to "Tell me about
<its heading>." in the chat template's layout.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DOCS_NAME = "m3serve/model/tiny_corpus.md"
DOCS_PATH = Path(__file__).resolve().parent / "tiny_corpus.md"
# standard-library folders that are not code people write (tests, generated tables, vendored
# installers, the IDE) or that are not part of every build
_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "turtledemo", "site-packages", "encodings", "pydoc_data",
                           "__pycache__", "lib2to3", "ensurepip"})
_MAX_FILE_BYTES = 150_000
HELD_OUT_EVERY = 25           # about one file in this many is held out
HELD_OUT_SECTION_EVERY = 8    # one docs section in this many
HELD_OUT_FILE_CHARS = 2_400   # of each held-out file, this much goes into heldout.txt


@dataclass(frozen=True)
class CorpusFile:
    name: str       # stdlib/<relative path> or DOCS_NAME
    path: Path
    sha256: str


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(stdlib: Path | None = None) -> list[CorpusFile]:
    """This machine's corpus, sorted by name: the standard library's .py files (outside
    `_SKIPPED_DIRS`, at most `_MAX_FILE_BYTES` each) and the docs snapshot."""
    root = stdlib or stdlib_dir()
    if not root.is_dir():
        raise ValueError(f"standard library folder {root} does not exist")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        # config-<version>-<platform>: the build's own scripts, named differently on every platform
        if set(dirs) & _SKIPPED_DIRS or any(d.startswith("config-") for d in dirs) \
                or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        out.append(CorpusFile("stdlib/" + rel.as_posix(), path, _sha256(path)))
    out.append(CorpusFile(DOCS_NAME, DOCS_PATH, _sha256(DOCS_PATH)))
    return sorted(out, key=lambda f: f.name)


def manifest_dict(files: list[CorpusFile]) -> dict:
    return {"python": sys.version.split()[0], "files": {f.name: f.sha256 for f in files}}


def write_manifest(files: list[CorpusFile], path: Path) -> None:
    Path(path).write_text(json.dumps(manifest_dict(files), indent=1, sort_keys=True) + "\n")


def manifest_differences(files: list[CorpusFile], path: Path) -> list[str]:
    """How this machine's corpus differs from the manifest at `path`, one line per file
    (missing, extra, changed); [] when they agree."""
    pinned = json.loads(Path(path).read_text())
    want, have = pinned["files"], {f.name: f.sha256 for f in files}
    lines = [f"missing here: {n}" for n in sorted(set(want) - set(have))]
    lines += [f"not in the manifest: {n}" for n in sorted(set(have) - set(want))]
    lines += [f"changed: {n} (sha256 {have[n][:12]}, pinned {want[n][:12]})"
              for n in sorted(set(want) & set(have)) if want[n] != have[n]]
    if lines and pinned.get("python") != sys.version.split()[0]:
        lines.insert(0, f"the manifest was made with Python {pinned.get('python')}, this is {sys.version.split()[0]}")
    return lines


def is_held_out(name: str) -> bool:
    """Whether corpus file `name` is held out (a fixed function of the name)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0


def doc_sections(text: str) -> list[tuple[str, str]]:
    """The docs snapshot as (heading, body) pairs, one per markdown heading (the HTML comment
    at its top dropped)."""
    text = re.sub(r"<!--.*?-->\s*", "", text, flags=re.S)
    sections, heading, body = [], None, []
    for line in text.splitlines():
        if line.startswith("#"):
            if heading is not None and "".join(body).strip():
                sections.append((heading, "\n".join(body).strip()))
            heading, body = line.lstrip("#").strip(), []
        elif heading is not None:
            body.append(line)
    if heading is not None and "".join(body).strip():
        sections.append((heading, "\n".join(body).strip()))
    return sections


def chat_turn(question: str, answer: str) -> str:
    """One user question and the assistant's answer as the chat template writes them."""
    from m3serve.model.tokenizer_build import SPECIAL_TOKENS

    bod, bos, eos = SPECIAL_TOKENS["bod"], SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"]
    return f"{bod}{bos}user\n{question}{eos}\n{bos}ai\n{answer}{eos}\n"


@dataclass
class CorpusText:
    """The corpus split: training code files and docs (as chat turns and as plain sections),
    and the held-out text."""
    code: list[str]
    docs: list[str]
    heldout: str


def split_corpus(files: list[CorpusFile]) -> CorpusText:
    """Read `files` and split them into training and held-out text (see the module docstring)."""
    code, docs, held = [], [], []
    for f in files:
        text = f.path.read_text(encoding="utf-8", errors="replace")
        if f.name == DOCS_NAME:
            for i, (heading, body) in enumerate(doc_sections(text)):
                if i % HELD_OUT_SECTION_EVERY == HELD_OUT_SECTION_EVERY - 1:
                    held.append(f"# {heading}\n{body}\n")
                else:
                    docs += [chat_turn(f"Tell me about {heading}.", body), f"# {heading}\n{body}\n"]
        elif is_held_out(f.name):
            cut = text[:HELD_OUT_FILE_CHARS]
            held.append(cut[:cut.rfind("\n") + 1] if "\n" in cut else cut)
        else:
            code.append(text)
    return CorpusText(code, docs, "\n".join(held))
