"""The scheduler: decides each step which requests run and how many tokens each computes.

One rule, no phases: every request's `num_computed_tokens` chases its token count (+ draft
tokens) within the step's token budget. Running requests go first (decode, next prefill chunk),
then waiting ones in arrival order (a long prompt is split across steps: chunked prefill). When
the KV pool runs dry, the most recently admitted running request is preempted and recomputed later.
KV that arrives from elsewhere (a prefix the CPU tier holds, a prompt a prefill worker computed)
comes through one KV connector (`core/kv_connector`): the request waits outside the queue in
`WAITING_FOR_KV` while it is loaded into its blocks, then returns to the head of the queue.
"""
from __future__ import annotations

import logging
from collections import deque

from m3serve.config import SchedulerConfig
from m3serve.core.encoder_cache import EncoderCacheBook
from m3serve.core.kv_cache.manager import KVCacheManager, cdiv
from m3serve.core.request import Request, RequestStatus
from m3serve.core.sampling_mode import SamplingMode, sampling_mode
from m3serve.core.scheduler_output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                           NewRequestData, SchedulerOutput)
from m3serve.core.spec_gate import SpeculationGate

logger = logging.getLogger(__name__)


class SpecDecodeStats:
    """Counts of verified drafts since start (vLLM's spec-decode counters)."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0             # verify steps of a request that had drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if num_drafts > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted drafts per step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Scheduler:
    """Plain CPU scheduler; its only product is a `SchedulerOutput` per step.

    Call `update_from_output` with the worker's result of each `schedule()` before the next one.
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv_manager: KVCacheManager,
                 max_model_len: int, num_speculative_tokens: int = 0, kv_connector=None,
                 async_scheduling: bool = False, defer_sampling: bool = False, grammars=None,
                 disable_spec_by_batch_size: int | None = None, measure_speculation: bool = False,
                 encoder_cache: EncoderCacheBook | None = None):
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config = scheduler_config
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        # where a request's drafts stop: its context, or the KV pool where that holds less
        self._draft_limit = min(max_model_len, kv_manager.capacity_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the tail is preempted first
        # Finished/aborted since the last schedule(); reported once so the worker drops them.
        self.finished_req_ids: set[str] = set()
        # req_id -> how many of the request's tokens the worker has been sent.
        self._num_tokens_sent: dict[str, int] = {}
        self.num_preemptions = 0  # over the scheduler's lifetime (metrics, tests)
        # Speculation: drafts come from the worker; every allocation keeps k slots ahead, where
        # the draft writes its KV while proposing.
        self.num_lookahead_tokens = num_speculative_tokens
        self.spec_stats = SpecDecodeStats(num_speculative_tokens)
        # how many drafts each step verifies (core/spec_gate.py): speculative_config.
        # disable_by_batch_size, else by the measured speed of steps with and without drafts, and
        # of verifying fewer of them (`measure_speculation`)
        self.spec_gate = SpeculationGate(num_speculative_tokens, disable_spec_by_batch_size, measure_speculation)
        self.num_plain_steps = 0        # steps a draft model ran without drafts
        self.num_steps_by_width: dict[int, int] = {}   # ... and with each number of drafts verified
        # The KV connector (core.kv_connector.KVConnectorScheduler: one, a composite of several,
        # or None): requests whose KV it loads wait in `kv_waiting` with their status before and
        # the tokens they have computed once it is in (an aborted one stays until its load is
        # over); finished ones whose blocks it keeps for another engine wait in `held`.
        self.connector = kv_connector
        self.kv_waiting: dict[str, tuple[Request, RequestStatus, int]] = {}
        self.held: dict[str, Request] = {}
        self.num_kv_loads = 0             # loads started (every connector) since start
        self._failed_outputs: list[EngineCoreOutput] = []
        # Structured outputs (structured.compiler.GrammarCompiles, or None: no compiling here):
        # requests whose grammar is being compiled wait here, outside the queue, holding nothing.
        self.grammars = grammars
        self.grammar_waiting: dict[str, Request] = {}
        # --long-prefill-token-threshold: no request computes more tokens than this in one step
        # (a long prompt is chunked, so the decodes sharing its steps wait less); drafts fit
        threshold = scheduler_config.effective_long_prefill_threshold(max_model_len)
        self._long_cap = max(threshold, 1 + num_speculative_tokens) if threshold > 0 else max_model_len
        # Async scheduling (the engine core checked it applies): a step whose requests all sample
        # by argmax is deferred, and the next one is scheduled before its tokens are known, each
        # in-flight token counted as a placeholder (docs/architecture.md, "Async scheduling").
        self.async_scheduling = async_scheduling
        # ... and, with `defer_sampling` (one rank: the sampled ids are on the device that feeds
        # the next step), also steps whose requests sample (temperature, top-k/p, min-p, seeds)
        self.defer_sampling = defer_sampling
        self.num_deferred_steps = 0
        self._last_deferred = False     # the previous step's tokens are still on the device
        self.num_landing_steps = 0      # steps that only landed them, so that drafts could follow
        # the previous step expected to admit the waiting head (`_prompt_due`) and admitted none
        # (its running requests short of blocks while tokens were in flight, say): until a step
        # computes prompt tokens or a request ends, the head is not counted as due
        self._head_missed = False
        # --max-num-partial-prefills: requests computing prompt (or recompute) tokens per step
        self._prefill_cap = scheduler_config.max_num_partial_prefills or None
        # which encoder outputs the ranks hold, and for whom (default: kept only while used)
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCacheBook(0, 0)

    # ---------------------------------------------------------------- admission and abort

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it is malformed or could never be served."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request_id {req_id!r} is already in the scheduler")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {req_id!r}: prompt_token_ids is empty")
        if num_prompt + 1 > self.max_model_len:
            raise ValueError(f"request {req_id!r}: prompt length {num_prompt} + 1 generated token "
                             f"exceeds max_model_len {self.max_model_len}")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"request {req_id!r}: max_tokens must be >= 1, got {max_tokens}")
        max_total = self.max_model_len if max_tokens is None else num_prompt + max_tokens
        # The last sampled token is never fed back, so KV is needed for one token less.
        max_kv_tokens = min(max_total, self.max_model_len) - 1
        num_blocks_needed = cdiv(max_kv_tokens, self.kv_manager.block_size)
        if num_blocks_needed > self.kv_manager.num_usable_blocks:
            raise ValueError(
                f"request {req_id!r}: up to {max_kv_tokens} tokens of KV need {num_blocks_needed} "
                f"blocks of {self.kv_manager.block_size} tokens, but the KV pool has only "
                f"{self.kv_manager.num_usable_blocks} blocks")
        self._check_kv_transfer(request)
        self.requests[req_id] = request
        if self.grammars is not None and request.sampling_params.structured_outputs is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.grammar_waiting[req_id] = request
            self.grammars.submit(req_id, request.sampling_params)
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _check_kv_transfer(self, request: Request) -> None:
        p = request.kv_transfer_params
        if p is None or not (p.do_remote_decode or p.do_remote_prefill):
            return
        role = None if self.connector is None else self.connector.kv_role
        if p.do_remote_decode and role not in ("kv_producer", "kv_both"):
            raise ValueError(f"kv_transfer_params.do_remote_decode asks this server to prefill for a "
                             f"decode worker, but it is not a KV producer (--kv-transfer-config "
                             f"kv_role: {role or 'none'})")
        if p.do_remote_prefill and role not in ("kv_consumer", "kv_both"):
            raise ValueError(f"kv_transfer_params.do_remote_prefill asks this server to pull KV from a "
                             f"prefill worker, but it is not a KV consumer (--kv-transfer-config "
                             f"kv_role: {role or 'none'})")

    def abort_requests(self, request_ids) -> None:
        """Abort requests in any state and free their blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        to_abort = {rid for rid in request_ids if rid in self.requests}
        if not to_abort:
            return
        self.running = [r for r in self.running if r.request_id not in to_abort]
        self.waiting = deque(r for r in self.waiting if r.request_id not in to_abort)
        for rid in to_abort:
            request = self.requests[rid]
            self.grammar_waiting.pop(rid, None)
            if request.status == RequestStatus.WAITING_FOR_KV:
                # a load may still write into its blocks: they are freed when it is over
                self._finish(request, RequestStatus.FINISHED_ABORTED, free=False)
                self.connector.abort(rid)
            else:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus, free: bool = True) -> None:
        # The caller has already taken the request out of running/waiting.
        request.status = status
        self._head_missed = False                # its blocks come free
        self.kv_manager.free_draft(request)      # a held request keeps its target KV, never its draft's
        if free:
            self.kv_manager.free(request)
        if self.grammars is not None and request.sampling_params.structured_outputs is not None:
            self.grammars.release(request.request_id)
        if request.mm_held:
            self.encoder_cache.release(request.request_id, {request.mm_keys[k] for k in request.mm_held})
            request.mm_held.clear()
        del self.requests[request.request_id]
        self._num_tokens_sent.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        # The caller has already taken the request out of running.
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---------------------------------------------------------------- queries

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or waiting for their grammar."""
        return len(self.waiting) + len(self.grammar_waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + self.num_waiting + sum(not r.is_finished for r, _, _ in self.kv_waiting.values())

    @property
    def has_grammar_work(self) -> bool:
        """Grammars are being compiled, or a failed one is still to be reported."""
        return bool(self.grammar_waiting) or bool(self._failed_outputs)

    @property
    def has_kv_transfer_work(self) -> bool:
        """The KV connector loads, copies or holds KV: keep calling schedule()."""
        return self.connector is not None and (self.connector.has_pending or bool(self.kv_waiting)
                                               or bool(self.held) or bool(self._failed_outputs))

    @property
    def kv_transfer_is_urgent(self) -> bool:
        """A load or copy is under way: an idle engine polls often (every wait may be TTFT)."""
        return self.connector is not None and self.connector.needs_fast_poll

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """True while finished ids wait to be reported to the worker by the next schedule()."""
        return bool(self.finished_req_ids)

    # ---------------------------------------------------------------- images and videos

    @property
    def _encoder_budget(self) -> int:
        return self.config.max_num_encoder_input_tokens or self.config.max_num_batched_tokens

    def _encoder_plan(self, request: Request, start: int, num_new: int, left: int) -> tuple[int, list[int]]:
        """(tokens to schedule, media items this chunk reaches that the request does not hold
        yet): the chunk [start, start + num_new) is cut before the first item that must be
        encoded (its output is not in the encoder cache) and that the step's encoder budget
        `left` cannot take (0 when that item begins at or before `start`). An item larger than
        the whole budget is taken when the step has encoded nothing yet, so it runs alone
        rather than never. Items found in the cache cost no budget. With a draft, a chunk also
        needs the position after it (EAGLE3 and MTP embed token t + 1 at row t): an item
        starting there is planned in this step, or the chunk stops one token short of it."""
        ahead = 1 if self.num_lookahead_tokens else 0
        end = start + num_new
        cost, items, planned = 0, [], set()
        pending = sorted((s, e, k) for k, (s, e, _) in enumerate(request.mm_spans)
                         if k not in request.mm_held and e > start and s < end + ahead)
        for s, _, k in pending:
            key = request.mm_keys[k]
            n = 0 if key in self.encoder_cache or key in planned else request.mm_inputs[k].num_tokens
            if cost + n <= left or (cost == 0 and left == self._encoder_budget):
                cost += n
                items.append(k)
                planned.add(key)
                continue
            return max(0, s - ahead - start), items
        return num_new, items

    def _commit_encodes(self, request: Request, items: list[int]) -> list[int]:
        """The request holds the outputs of `items` from this step on; returns those that this
        step encodes (the misses: the worker encodes them from the request's pixels)."""
        misses = []
        for k in items:
            if not self.encoder_cache.use(request.mm_keys[k], request.request_id, request.mm_inputs[k].num_tokens):
                misses.append(k)
            request.mm_held.add(k)
        return misses

    def _encoder_cost(self, request: Request, items: list[int]) -> int:
        return sum(request.mm_inputs[k].num_tokens for k in items)

    def _media_for_worker(self, request: Request, num_computed: int, encoding: list[int]) -> list:
        """At a request's first admission: it also holds the outputs of its other items that
        the encoder cache has (those that a step will compute count as queries and hits; those
        whose KV came from a prefix hit or a pull do not); then the worker gets its media, with
        the pixels of the items whose output it does not hold or that this step encodes
        (`encoding`), and the request keeps no pixels."""
        from m3serve.multimodal.inputs import without_pixels
        for k, (_, end, _) in enumerate(request.mm_spans):
            key = request.mm_keys[k]
            if k not in request.mm_held and key in self.encoder_cache:
                self.encoder_cache.use(key, request.request_id, request.mm_inputs[k].num_tokens,
                                       count=end > num_computed)
                request.mm_held.add(k)
        to_worker = [without_pixels(x) if k in request.mm_held and k not in encoding else x
                     for k, x in enumerate(request.mm_inputs)]
        request.mm_inputs = [without_pixels(x) for x in request.mm_inputs]
        return to_worker

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Spend the step's token budget: running requests first, then waiting ones.

        May return an empty step (no tokens) that only reports finished_req_ids.
        """
        if self.connector is not None:
            self._kv_events()
        if self.grammar_waiting:
            self._grammar_events()
        budget = self.config.max_num_batched_tokens
        encoder_left = self._encoder_budget
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        modes: dict[str, SamplingMode] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        preempted: set[str] = set()
        scheduled: list[Request] = []

        # Requests with a token in flight cannot be preempted (it would be lost): when blocks run
        # out, this step schedules what fits and the next one, after the tokens land, preempts.
        in_flight = self.async_scheduling and any(r.num_output_placeholders for r in self.running)
        # Blocks a connector copies out (to the CPU tier) come back within a step or two: wait,
        # not preempt.
        if self.connector is not None and self.connector.has_blocks_in_flight:
            in_flight = True
        short_of_blocks = False
        width = self._draft_width()          # drafts each request verifies (None: a plain step)
        speculate = width is not None
        # the gate answers 0 only where its arm is plain steps and prompt tokens are due: the
        # draft pass then writes the prompt's draft KV, and proposals would only be dropped
        propose = not (self.num_lookahead_tokens and width == 0)
        if speculate and propose and self.num_lookahead_tokens and self._last_deferred:
            # A step with drafts needs its requests' newest tokens on the host (the drafts are
            # proposed from them), but the previous plain step left them on the device: this
            # step schedules nothing and only lands them; the next one speculates. (A step that
            # only writes the draft's KV is a plain step to the ranks: it reads the ids there.)
            speculate, budget = False, 0
            self.num_landing_steps += 1
        prefills = 0           # requests of this step that compute prompt (or recompute) tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_placeholders and self._ends_with_placeholder(request):
                i += 1
                continue     # its in-flight token is its last one
            mode = self._sampling_mode(request)
            if mode is SamplingMode.FULL or not speculate:
                request.spec_token_ids = []     # verification applies none of what its sampler needs
            elif self.num_lookahead_tokens:
                del request.spec_token_ids[width:]   # verified: the first `width` of its drafts
            num_new = min(request.num_tokens_with_spec + request.num_output_placeholders, self.max_model_len)
            num_new = min(num_new - request.num_computed_tokens, budget, self._long_cap)
            prefill = self._is_prefill(request)
            if num_new > 0 and request.mm_spans:
                num_new, encodes = self._encoder_plan(request, request.num_computed_tokens, num_new, encoder_left)
            if num_new <= 0 or (prefill and prefills == self._prefill_cap):
                i += 1
                continue
            while True:
                new_block_ids = self.kv_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_block_ids is not None or in_flight:
                    break
                # Preempted requests always come from the tail, past index i: never one that
                # is already scheduled in this step, except possibly `request` itself.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_block_ids is None:
                short_of_blocks = True
                if in_flight:        # no preemption now: others may still fit in their blocks
                    i += 1
                    continue
                break
            num_spec = request.num_computed_tokens + num_new - request.num_tokens - request.num_output_placeholders
            if num_spec > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            if not speculate:
                self._draft_not_written(request, request.num_computed_tokens + num_new)
            self._add_cached(cached, request, new_block_ids, resumed=False)
            num_scheduled[request.request_id] = num_new
            modes[request.request_id] = mode
            scheduled.append(request)
            budget -= num_new
            prefills += prefill
            if request.mm_spans:
                encoder_left -= self._encoder_cost(request, self._commit_encodes(request, encodes))
            i += 1

        # A step that had to preempt is short of blocks; admitting now would only thrash.
        while (not preempted and not short_of_blocks and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs and prefills != self._prefill_cap):
            request = self.waiting[0]
            pulled = self.kv_manager.has_blocks(request.request_id)   # KV pulled from a prefill worker
            if pulled:     # its blocks already cover the pulled tokens (num_computed_tokens)
                hit_blocks, num_hit = [], request.num_computed_tokens
            elif getattr(request.sampling_params, "prompt_logprobs", None) is not None:
                hit_blocks, num_hit = [], 0  # hits would skip the positions that need logprobs
            else:
                count = not request.lookup_counted
                request.lookup_counted = True
                hit_blocks, num_hit = self.kv_manager.get_computed_blocks(request, count)
                if self.connector is not None:
                    started = self._start_kv_load(request, hit_blocks, num_hit, count)
                    if started:
                        continue
                    if started is None:
                        break    # no blocks for it yet
            num_new = min(request.num_tokens - num_hit, budget, self._long_cap)
            if request.mm_spans:
                num_new, encodes = self._encoder_plan(request, num_hit, num_new, encoder_left)
                if num_new <= 0:
                    break    # its next image waits for the next step's encoder budget
            new_block_ids = self.kv_manager.allocate_slots(request, num_new, 0 if pulled else num_hit, hit_blocks,
                                                           num_lookahead_tokens=self.num_lookahead_tokens)
            if new_block_ids is None:
                if not self.running and self._release_loaded(request):
                    continue     # the blocks other loaded requests held may be enough now
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.lookup_counted = False           # a later admission (after preemption) counts again
            request.num_computed_tokens = num_hit
            if not speculate:
                self._draft_not_written(request, num_hit + num_new)
            if request.mm_spans:
                encodes = self._commit_encodes(request, encodes)
                encoder_left -= self._encoder_cost(request, encodes)
            if request.status == RequestStatus.PREEMPTED:
                self._add_cached(cached, request, self.kv_manager.get_block_ids(request.request_id),
                                 resumed=True)
            else:
                if request.num_cached_tokens == 0:
                    request.num_cached_tokens = num_hit
                new_reqs.append(NewRequestData(
                    req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    mm_inputs=self._media_for_worker(request, num_hit, encodes) if request.mm_spans else [],
                    draft_blocks=self.kv_manager.take_draft_update(request.request_id)))
                self._num_tokens_sent[request.request_id] = request.num_prompt_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            modes[request.request_id] = self._sampling_mode(request)
            scheduled.append(request)
            budget -= num_new
            prefills += 1

        if prefills or preempted:
            self._head_missed = False
        elif width == 0 and self.waiting:       # the gate's 0: prompt tokens were due
            self._head_missed = True
        # prompt logprobs read the step's hidden states, which a deferred step does not keep
        deferrable = (SamplingMode.ARGMAX, SamplingMode.LOGITS) if self.defer_sampling else (SamplingMode.ARGMAX,)
        # (a step with drafts is never deferred: its drafts come back with its output; one that
        # only writes the draft's KV may be)
        deferred = (self.async_scheduling and bool(scheduled) and not (speculate and propose and self.num_lookahead_tokens)
                    and all(modes[r.request_id] in deferrable and r.sampling_params.prompt_logprobs is None
                            for r in scheduled))
        sampled = [r.request_id for r in scheduled
                   if r.num_computed_tokens + num_scheduled[r.request_id] >= r.num_tokens + r.num_output_placeholders]
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            sampling_modes=modes,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            kv_connector_metadata=self.connector.build_step_metadata() or None if self.connector is not None else None,
            deferred=deferred, sampled_req_ids=sampled if deferred else [], speculate=speculate,
            propose=propose,
            encoder_cache_frees=self.encoder_cache.take_freed(),
        )
        self.finished_req_ids = set()
        if self.num_lookahead_tokens:
            self.spec_gate.scheduled(output)
        # Advance now: the KV of these tokens is being written by this step.
        for request in scheduled:
            request.num_computed_tokens += num_scheduled[request.request_id]
            request.spec_token_ids = []
        self._last_deferred = deferred
        if deferred:
            self.num_deferred_steps += 1
            for req_id in sampled:
                self.requests[req_id].num_output_placeholders += 1
        return output

    def _draft_not_written(self, request: Request, end_pos: int) -> None:
        """A plain step runs no draft: a window draft must not read what it computes."""
        if self.kv_manager.draft is not None:
            self.kv_manager.draft.not_written(request.request_id, end_pos)

    @staticmethod
    def _is_prefill(request: Request) -> bool:
        """More than the next token (and its drafts) to compute: a prompt or a recompute."""
        return request.num_computed_tokens + 1 < request.num_tokens + request.num_output_placeholders

    def _ends_with_placeholder(self, request: Request) -> bool:
        """Whether the request's token in flight will be its last (max_tokens, max_model_len)."""
        params = request.sampling_params
        outputs = request.num_output_tokens + request.num_output_placeholders
        return ((params.max_tokens is not None and outputs >= params.max_tokens)
                or request.num_tokens + request.num_output_placeholders >= self.max_model_len)

    @staticmethod
    def _sampling_mode(request: Request) -> SamplingMode:
        """The request's mode this step (its in-flight token counts as an output)."""
        return sampling_mode(request.sampling_params, request.num_output_tokens + request.num_output_placeholders)

    # ---------------------------------------------------------------- KV from elsewhere

    def _start_kv_load(self, request: Request, hit_blocks, num_hit: int, count: bool) -> bool | None:
        """Ask the connector what it can load past the GPU hit; if anything, give the request
        blocks for it and park it in `kv_waiting` while it loads. True: parked (or blocks were
        released: try the head again); False: nothing to load (admit it as usual); None: not
        enough free blocks for it yet (wait)."""
        hit = self.connector.get_num_new_matched_tokens(request, num_hit, hit_blocks, count)
        if hit is None or hit.num_tokens <= 0:
            return False
        kv = self.kv_manager
        num_computed = num_hit + hit.num_tokens
        if hit.optional:
            # only when the whole prompt fits now: a loaded request waits holding its blocks, and
            # several such waiting for each other's blocks would stall (see `_release_loaded`)
            need = (cdiv(request.num_tokens + self.num_lookahead_tokens, kv.block_size) - len(hit_blocks)
                    + sum(1 for b in hit_blocks if b.ref_cnt == 0))
            if need > kv.num_free_blocks:
                if self.running or hit.blocks_come_back:
                    return None          # they come back as requests end and copies land
                if self._release_loaded(request):
                    return True          # try its admission again: their blocks may be enough
                return False             # nothing else will free any: admit it without the load
        if kv.allocate_slots(request, 0, num_computed, hit_blocks) is None:
            return None
        self.waiting.popleft()
        request.lookup_counted = False
        self.kv_waiting[request.request_id] = (request, request.status, num_computed)
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_external_tokens = hit.num_tokens
        request.kv_load_required |= not hit.optional
        self.num_kv_loads += 1
        self.connector.start_load(request, kv.get_block_ids(request.request_id), num_hit)
        return True

    def _release_loaded(self, head: Request) -> bool:
        """Nothing runs and the head of the queue cannot get its blocks: requests behind it
        that hold blocks an optional load brought let go of them (they stay in the GPU prefix
        cache, so a later admission hits them there). Whether any did."""
        released = False
        for request in self.waiting:
            if (request is not head and request.num_external_tokens and not request.kv_load_required
                    and self.kv_manager.has_blocks(request.request_id)):
                self.kv_manager.free(request)
                request.num_computed_tokens = request.num_external_tokens = 0
                released = True
        return released

    def update_kv_connectors(self, kv_connector_output: dict[str, list]) -> None:
        """The ranks' reports of a step (`ModelRunnerOutput.kv_connector_output`), applied as soon
        as the step returns (before its tokens, and whether or not they are deferred); loads
        that are over land at once."""
        self.connector.update_step_output(kv_connector_output)
        self._land_kv()

    def _kv_events(self) -> None:
        for req_id in self.connector.holds_to_free():
            request = self.held.pop(req_id, None)
            if request is not None:
                self.kv_manager.free(request)
        self._land_kv()

    def _land_kv(self) -> None:
        """Loads that are over: the request returns to the head of the queue with the loaded
        tokens computed; after a failure it computes them itself (or fails, by the connector's
        policy); an aborted one frees its blocks only now, when nothing writes into them."""
        for req_id, failure in self.connector.take_finished_loads():
            request, status, num_computed = self.kv_waiting.pop(req_id)
            if request.status == RequestStatus.FINISHED_ABORTED:
                self.kv_manager.free(request)
                continue
            if failure is None:
                request.num_computed_tokens = num_computed
            else:
                self.kv_manager.free(request)
                request.num_cached_tokens = request.num_external_tokens = 0
                request.kv_load_required = False
            error = self.connector.on_load_end(request, failure)
            if error is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED, free=False)
                self._failed_outputs.append(EngineCoreOutput(req_id, [], "error", None, error=error))
                continue
            request.status = status
            self.waiting.appendleft(request)

    def _grammar_events(self) -> None:
        """Requests whose grammar is compiled join the queue; one that failed (invalid, or past
        its time bound) finishes with its error, reported by the next update."""
        for req_id, error, is_client in self.grammars.poll():
            request = self.grammar_waiting.pop(req_id, None)
            if request is None:
                continue                 # aborted meanwhile
            if error is None:
                request.status = RequestStatus.WAITING
                self.waiting.append(request)
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._failed_outputs.append(EngineCoreOutput(req_id, [], "error", None, error=error,
                                                         error_is_client=is_client))

    def _add_cached(self, cached: CachedRequestData, request: Request, new_block_ids: list[int],
                    resumed: bool) -> None:
        num_sent = self._num_tokens_sent[request.request_id]
        cached.req_ids.append(request.request_id)
        cached.resumed_from_preemption.append(resumed)
        cached.new_token_ids.append(request.all_token_ids[num_sent:])
        cached.new_block_ids.append(new_block_ids)
        cached.num_computed_tokens.append(request.num_computed_tokens)
        if self.kv_manager.draft is not None:
            cached.draft_blocks.append(self.kv_manager.take_draft_update(request.request_id))
        # a token in flight reaches the worker from the device, not from here
        self._num_tokens_sent[request.request_id] = request.num_tokens + request.num_output_placeholders

    # ---------------------------------------------------------------- results of one step

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, cache full blocks, free finished requests."""
        index = {rid: i for i, rid in enumerate(model_runner_output.req_ids)}
        outputs: list[EngineCoreOutput]
        outputs, self._failed_outputs = self._failed_outputs, []
        finished: set[str] = set()
        sampled_ids = set(scheduler_output.sampled_req_ids)
        num_applied = 0                   # requests that emitted tokens
        verified = []                     # (drafts, drafts kept) of each request's real drafts
        for req_id, num_tokens_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted (or preempted) after it was scheduled
            if req_id not in index:
                raise RuntimeError(f"model runner output lacks scheduled request {req_id!r}")
            i = index[req_id]
            if req_id in model_runner_output.failed:
                if scheduler_output.deferred and req_id in sampled_ids:
                    request.num_output_placeholders -= 1
                request.status = RequestStatus.FINISHED_ABORTED
                outputs.append(EngineCoreOutput(req_id, [], "error", None, error=model_runner_output.failed[req_id],
                                                error_is_client=True))
                finished.add(req_id)
                continue
            new_token_ids: list[int] = []
            # A partial prefill chunk has no next token yet: its sample is discarded.
            if scheduler_output.deferred:      # the next step has been scheduled since
                caught_up = req_id in sampled_ids
                if caught_up:
                    request.num_output_placeholders -= 1
            else:
                caught_up = request.num_computed_tokens >= request.num_tokens
            if caught_up:
                sampled = model_runner_output.sampled_token_ids[i]
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
                if not 1 <= len(sampled) <= len(drafts) + 1:
                    raise RuntimeError(f"request {req_id!r}: {len(sampled)} sampled tokens for "
                                       f"{len(drafts)} drafts")
                # Rejected drafts' KV is stale; recompute from the first rejected position.
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                if drafts:
                    self.spec_stats.record(len(drafts), len(sampled) - 1)
                    verified.append((len(drafts), len(sampled) - 1))
                for token_id in sampled:
                    request.append_output_token_ids([token_id])
                    new_token_ids.append(token_id)
                    status = self._check_stop(request, token_id)
                    if status is not None:
                        request.status = status
                        break
            num_applied += bool(new_token_ids)
            self.kv_manager.cache_blocks(request, request.num_computed_tokens)
            if caught_up and model_runner_output.spec_token_ids is not None and not request.is_finished:
                request.spec_token_ids = self._usable_drafts(
                    request, model_runner_output.spec_token_ids[i])

            prompt_logprobs = model_runner_output.prompt_logprobs.get(req_id)
            if new_token_ids or request.is_finished or prompt_logprobs is not None:
                logprobs = None
                if new_token_ids and model_runner_output.logprobs is not None:
                    logprobs = model_runner_output.logprobs[i]
                outputs.append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=new_token_ids,
                    finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                    new_logprobs=logprobs, new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=request.num_cached_tokens))
            if request.is_finished:
                finished.add(req_id)

        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
            by_id = {o.request_id: o for o in outputs}
            for req_id in finished:
                request = self.requests[req_id]
                params = None
                if self.connector is not None and request.status == RequestStatus.FINISHED_LENGTH:
                    params = self.connector.request_finished(request, self.kv_manager.get_block_ids(req_id))
                if params is not None:
                    # its KV waits for the other engine (a stop or EOS ends the request there too)
                    by_id[req_id].kv_transfer_params = params
                    self.held[req_id] = request
                    self._finish(request, request.status, free=False)
                else:
                    self._finish(request, request.status)
        if self.num_lookahead_tokens:
            self.spec_gate.observe(scheduler_output, num_applied, verified)
        return outputs

    def _draft_width(self) -> int | None:
        """With a draft model: how many drafts each request verifies in this step, None for a
        plain step without a draft pass (`spec_gate`'s rule). Without one: 0 (nothing reads it)."""
        if not self.num_lookahead_tokens:
            return 0
        width = self.spec_gate.draft_width(len(self.running), self._prompt_due, self._mean_output_budget,
                                           self._joining)
        if width is None:
            self.num_plain_steps += 1
        else:
            self.num_steps_by_width[width] = self.num_steps_by_width.get(width, 0) + 1
        return width

    def _joining(self) -> int:
        """The requests that will run once the waiting ones are admitted (max_num_seqs at most):
        the batch a prompt computed now will decode in."""
        return min(self.config.max_num_seqs, len(self.running) + len(self.waiting))

    def _mean_output_budget(self) -> float | None:
        """The running requests' mean output length in tokens as they were asked for: max_tokens,
        or what max_model_len leaves after the prompt (the speculation gate's finish spread)."""
        if not self.running:
            return None
        total = 0
        for r in self.running:
            room = self.max_model_len - r.num_prompt_tokens
            cap = r.sampling_params.max_tokens
            total += room if cap is None else min(cap, room)
        return total / len(self.running)

    def _prompt_due(self) -> bool:
        """Whether the next step may compute prompt tokens: a running request's next chunk, or
        the head of the queue with room to be admitted -- a free seat and free blocks for its
        first chunk, and not missed by the previous step (a head that waits for blocks would
        otherwise make every step run the draft pass, whatever the gate chose; a prefix hit it
        may have is not looked up here)."""
        if any(self._is_prefill(r) for r in self.running):
            return True
        if self._head_missed or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        head = self.waiting[0]
        chunk = min(head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens, self._long_cap)
        return (cdiv(head.num_computed_tokens + chunk + self.num_lookahead_tokens, self.kv_manager.block_size)
                - len(self.kv_manager.get_block_ids(head.request_id)) <= self.kv_manager.num_free_blocks)

    def _usable_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """Drafts past the context (max_model_len, or the KV pool where it holds fewer tokens)
        are dropped: a verify step past the pool would never get its blocks, and the request
        would wait for them forever. Drafts past max_tokens are kept: every request then
        verifies k drafts, so the step still fits the verify CUDA graphs, and the tokens past
        max_tokens are discarded as they are emitted."""
        room = self._draft_limit - request.num_tokens
        return list(drafts[:max(0, room - 1)])

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Stop rules after appending `token_id`; sets stop_reason for a user stop token.

        Extra EOS ids the engine put in `sampling_params.all_stop_token_ids` (if that attribute
        exists) stop like the EOS token. max_tokens None means "until max_model_len".
        """
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if token_id in getattr(params, "all_stop_token_ids", ()):
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---------------------------------------------------------------- checks

    def check_integrity(self) -> None:
        """Raise RuntimeError if queues, statuses and KV block ownership disagree."""
        problems = []
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        compiling = list(self.grammar_waiting)
        loading = [rid for rid, (r, _, _) in self.kv_waiting.items() if not r.is_finished]
        everyone = running_ids + waiting_ids + compiling + loading
        if len(set(everyone)) != len(everyone):
            problems.append(f"a request is queued twice: running={running_ids} waiting={waiting_ids} "
                            f"compiling={compiling} loading={loading}")
        if set(everyone) != set(self.requests):
            problems.append("running + waiting + compiling + loading differ from the known requests")
        for r, _, _ in self.kv_waiting.values():
            if r.status not in (RequestStatus.WAITING_FOR_KV, RequestStatus.FINISHED_ABORTED):
                problems.append(f"{r!r} is waiting for KV from a connector")
            if not self.kv_manager.has_blocks(r.request_id):
                problems.append(f"{r!r} is waiting for KV from a connector without blocks")
        for r in self.grammar_waiting.values():
            if r.status != RequestStatus.WAITING_FOR_GRAMMAR:
                problems.append(f"{r!r} is waiting for its grammar")
        if len(self.running) > self.config.max_num_seqs:
            problems.append(f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}")
        for r in self.running:
            if r.status != RequestStatus.RUNNING:
                problems.append(f"{r!r} is in running")
        for r in self.waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                problems.append(f"{r!r} is in waiting")
        holders = set(self.kv_manager.request_ids)
        # requests whose load has ended wait at the head of the queue with their blocks
        may_hold = set(running_ids) | set(self.kv_waiting) | set(self.held) | {
            r.request_id for r in self.waiting if getattr(r, "num_external_tokens", 0)}
        if not holders <= may_hold:
            problems.append(f"requests that may not hold blocks do: {sorted(holders - may_hold)}")
        if self.kv_manager.draft is not None:
            draft_holders = set(self.kv_manager.draft.request_ids)
            if not draft_holders <= set(running_ids):
                problems.append(f"requests that do not run hold draft blocks: "
                                f"{sorted(draft_holders - set(running_ids))}")
        problems += self.encoder_cache.check_integrity(
            {rid: {r.mm_keys[k] for k in r.mm_held} for rid, r in self.requests.items() if r.mm_held})
        if problems:
            raise RuntimeError("scheduler integrity check failed:\n  " + "\n  ".join(problems))
        self.kv_manager.check_integrity()
