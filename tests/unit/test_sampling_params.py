"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming the field for bad input."""
import math

import pytest

from m3serve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed) == (16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(7, 9), top_k=-1, temperature=0, seed=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9]
    assert p.all_stop_token_ids == {7, 9}
    assert p.top_k == 0
    assert p.seed is None
    assert isinstance(p.temperature, float) and p.is_greedy
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_is_greedy_threshold():
    assert SamplingParams(temperature=5e-6).is_greedy
    assert not SamplingParams(temperature=2e-5).is_greedy


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.5),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("n", 0),
    ("n", True),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", 1 << 64),
    ("stop", ""),
])
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert str(value) in str(info.value) or repr(value) in str(info.value)


@pytest.mark.parametrize("field,value,shown", [
    ("stop", ["ok", ""], "''"),
    ("stop", ["ok", 3], "3"),
    ("stop_token_ids", [3, -1], "-1"),
    ("stop_token_ids", [3, "4"], "'4'"),
])
def test_invalid_list_item_names_field_and_item(field, value, shown):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert str(info.value).endswith(shown)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens.*5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_boundary_values_accepted():
    p = SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                       frequency_penalty=2.0, logprobs=20, prompt_logprobs=0, seed=0)
    assert p.logprobs == 20 and p.prompt_logprobs == 0 and p.seed == 0


def test_add_eos_token_ids_respects_ignore_eos():
    p = SamplingParams(stop_token_ids=[5])
    p.add_eos_token_ids([2])
    assert p.all_stop_token_ids == {2, 5}
    q = SamplingParams(ignore_eos=True)
    q.add_eos_token_ids([2])
    assert q.all_stop_token_ids == set()


def test_clone_is_deep_and_children_get_distinct_seeds():
    p = SamplingParams(n=3, stop=["x"], seed=10)
    c = p.clone()
    c.stop.append("y")
    assert p.stop == ["x"]
    children = [p.for_child(i) for i in range(3)]
    assert [ch.seed for ch in children] == [10, 11, 12]
    assert all(ch.n == 1 for ch in children)
    assert p.n == 3 and p.seed == 10
    assert SamplingParams(n=2).for_child(1).seed is None
