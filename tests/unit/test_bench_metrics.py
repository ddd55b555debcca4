"""Benchmark metrics against hand-computed values, and the random dataset's length contract."""
import math

import numpy as np
import pytest

from m3serve.bench.datasets import (TokenizerView, length_bounds, load_tokenizer,
                                    sample_lengths, sample_random_requests)
from m3serve.bench.metrics import (RequestRecord, compute_metrics, parse_goodput,
                                   parse_percentile_metrics, parse_percentiles)
from letter_tokenizer import LetterTokenizer


def _records():
    return [
        # ttft 0.1, e2el 0.4, itl [0.1, 0.2], tpot (0.4 - 0.1) / 2 = 0.15
        RequestRecord(prompt_len=10, start_time=0.0, chunk_times=[0.1, 0.2, 0.4],
                      output_tokens=3, success=True),
        # one chunk carried two tokens: ttft 0.3, e2el 0.5, itl [0.2], tpot 0.2 / 3
        RequestRecord(prompt_len=20, start_time=1.0, chunk_times=[1.3, 1.5],
                      output_tokens=4, success=True),
        # a single token: ttft = e2el = 0.2, no itl, no tpot
        RequestRecord(prompt_len=5, start_time=0.5, chunk_times=[0.7], output_tokens=1,
                      success=True),
        RequestRecord(prompt_len=7, start_time=0.0, error="HTTP 500: boom"),
    ]


