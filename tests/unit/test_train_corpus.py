"""The trained tiny model's corpus (`model/train_corpus.py`): which files it takes, how a run on
other files is told apart, what is held out, and the chat turns it trains on."""
import json

from m3serve.model.tokenizer_build import write_tiny_tokenizer
from m3serve.model.train_corpus import (DOCS_NAME, DOCS_PATH, HELD_OUT_SECTION_EVERY, chat_turn, corpus_files,
                                        doc_sections, is_held_out, manifest_differences, split_corpus,
                                        write_manifest)
from m3serve.serving.chat_template import load_chat_template, render_chat


def _fake_stdlib(root):
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "config-3.11-x86_64-linux-gnu").mkdir()
    (root / "a.py").write_text("import os\n")
    (root / "pkg" / "b.py").write_text("def f():\n    return 1\n")
    (root / "test" / "test_a.py").write_text("assert True\n")
    (root / "config-3.11-x86_64-linux-gnu" / "python-config.py").write_text("x = 1\n")
    (root / "big.py").write_text("x = 1\n" * 40_000)
    (root / "notes.txt").write_text("not python\n")
    return root


def test_the_corpus_is_the_library_code_and_the_docs_snapshot(tmp_path):
    files = corpus_files(_fake_stdlib(tmp_path / "lib"))
    assert [f.name for f in files] == sorted(["stdlib/a.py", "stdlib/pkg/b.py", DOCS_NAME])


def test_a_corpus_that_differs_from_the_manifest_is_named_file_by_file(tmp_path):
    lib = _fake_stdlib(tmp_path / "lib")
    manifest = tmp_path / "corpus.json"
    write_manifest(corpus_files(lib), manifest)
    assert manifest_differences(corpus_files(lib), manifest) == []
    (lib / "a.py").write_text("import sys\n")
    (lib / "pkg" / "b.py").unlink()
    (lib / "c.py").write_text("pass\n")
    diffs = manifest_differences(corpus_files(lib), manifest)
    assert diffs == ["missing here: stdlib/pkg/b.py", "not in the manifest: stdlib/c.py",
                     diffs[2]] and diffs[2].startswith("changed: stdlib/a.py (sha256 ")
    pinned = json.loads(manifest.read_text())
    pinned["python"] = "3.0.1"
    manifest.write_text(json.dumps(pinned))
    assert manifest_differences(corpus_files(lib), manifest)[0].startswith(
        "the manifest was made with Python 3.0.1")


def test_held_out_files_and_sections_are_never_trained_on(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    names = [f"m{i}.py" for i in range(200)]
    for i, name in enumerate(names):
        (lib / name).write_text(f"VALUE_{i} = {i}\n")
    text = split_corpus(corpus_files(lib))
    held = [n for n in names if is_held_out("stdlib/" + n)]
    assert 0 < len(held) < 30
    for i, name in enumerate(names):
        line = f"VALUE_{i} = {i}\n"
        assert (line in text.heldout) == (name in held)
        assert any(line == c for c in text.code) == (name not in held)
    sections = doc_sections(DOCS_PATH.read_text())
    held_sections = [b for i, (_, b) in enumerate(sections) if i % HELD_OUT_SECTION_EVERY == HELD_OUT_SECTION_EVERY - 1]
    assert held_sections
    for i, (_, body) in enumerate(sections):
        trained = any(body in d for d in text.docs)
        assert trained == (body not in held_sections) and (body in text.heldout) == (not trained)


def test_docs_chat_turns_are_what_the_chat_template_renders(tmp_path):
    write_tiny_tokenizer(tmp_path)
    template = load_chat_template(tmp_path)
    turn = chat_turn("Tell me about sockets.", "They carry bytes.")
    prompt = render_chat(template, [{"role": "user", "content": "Tell me about sockets."}])
    whole = render_chat(template, [{"role": "user", "content": "Tell me about sockets."},
                                   {"role": "assistant", "content": "They carry bytes."}], add_generation_prompt=False)
    assert turn.startswith(prompt) and turn == whole


def test_doc_sections_split_at_headings():
    text = "<!-- a comment -->\n# Title\nintro\n\n## Part\nbody line\n## Empty\n\n"
    assert doc_sections(text) == [("Title", "intro"), ("Part", "body line")]
