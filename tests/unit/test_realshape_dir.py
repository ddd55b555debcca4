"""The real-shape benchmark directory: its tokenizer covers the real vocabulary (every id the
model can emit decodes to non-empty text, distinct per id) while encoding stays the tiny
tokenizer's, and its config parses to the real layer shapes."""

from tokenizers import Tokenizer

from m3serve.bench.realshape import write_realshape_dir
from m3serve.model.config import load_config
from m3serve.model.files import default_model_dir


def test_realshape_tokenizer_covers_the_vocabulary(tmp_path):
    out = write_realshape_dir(tmp_path / "rs", num_layers=2)
    cfg = load_config(out)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (6144, 2, 200064)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tiny = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size
    ids = [3000, 65535, 150000, 199999]
    texts = [tok.decode([i]) for i in ids]
    assert all(t.strip() for t in texts) and len(set(texts)) == len(ids)
    assert tok.decode(ids) == "".join(texts)
    sample = "Hello world, the quick brown fox. " * 3
    assert tok.encode(sample).ids == tiny.encode(sample).ids
    assert tok.decode(list(range(100, 140))) == tiny.decode(list(range(100, 140)))
    # the special tokens keep the tiny tokenizer's ids
    assert {i: t.content for i, t in tok.get_added_tokens_decoder().items()} == {
        i: t.content for i, t in tiny.get_added_tokens_decoder().items()}