def test_metrics_match_hand_computed_values():
    r = compute_metrics(_records(), 2.0, percentiles=[50, 90, 99],
                        goodput={"ttft": 250.0, "tpot": 100.0}, num_gpus=2)
    assert (r["completed"], r["failed"]) == (3, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (35, 8)
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(21.5)
    # ttfts 100, 300, 200 ms
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(1000 * math.sqrt(0.02 / 3))
    assert r["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation, as numpy/vLLM
    # tpots 150 and 66.67 ms; the 1-token request has none
    assert r["mean_tpot_ms"] == pytest.approx((150.0 + 200.0 / 3) / 2)
    assert r["median_tpot_ms"] == pytest.approx((150.0 + 200.0 / 3) / 2)
    # itls pooled: 100, 200, 200 ms
    assert r["mean_itl_ms"] == pytest.approx(500.0 / 3)
    assert r["median_itl_ms"] == pytest.approx(200.0)
    assert r["p50_itl_ms"] == pytest.approx(200.0)
    # e2els 400, 500, 200 ms
    assert r["mean_e2el_ms"] == pytest.approx(1100.0 / 3)
    assert r["p99_e2el_ms"] == pytest.approx(498.0)
    # goodput: only the 1-token request meets ttft <= 250 and tpot <= 100
    assert r["request_goodput"] == pytest.approx(0.5)
    assert r["tok_per_s_per_gpu"] == pytest.approx(10.75)
    assert r["tok_per_s_per_user"] == pytest.approx(1000.0 / ((150.0 + 200.0 / 3) / 2))
    assert r["input_lens"] == [10, 20, 5, 7]
    assert r["output_lens"] == [3, 4, 1, 0]
    assert r["itls"][0] == pytest.approx([0.1, 0.2])
    assert r["errors"] == ["", "", "", "HTTP 500: boom"]
    # tokens in second 0: 3 + 1, in second 1: 4 (2 chunks of 2); the requests never overlap
    assert r["max_output_tokens_per_s"] == 4.0
    assert r["max_concurrent_requests"] == 1


def test_peak_concurrency_is_exact_and_the_peak_rate_counts_tokens():
    records = [RequestRecord(prompt_len=1, start_time=s, chunk_times=[e], output_tokens=n, success=True)
               for s, e, n in ((0.0, 0.3, 1), (0.3, 0.6, 1), (0.6, 0.9, 1), (0.1, 0.95, 12))]
    r = compute_metrics(records, 1.0)
    assert r["max_concurrent_requests"] == 2          # back to back is not at once: [start, end)
    assert r["max_output_tokens_per_s"] == 15.0       # one chunk carried 12 tokens (speculation)
    spread = RequestRecord(prompt_len=1, start_time=0.0, chunk_times=[0.5, 1.5], chunk_tokens=[7, 1],
                           output_tokens=8, success=True)
    assert compute_metrics([spread], 2.0)["max_output_tokens_per_s"] == 7.0   # the server's own counts


def test_metric_selection_and_fractional_percentile_keys():
    r = compute_metrics(_records(), 2.0, percentiles=[99.9], percentile_metrics=["ttft"])
    assert "p99.9_ttft_ms" in r and "p99_ttft_ms" not in r
    assert "mean_tpot_ms" not in r
    assert r["request_goodput"] is None


def test_all_failed_reports_zero_latencies_and_no_interactivity():
    r = compute_metrics([RequestRecord(prompt_len=3, start_time=0.0, error="x")], 1.0)
    assert (r["completed"], r["failed"], r["mean_ttft_ms"]) == (0, 1, 0.0)
    assert r["tok_per_s_per_user"] is None


def test_bad_user_values_raise_value_error():
    with pytest.raises(ValueError, match="itl:5"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="abc"):
        parse_percentiles("50,abc")
    with pytest.raises(ValueError, match="ttfb"):
        parse_percentile_metrics("ttft,ttfb")
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics(_records(), 0.0)
    assert parse_goodput(["ttft:500", "e2el:9000"]) == {"ttft": 500.0, "e2el": 9000.0}


def test_length_bounds_both_conventions():
    assert length_bounds(8192, 0.8, "inferencex") == (6553, 8192)
    assert length_bounds(1024, 1.0, "inferencex") == (1024, 1024)
    assert length_bounds(1024, 0.5, "vllm") == (512, 1536)
    assert length_bounds(1024, 0.0, "vllm") == (1024, 1024)
    with pytest.raises(ValueError, match="1.0"):
        length_bounds(1024, 1.0, "vllm")
    with pytest.raises(ValueError, match="sglang"):
        length_bounds(1024, 0.5, "sglang")


@pytest.mark.parametrize("mode,ratio", [("inferencex", 0.8), ("vllm", 0.3)])
def test_sampled_lengths_stay_in_range_and_are_seeded(mode, ratio):
    ins, outs = sample_lengths(2000, 1000, 100, ratio, mode, seed=7)
    in_low, in_high = length_bounds(1000, ratio, mode)
    out_low, out_high = length_bounds(100, ratio, mode)
    assert in_low <= min(ins) and max(ins) <= in_high
    assert out_low <= min(outs) and max(outs) <= out_high
    # uniform over the whole range: both ends are reached (up to a few units)
    assert min(ins) - in_low < 5 and in_high - max(ins) < 5
    assert (ins, outs) == sample_lengths(2000, 1000, 100, ratio, mode, seed=7)
    assert ins != sample_lengths(2000, 1000, 100, ratio, mode, seed=8)[0]


def _bpe_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(0)
    words = ["serve", "token", "model", "cache", "block", "sparse", "expert", "route"]
    corpus = [" ".join(rng.choice(words, size=12)) for _ in range(300)]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_prompts_retokenize_to_requested_length_without_special_tokens(tmp_path):
    tok = load_tokenizer(_bpe_tokenizer_dir(tmp_path))
    view = TokenizerView(tok)
    eos_id = tok.token_to_id("<eos>")
    assert eos_id not in set(view.allowed_ids.tolist())
    reqs = sample_random_requests(tok, 20, 64, 16, 0.5, "inferencex", seed=3)
    targets, out_targets = sample_lengths(20, 64, 16, 0.5, "inferencex", seed=3)
    assert [r.expected_output_len for r in reqs] == out_targets
    for req, target in zip(reqs, targets):
        ids = tok.encode(req.prompt, add_special_tokens=False).ids
        assert len(ids) == req.prompt_len
        assert abs(req.prompt_len - target) <= 2
        assert eos_id not in ids
    assert reqs == sample_random_requests(tok, 20, 64, 16, 0.5, "inferencex", seed=3)
    assert reqs[0].prompt != sample_random_requests(tok, 20, 64, 16, 0.5, seed=4)[0].prompt
    # no two prompts share a long prefix (which a server's prefix cache would reward)
    assert len({r.prompt[:20] for r in reqs}) == len(reqs)




def test_plain_encode_decode_object_gives_exact_lengths():
    reqs = sample_random_requests(LetterTokenizer(), 10, 30, 5, 0.2, "vllm", seed=1)
    targets, _ = sample_lengths(10, 30, 5, 0.2, "vllm", seed=1)
    assert [len(r.prompt) for r in reqs] == targets == [r.prompt_len for r in reqs]


def test_unloadable_tokenizer_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        load_tokenizer(missing)


def test_arrival_offsets_poisson_rate_and_unlimited():
    from m3serve.bench.serve import arrival_offsets

    assert not arrival_offsets(5, math.inf, 1.0, seed=0).any()
    offsets = arrival_offsets(4000, 20.0, 1.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.1)  # exponential: std = mean
    # burstiness 4: same mean rate, gaps far more regular (gamma std = mean / 2)
    regular = np.diff(arrival_offsets(4000, 20.0, 4.0, seed=0))
    assert regular.std() == pytest.approx(1 / 40.0, rel=0.1)
    assert (offsets == arrival_offsets(4000, 20.0, 1.0, seed=0)).all()
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, 0.0, seed=0)


def test_bench_requests_are_greedy_unless_asked():
    import argparse

    from m3serve.bench.datasets import SampleRequest
    from m3serve.bench.serve import _build_payload, add_cli_args, sampling_of
    parser = argparse.ArgumentParser()
    add_cli_args(parser)

    def payload(*flags):
        args = parser.parse_args(["--base-url", "http://x", *flags])
        return _build_payload("completions", "m", SampleRequest("p", 1, 4), True, None, sampling_of(args))

    assert payload()["temperature"] == 0.0 and "top_k" not in payload()
    assert payload("--temperature", "0.7", "--top-k", "40")["temperature"] == 0.7
    assert payload("--top-k", "40")["top_k"] == 40
    server = payload("--server-sampling-defaults")             # the server's generation config applies
    assert not {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"} & set(server)
    assert payload("--server-sampling-defaults", "--top-p", "0.9")["top_p"] == 0.9
