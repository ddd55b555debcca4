"""Prometheus metrics of the API server, named as vLLM's with an `m3serve:` prefix.

Latency histograms and token/request counters are recorded in the API process as outputs
stream; engine-side gauges and counters (running/waiting requests, KV usage, prefix cache,
preemptions) are read from the engine's latest `EngineStats` at scrape time.
"""
from __future__ import annotations

import itertools
import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    SummaryMetricFamily)

from m3serve.protocol import ITERATION_TOKEN_BUCKETS, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = re.compile(rb"^((?:# (?:HELP|TYPE) )?)m3serve:", re.MULTILINE)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Exposes the engine's last reported stats as gauges and counters."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s, labels, name = self.metrics.engine_stats, ["model_name"], [self.metrics.model_name]
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        for metric, doc, value in (
            ("num_requests_running", "Sequences in the engine's running batch.", s.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_cache_usage),
            ("num_free_kv_blocks", "KV-cache blocks not held by any request.", s.num_free_blocks),
            ("prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, since start.", rate),
            ("kv_transfer_held_requests", "Finished prefills whose KV is held for a decode worker.",
             s.kv_held_requests),
            ("kv_transfer_held_blocks", "KV blocks held for decode workers.", s.kv_held_blocks),
            ("kv_transfer_active_pulls", "Requests pulling their prompt's KV from a prefill worker.",
             s.kv_pulls_active),
            ("kv_offload_usage_perc", "Fraction of the CPU tier's blocks holding a prefix (1 = full).",
             s.kv_offload_usage),
            ("mm_encoder_cache_usage_bytes", "Bytes of vision-encoder outputs held on each rank "
             "(running requests' and those kept for reuse).", s.mm_encoder_cache_bytes),
        ):
            gauge = GaugeMetricFamily(f"m3serve:{metric}", doc, labels=labels)
            gauge.add_metric(name, value)
            yield gauge
        for metric, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Preemptions of running sequences.", s.num_preemptions),
            ("spec_decode_num_drafts", "Verify steps of sequences that had draft tokens.", s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens),
            ("kv_transfer_holds_released", "Held prefills freed after their decode worker was done.",
             s.kv_holds_released),
            ("kv_transfer_holds_expired", "Held prefills freed by the hold timeout (nobody pulled).",
             s.kv_holds_expired),
            ("kv_transfer_pulls", "Prompt KV pulls completed.", s.kv_pulls_done),
            ("kv_transfer_failed_pulls", "Prompt KV pulls that failed or timed out.", s.kv_pulls_failed),
            ("kv_transfer_fallbacks", "Decode legs whose prompt was computed here instead of pulled.",
             s.kv_fallbacks + self.metrics.kv_unreachable_count),
            ("nixl_bytes_transferred", "Bytes of KV pulled.", s.kv_bytes_transferred),
            ("nixl_num_descriptors", "Transfer descriptors posted for KV pulls.", s.kv_num_descriptors),
            ("external_prefix_cache_queries", "Prompt tokens of requests looked up in the CPU tier.",
             s.external_prefix_cache_queries),
            ("external_prefix_cache_hits", "Prompt tokens loaded back from the CPU tier.",
             s.external_prefix_cache_hits),
            ("kv_offload_evictions", "Blocks the CPU tier dropped to make room.", s.kv_offload_evictions),
            ("mm_encoder_cache_queries", "Images and videos whose placeholders a step computed, looked up "
             "in the encoder-output cache.", s.mm_encoder_cache_queries),
            ("mm_encoder_cache_hits", "Images and videos whose encoder output was found (not encoded "
             "again).", s.mm_encoder_cache_hits),
            ("mm_encoder_cache_evictions", "Encoder outputs dropped to stay within --mm-encoder-cache-gb.",
             s.mm_encoder_cache_evictions),
        ):
            counter = CounterMetricFamily(f"m3serve:{metric}", doc, labels=labels)
            counter.add_metric(name, value)
            yield counter
        per_pos = CounterMetricFamily("m3serve:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=labels + ["position"])
        for pos, value in enumerate(s.spec_accepted_per_position):
            per_pos.add_metric(name + [str(pos)], value)
        yield per_pos
        synthetic = GaugeMetricFamily("m3serve:spec_decode_synthetic_acceptance",
                                      "1 when drafts are accepted by a fixed synthetic rule "
                                      "(benchmarks only: outputs are not the model's).", labels=labels)
        synthetic.add_metric(name, 1.0 if s.spec_synthetic_acceptance else 0.0)
        yield synthetic
        if s.iteration_token_counts:
            steps = HistogramMetricFamily("m3serve:iteration_tokens_total",
                                          "Tokens computed per engine step (steps that computed any).",
                                          labels=labels)
            cumulative = list(itertools.accumulate(s.iteration_token_counts))
            bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
            steps.add_metric(name, list(zip(bounds, cumulative)), sum_value=s.iteration_tokens_sum)
            yield steps
        for metric, doc, to_cpu, to_gpu in (
            ("kv_offload_bytes", "Bytes of KV copied between the GPU pool and the CPU tier (all ranks).",
             s.kv_offload_bytes_to_cpu, s.kv_offload_bytes_to_gpu),
            ("kv_offload_seconds", "Time the copies between the GPU pool and the CPU tier took (driver rank).",
             s.kv_offload_seconds_to_cpu, s.kv_offload_seconds_to_gpu),
        ):
            counter = CounterMetricFamily(f"m3serve:{metric}", doc, labels=labels + ["direction"])
            counter.add_metric(name + ["to_cpu"], to_cpu)
            counter.add_metric(name + ["to_gpu"], to_gpu)
            yield counter
        xfer = SummaryMetricFamily("m3serve:nixl_xfer_time_seconds", "Duration of each rank's KV pulls.",
                                   labels=labels)
        xfer.add_metric(name, count_value=s.kv_xfer_count, sum_value=s.kv_xfer_seconds_sum)
        yield xfer


class _Count:
    """A plain counter the engine collector adds to an engine-side one."""

    def __init__(self):
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


class ServerMetrics:
    """The server's metrics, in their own registry (several servers may live in one process)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engine_stats = EngineStats()
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.request_success = Counter(
            "m3serve:request_success", "Finished sequences, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter(
            "m3serve:prompt_tokens", "Prompt tokens of admitted requests.", labels,
            registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(
            "m3serve:generation_tokens", "Generated tokens.", labels,
            registry=self.registry).labels(model_name)
        self.ttft = Histogram(
            "m3serve:time_to_first_token_seconds", "Arrival to first generated token.", labels,
            buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(
            "m3serve:inter_token_latency_seconds", "Gap between successive outputs of a sequence.",
            labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(
            "m3serve:e2e_request_latency_seconds", "Arrival to the last output of a request.",
            labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.kv_unreachable = _Count()    # decode legs whose prefill worker did not answer
        self.registry.register(_EngineCollector(self))

    @property
    def kv_unreachable_count(self) -> int:
        return self.kv_unreachable.value

    def finished(self, finish_reason: str) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()

    def render(self, names: str = "both") -> bytes:
        """The exposition text with `m3serve:` names, vLLM's `vllm:` names (the same metric
        under the same name after the prefix), or both."""
        text = generate_latest(self.registry)
        if names == "m3serve":
            return text
        vllm = _PREFIX.sub(rb"\1vllm:", text)
        return vllm if names == "vllm" else text + vllm
