"""The engine core: scheduler + KV cache manager + an executor (the ranks), stepped in a loop.

`step()` schedules, runs the model once and returns per-request outputs. It holds no tokenizer
and no text: detokenization and stop strings live in the API process / offline front end.
"""
from __future__ import annotations

import bisect
import logging
import time

from m3serve import memtrace
from m3serve.config import EngineConfig
from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.kv_connector import MultiConnectorScheduler, combine
from m3serve.core.request import Request
from m3serve.core.scheduler import Scheduler
from m3serve.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from m3serve.core.spec_gate import measured_rule_applies
from m3serve.engine.kv_connectors import scheduler_connectors
from m3serve.protocol import ITERATION_TOKEN_BUCKETS, EngineState

logger = logging.getLogger(__name__)


def _nothing_to_run(so: SchedulerOutput) -> bool:
    """A step without tokens, news for the ranks, or KV-transfer work for them."""
    return not (so.num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids
                or so.kv_connector_metadata is not None or so.encoder_cache_frees)


def async_scheduling_applies(config: EngineConfig) -> bool:
    """--async-scheduling: on unless turned off or this engine cannot run it (logged)."""
    off = config.async_scheduling_off()
    if off is not None and off != "--no-async-scheduling":
        logger.info("async scheduling is off with %s: steps run one after another", off)
    return off is None


