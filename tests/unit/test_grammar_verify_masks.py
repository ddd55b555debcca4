"""The grammar masks of a verify step (structured.compiler.GrammarBook.verify_masks): one row per
verified position, each equal to a fresh matcher's mask after the drafts before it; the
request's matcher is left where it was; rows after a draft the grammar refuses, or after the
grammar's end, carry no mask (and filling them does not fail). And the sampling mode of a
constrained request: GRAMMAR (drafts verified under the masks) unless its sampler needs more."""
import pytest
import torch

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")

import xgrammar as xgr  # noqa: E402

from m3serve.core.sampling_mode import SamplingMode, sampling_mode  # noqa: E402
from m3serve.model.tokenizer_build import SPECIAL_TOKENS  # noqa: E402
from m3serve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from m3serve.structured.compiler import GrammarBook, compile_grammar  # noqa: E402

V = 2048


def _params(tokenizer, regex: str, **kwargs) -> SamplingParams:
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex), **kwargs)
    p.add_eos_token_ids([_eos(tokenizer)])
    return p


def _eos(tokenizer) -> int:
    return tokenizer.token_to_id(SPECIAL_TOKENS["eos"])


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _fresh_mask(params, tokenizer_dir, prefix: list[int]) -> torch.Tensor:
    """The mask an independent matcher gives after `prefix`."""
    matcher = xgr.GrammarMatcher(compile_grammar(params, tokenizer_dir, V))
    for t in prefix:
        assert matcher.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(1, V)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def test_rows_follow_the_drafts_and_the_matcher_is_rolled_back(tokenizer_dir, tokenizer):
    p = _params(tokenizer, "(cat|dog) (ran|sat) (up|down)")
    plain = SamplingParams(temperature=0)
    drafts = _ids(tokenizer, "cat sat")
    assert len(drafts) >= 2
    book = GrammarBook(tokenizer_dir, V)
    # an unconstrained request owns rows 0..1, the constrained one rows 2 .. 2 + len(drafts)
    num_rows = 2 + len(drafts) + 1
    bitmask, rows = book.verify_masks(num_rows, ["a", "b"], [plain, p], [[5], drafts], [0, 2], torch.device("cpu"))
    assert rows == list(range(2, num_rows))
    assert (bitmask[:2] == -1).all()                                   # no mask on the plain request
    for j in range(len(drafts) + 1):
        assert torch.equal(bitmask[2 + j], _fresh_mask(p, tokenizer_dir, drafts[:j])), j
    # left where it was: the same call gives the same rows, and the first draft is accepted
    again, _ = book.verify_masks(num_rows, ["b"], [p], [drafts], [2], torch.device("cpu"))
    assert torch.equal(again, bitmask)
    assert all(book.accept("b", p, t) for t in drafts)
    assert not book.accept("b", p, _ids(tokenizer, "cat")[0])          # now past "cat sat"


def test_no_mask_after_a_refused_draft_or_the_end(tokenizer_dir, tokenizer):
    cat, eos = _ids(tokenizer, "cat"), _eos(tokenizer)
    book = GrammarBook(tokenizer_dir, V)
    p = _params(tokenizer, "cat|dog")
    refused = _ids(tokenizer, " ran")[:1]
    logits = torch.zeros(8, V)
    masks = book.verify_masks(8, ["r"], [p], [[refused[0], cat[0], eos]], [0], torch.device("cpu"))
    assert masks[1] == [0]                          # the first draft is refused: rows 1.. stay open
    assert (masks[0][1:] == -1).all()
    GrammarBook.apply(logits, masks)
    assert torch.isinf(logits[0]).sum() == V - int(torch.isfinite(logits[0]).sum()) > 0
    assert torch.isfinite(logits[1:]).all()
    # the grammar ends inside the drafts (its stop token is one): rows past it carry no mask
    q = _params(tokenizer, "cat")
    drafts = cat + [eos, cat[0]]
    bitmask, rows = book.verify_masks(len(drafts) + 1, ["e"], [q], [drafts], [0], torch.device("cpu"))
    assert rows == list(range(len(cat) + 1))
    assert (bitmask[len(cat) + 1:] == -1).all()
    assert all(book.accept("e", q, t) for t in cat + [eos])             # rolled back to the start


@pytest.mark.parametrize("fields,mode", [
    (dict(temperature=0), SamplingMode.GRAMMAR),
    (dict(temperature=0.7, seed=3), SamplingMode.GRAMMAR),
    (dict(temperature=0, logprobs=2), SamplingMode.FULL),
    (dict(temperature=0, logit_bias={5: 1.0}), SamplingMode.FULL),
    (dict(temperature=0, presence_penalty=0.5), SamplingMode.FULL),
])
def test_a_constrained_request_verifies_drafts_unless_its_sampler_needs_more(tokenizer, fields, mode):
    assert sampling_mode(_params(tokenizer, "a+", **fields), 0) is mode
    unconstrained = SamplingParams(**fields)
    assert sampling_mode(unconstrained, 0) is (mode if mode is SamplingMode.FULL else
                                               SamplingMode.ARGMAX if unconstrained.is_greedy else SamplingMode.LOGITS)
