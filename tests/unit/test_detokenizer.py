"""Tests for incremental detokenization and stop-string helpers."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.model.tokenizer_build import special_token_ids
from m3serve.serving.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback




def stream(tokenizer, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return detok, deltas


@pytest.mark.parametrize(
    "text",
    [
        "😀👍🏽🇫🇷 family 👨‍👩‍👧", "数据并行和张量并行，流水线并行。",
        "mixed: ß ∂ 漢字 🚀 done", "plain ascii text",
    ],
)
def test_one_token_at_a_time_gives_exact_text(tokenizer, text):
    ids = tokenizer.encode(text).ids
    detok, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_token_ids == ids


def test_partial_character_is_held_back(tokenizer):
    # Byte-level BPE spreads a rare 4-byte character over several tokens: nothing shows until complete.
    ids = tokenizer.encode("𝔘").ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add_tokens([i]) for i in ids] == [""] * (len(ids) - 1) + ["𝔘"]


def test_unfinished_character_flushed_by_finish(tokenizer):
    ids = tokenizer.encode("ok 𝔘").ids
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add_tokens([i]) for i in ids[:-1])
    assert "\ufffd" not in text
    tail = detok.finish()
    assert text + tail == tokenizer.decode(ids[:-1])
    assert tail.endswith("\ufffd")


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("Question: 世界?").ids
    output = tokenizer.encode(" Answer 😀 here").ids
    _, deltas = stream(tokenizer, output, prompt_token_ids=prompt)
    assert "".join(deltas) == tokenizer.decode(output) == " Answer 😀 here"


def test_special_tokens_skipped_or_kept(tokenizer, tokenizer_dir):
    ids_map = special_token_ids(tokenizer_dir)
    ids = tokenizer.encode("<mm:think>hm</mm:think>yes").ids + [ids_map["eos"]]
    _, skipped = stream(tokenizer, ids)
    _, kept = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(skipped) == "<mm:think>hm</mm:think>yes"
    assert "".join(kept) == "<mm:think>hm</mm:think>yes[e~["


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40), chunk=st.integers(min_value=1, max_value=4))
def test_deltas_concatenate_to_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text
    assert "".join(deltas) + detok.finish() == tokenizer.decode(ids)


@settings(max_examples=100, deadline=None)
@given(raw=st.lists(st.integers(min_value=0, max_value=2047), max_size=30))
def test_random_ids_never_emit_partial_characters_early(tokenizer, raw):
    # Arbitrary id sequences may hold invalid bytes; the invariant on the concatenation still holds.
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_tokens([i]) for i in raw]
    assert all(not d.endswith("\ufffd") for d in deltas)
    assert "".join(deltas) + detok.finish() == tokenizer.decode(raw)


def test_find_stop_earliest_and_window():
    assert find_stop("hello world", ["wor", "lo"], 0) == 3
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("hello world", [], 0) is None
    # A stop string straddling the boundary of already-checked text is still found.
    assert find_stop("abcSTOP", ["STOP"], 5) == 3
    # A match lying entirely inside already-checked text is not searched again.
    assert find_stop("STOP and more", ["STOP"], 10) is None


def test_stop_holdback():
    assert stop_holdback("the end is ST", ["STOP"]) == 2
    assert stop_holdback("the end is S", ["STOP", "Sx"]) == 1
    assert stop_holdback("the end", ["STOP"]) == 0
    assert stop_holdback("aaa", ["aaab"]) == 3
    assert stop_holdback("xab", ["abc", "bcd"]) == 2
    assert stop_holdback("", ["abc"]) == 0


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abS", max_size=20),
    stop=st.lists(st.text(alphabet="abS", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_helpers_match_brute_force(text, stop):
    expected_find = min((i for i in range(len(text)) for s in stop if text.startswith(s, i)), default=None)
    assert find_stop(text, stop, 0) == expected_find
    expected_hold = max(
        (k for s in stop for k in range(1, len(s)) if k <= len(text) and text.endswith(s[:k])), default=0
    )
    assert stop_holdback(text, stop) == expected_hold


def test_n_fans_out_into_child_requests_that_stop_at_eos(tokenizer):
    """The one place a user request becomes engine requests (the offline `LLM` and the server
    both call it): n children with vLLM's child ids, each with its own params (seed + index),
    the prompt, the cache salt, and the model's EOS as a stop token unless EOS is ignored."""
    from m3serve.sampling_params import SamplingParams
    from m3serve.serving.output_processor import RequestState

    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=4)
    reqs = RequestState("req", "hi", [5, 6, 7], params, tokenizer).engine_requests(2, cache_salt="s")
    assert [r.request_id for r in reqs] == ["0_req", "1_req", "2_req"]
    assert all(r.prompt_token_ids == [5, 6, 7] and r.eos_token_id == 2 and r.cache_salt == "s" for r in reqs)
    assert all(2 in r.sampling_params.all_stop_token_ids and r.sampling_params.n == 1 for r in reqs)
    assert [r.sampling_params.seed for r in reqs] == [5, 6, 7]
    assert 2 not in params.all_stop_token_ids                  # the user's params stay untouched
    alone = RequestState("q", None, [5], SamplingParams(ignore_eos=True), tokenizer).engine_requests(2)
    assert [r.request_id for r in alone] == ["q"] and 2 not in alone[0].sampling_params.all_stop_token_ids