class EngineCore:
    def __init__(self, config: EngineConfig, executor, kv_connectors=scheduler_connectors):
        """The core over `executor`'s ranks, sized by their `geometry()`. `kv_connectors(config,
        executor, kv_manager)`: the scheduler sides of the KV connectors (`kv_connectors.py`)."""
        self.config = config
        self.executor = executor
        self.geometry = geo = executor.geometry()
        cfg = geo.model_config
        self.max_model_len = config.model.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        self.kv_manager = KVCacheManager(geo.num_blocks, geo.block_size,
                                         enable_caching=config.cache.enable_prefix_caching,
                                         num_cpu_blocks=geo.num_cpu_blocks, draft_window=geo.draft_window,
                                         num_draft_blocks=geo.num_draft_blocks,
                                         num_lookahead_tokens=config.speculative.num_speculative_tokens)
        connector = combine(kv_connectors(config, executor, self.kv_manager), MultiConnectorScheduler)
        async_on = async_scheduling_applies(config)
        from m3serve.structured.compiler import GrammarCompiles
        # compiled off the loop (and warmed now), so that no grammar holds up a step
        self.grammars = GrammarCompiles(geo.model_dir, cfg.vocab_size, cfg.eos_token_id,
                                        config.structured_outputs.grammar_compile_timeout_seconds)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len,
                                   config.speculative.num_speculative_tokens, connector,
                                   async_scheduling=async_on,
                                   # sampled steps are deferred on one rank only; a speculative
                                   # engine defers none, so that which of its steps speculate, and
                                   # hence a seeded request's draws, are the same at every TP size
                                   defer_sampling=(async_on and config.parallel.world_size == 1
                                                   and not config.speculative.enabled),
                                   grammars=self.grammars,
                                   disable_spec_by_batch_size=config.speculative.disable_by_batch_size,
                                   measure_speculation=measured_rule_applies(config, geo.device_type),
                                   encoder_cache=self._encoder_cache(config, geo))
        if config.speculative.enabled:
            logger.info("speculative decoding: which batches speculate: %s", {
                "fixed": f"below {config.speculative.disable_by_batch_size} running requests",
                "measured": "per batch size, plain steps or the number of drafts whose timed steps emit "
                            "the most tokens per second (core/spec_gate.py)",
                "always": "every one"}[self.scheduler.spec_gate.rule])
        self.num_steps = 0
        self.iteration_token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self._deferred: SchedulerOutput | None = None   # the step whose output comes next

    @staticmethod
    def _encoder_cache(config: EngineConfig, geo):
        """The book of the ranks' encoder outputs (--mm-encoder-cache-gb), with a vision tower."""
        if not geo.has_vision:
            return None
        from m3serve.core.encoder_cache import EncoderCacheBook
        return EncoderCacheBook(config.model.mm_encoder_cache_bytes, geo.encoder_bytes_per_token)

    def add_request(self, request: Request) -> None:
        """Queue a request (ValueError: refused). A request with structured outputs waits for
        its grammar, compiled off this thread; a grammar that fails finishes its request with
        a client error."""
        if request.sampling_params.structured_outputs is not None:
            from m3serve.structured.compiler import check_request
            check_request(request.sampling_params)
        if request.mm_inputs:
            self._check_media(request)
        self.scheduler.add_request(request)

    def media_refusal(self) -> str:
        """Why this engine refuses images and videos ("" when it accepts them): they need a
        vision tower. Every draft kind takes them (docs/model.md, "Drafts and images")."""
        if not self.geometry.has_vision:
            return ("this model is served without a vision tower (a text-only checkpoint, "
                    "or --language-model-only): images and videos are not accepted")
        return ""

    def _check_media(self, request: Request) -> None:
        """Images and videos must be accepted here (media_refusal) and their placeholders
        must add up. Sets the request's prefix-cache spans and encoder-cache keys."""
        from m3serve.multimodal.inputs import encoder_key, media_spans
        if refusal := self.media_refusal():
            raise ValueError(refusal)
        cfg = self.geometry.model_config
        spans = media_spans(request.prompt_token_ids, request.mm_inputs, cfg.image_token_id, cfg.video_token_id)
        request.mm_spans = [(s, e, x.content_hash) for (s, e), x in zip(spans, request.mm_inputs)]
        request.mm_keys = [encoder_key(x) for x in request.mm_inputs]

    def add_requests(self, requests) -> None:
        """Admit `protocol.EngineCoreRequest`s (the children of one request) all or none:
        ValueError (nothing added) when one of them is refused."""
        added = []
        try:
            for r in requests:
                self.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling_params,
                                         r.eos_token_id, arrival_time=r.arrival_time,
                                         cache_salt=r.cache_salt, kv_transfer_params=r.kv_transfer_params,
                                         mm_inputs=r.mm_inputs))
                added.append(r.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()
                or self.scheduler.has_kv_transfer_work or self.scheduler.has_grammar_work)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()

    def step(self) -> list[EngineCoreOutput]:
        """One step. With async scheduling a deferred step's outputs come with the next call:
        that call schedules and launches its own step first, then applies the deferred one."""
        self.num_steps += 1
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.total_num_scheduled_tokens and self.scheduler.grammar_waiting:
            time.sleep(0.001)     # only grammars are pending: leave the CPU to their compilation
        return self.execute(scheduler_output)

    def abandon_deferred(self) -> list[str]:
        """After a failed step: the deferred step's output will never come. Returns its
        requests, for the caller to abort."""
        deferred, self._deferred = self._deferred, None
        return list(deferred.num_scheduled_tokens) if deferred is not None else []

    def execute(self, scheduler_output: SchedulerOutput, skip_idle: bool = False) -> list[EngineCoreOutput]:
        """Run a scheduled step and apply its output (and the deferred step's). `skip_idle`:
        a step with nothing for the ranks does not reach them, unless a deferred output is due."""
        tokens = scheduler_output.total_num_scheduled_tokens
        if tokens:
            self.iteration_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self.iteration_tokens_sum += tokens
        if skip_idle and self._deferred is None and _nothing_to_run(scheduler_output):
            runner_output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])   # KV bookkeeping only
        else:
            runner_output = self.executor.execute_model(scheduler_output)
        if scheduler_output.kv_connector_metadata is not None:
            if runner_output.kv_connector_output is None:
                raise RuntimeError("the step carries KV-connector work, but the ranks sent no reports")
            self.scheduler.update_kv_connectors(runner_output.kv_connector_output)
        outputs = []
        if self._deferred is not None:
            if runner_output.previous is None:
                raise RuntimeError("the worker did not return the output of the deferred step")
            outputs = self.scheduler.update_from_output(self._deferred, runner_output.previous)
        self._deferred = scheduler_output if scheduler_output.deferred else None
        if not scheduler_output.deferred:
            outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        return outputs

    def integrity_error(self) -> str | None:
        """The scheduler's and KV manager's consistency check, as a message (None = fine)."""
        try:
            self.scheduler.check_integrity()
        except RuntimeError as e:
            return str(e)
        return None

    def state(self, query_id: int = 0, dp_rank: int = 0) -> EngineState:
        """This replica's books and rank reports: the answer to a `StateQuery`, the same for the
        engine process and the in-process engine."""
        scheduler, kv, spec = self.scheduler, self.kv_manager, self.scheduler.spec_stats
        return EngineState(
            query_id=query_id, dp_rank=dp_rank, num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting, num_free_blocks=kv.num_free_blocks,
            num_usable_blocks=kv.num_usable_blocks, integrity_error=self.integrity_error(),
            ranks=self.executor.describe(), num_preemptions=scheduler.num_preemptions,
            prefix_cache_hits=kv.prefix_cache_hits,
            external_prefix_cache_hits=kv.offload.stats.hits if kv.offload is not None else 0,
            num_offload_refs=kv.num_offload_refs, spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens, spec_num_accepted_tokens=spec.num_accepted_tokens,
            num_deferred_steps=scheduler.num_deferred_steps, traced_bytes=memtrace.traced_bytes())
