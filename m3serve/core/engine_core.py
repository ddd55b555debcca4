"""The engine core: scheduler + KV cache manager + an executor (the ranks), stepped in a loop.

`step()` schedules, runs the model once and returns per-request outputs. It holds no tokenizer
and no text: detokenization and stop strings live in the API process / offline front end.
"""
from __future__ import annotations

import logging

from m3serve.config import EngineConfig
from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.request import Request
from m3serve.core.scheduler import Scheduler
from m3serve.core.scheduler_output import EngineCoreOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor):
        self.config = config
        self.executor = executor
        cfg = executor.model_config
        self.max_model_len = config.model.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        self.kv_manager = KVCacheManager(executor.num_blocks, executor.block_size,
                                         enable_caching=config.cache.enable_prefix_caching)
        connector = None
        if config.kv_transfer.enabled:
            from m3serve.disagg.connector import KVTransferScheduler
            connector = KVTransferScheduler(config.kv_transfer, executor.block_size, executor.num_blocks,
                                            executor.kv_rank_metadata())
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len,
                                   config.speculative.num_speculative_tokens, connector)
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        structured = request.sampling_params.structured_outputs
        if structured is not None:      # compiled now: a bad grammar is the client's 400
            if self.config.speculative.enabled:
                raise ValueError("structured outputs (response_format, structured_outputs, guided_*, "
                                 "tool_choice 'required' or named) cannot be combined with speculative "
                                 "decoding yet")
            from m3serve.worker.structured import compile_grammar
            compile_grammar(request.sampling_params, self.executor.model_dir, self.executor.model_config.vocab_size)
        self.scheduler.add_request(request)

    def add_requests(self, requests) -> None:
        """Admit `protocol.EngineCoreRequest`s (the children of one request) all or none:
        ValueError (nothing added) when one of them is refused."""
        added = []
        try:
            for r in requests:
                self.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling_params,
                                         r.eos_token_id, arrival_time=r.arrival_time,
                                         cache_salt=r.cache_salt, kv_transfer_params=r.kv_transfer_params))
                added.append(r.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()
                or self.scheduler.has_kv_transfer_work)

    def shutdown(self) -> None:
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def integrity_error(self) -> str | None:
        """The scheduler's and KV manager's consistency check, as a message (None = fine)."""
        try:
            self.scheduler.check_integrity()
        except RuntimeError as e:
            return str(e)
        return None
