"""One worker = one rank on one device: loads this rank's model shard, says how many KV blocks
fit in its memory, allocates the caches once the executor has settled the engine-wide block
count (the minimum over ranks), captures the decode CUDA graphs, and runs steps through its
model runner.
"""
from __future__ import annotations

import gc
import logging
import os
import time

import torch

from m3serve.config import EngineConfig
from m3serve.core.kv_cache.specs import cache_group_specs, num_blocks_for_memory
from m3serve.distributed import ParallelInfo
from m3serve.model.loader import load_model
from m3serve.worker.model_runner import DPStep, ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device of a rank: `auto` and `cuda` mean GPU number `local_rank` when there is one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device: unsupported value {name!r} (auto, cpu, cuda)")
    if name == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"rank needs GPU {local_rank}, but this host has {count} GPU(s)")
        return torch.device("cuda", local_rank)
    return torch.device(name)


class Worker:
    def __init__(self, config: EngineConfig, model_dir, parallel: ParallelInfo = ParallelInfo(),
                 device: torch.device | None = None, is_driver: bool = True, progress: bool = True):
        self.config, self.parallel, self.is_driver = config, parallel, is_driver
        self.model_dir = model_dir
        self.device = device if device is not None else resolve_device(config.model.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model, self.model_config, loaded_dir = load_model(
            model_dir, dtype=config.model.dtype, parallel=parallel, device=self.device,
            progress=progress, load_format=config.model.load_format, seed=config.model.seed,
            quantization=config.model.quantization, hf_overrides=config.model.hf_overrides)
        cfg = self.model_config
        self.vision = None
        if config.model.language_model_only:
            pass
        elif config.model.load_format == "dummy":
            from m3serve.model.loader import dummy_vision_encoder
            self.vision = dummy_vision_encoder(cfg, self.model.dtype, self.device, config.model.seed)
        else:
            from m3serve.model.loader import load_vision_encoder
            self.vision = load_vision_encoder(cfg, loaded_dir, self.model.dtype, self.device)
        # an encoder output is [num_tokens, hidden] in the model's dtype (worker/media.py)
        self.encoder_bytes_per_token = cfg.hidden_size * self.model.dtype.itemsize if self.vision is not None else 0
        self.block_size = config.cache.block_size or cfg.index_block_size
        if self.block_size != cfg.index_block_size:
            raise ValueError(f"block_size {self.block_size} must equal the model's sparse block size "
                             f"({cfg.index_block_size}): one KV block is one MSA block")
        fp8 = torch.float8_e4m3fn
        self.kv_dtype = fp8 if config.cache.kv_cache_dtype != "auto" else self.model.dtype
        self.index_dtype = fp8 if config.cache.index_cache_dtype != "auto" else self.model.dtype
        self.cache_specs = cache_group_specs(cfg, self.model.attention_layers[0].num_kv_heads,
                                             self.kv_dtype.itemsize, self.index_dtype.itemsize)
        self.max_model_len = config.model.max_model_len or cfg.max_position_embeddings
        self.proposer = None
        # a window draft (DSpark) keeps its KV in a pool of its own, sized by the configuration
        self.draft_window = self.num_draft_blocks = self.draft_pool_bytes = 0
        spec = config.speculative
        if spec.enabled:
            from m3serve.spec_decode.proposer import Proposer
            self.proposer = Proposer(spec, self.model, cfg, model_dir, parallel, self.device,
                                     config.model.load_format, config.model.seed, self.max_model_len)
            draft_specs = self.proposer.cache_specs(self.kv_dtype.itemsize, self.index_dtype.itemsize)
            self.draft_window = self.proposer.drafter.sliding_window
            if self.draft_window:
                from m3serve.core.kv_cache.specs import window_pool_blocks
                self.num_draft_blocks = window_pool_blocks(
                    self.draft_window, spec.num_speculative_tokens, self.block_size,
                    config.scheduler.max_num_seqs, self.max_model_len)
                self.draft_pool_bytes = self.num_draft_blocks * sum(
                    s.bytes_per_block(self.block_size) for s in draft_specs)
            else:
                self.cache_specs += draft_specs
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self.capture_sizes: list[int] = []     # decode batch sizes with CUDA graphs (set by initialize)
        # the worker sides of the KV connectors (core.kv_connector.KVConnectorWorker: one, a
        # composite, or None): P/D transfer with --kv-transfer-config, the CPU tier with
        # --kv-offloading-size; and their reports of the last step ({name: report})
        self.kv_connector = None
        self.kv_reports: dict = {}
        self.num_cpu_blocks = 0

    def available_blocks(self) -> int:
        """KV blocks (every cache group on the engine's block ids) that fit in this rank's
        budget, after a window draft's own pool."""
        return num_blocks_for_memory(self.cache_specs, self.block_size,
                                     max(0, self._kv_cache_bytes() - self.draft_pool_bytes))

    def available_cpu_blocks(self) -> int:
        """Blocks (every cache group) of this rank's share of the CPU tier (0 = no tier)."""
        total = self.config.cache.kv_offloading_bytes
        if not total:
            return 0
        share = total // self.parallel.tp.size
        per_block = sum(s.bytes_per_block(self.block_size) for s in self.cache_specs)
        if share < per_block:
            raise ValueError(f"kv_offloading_size {self.config.cache.kv_offloading_size} GiB gives each of the "
                             f"{self.parallel.tp.size} TP rank(s) {share} bytes, less than one KV block "
                             f"({per_block} bytes on a rank)")
        return share // per_block

    def initialize(self, num_blocks: int, num_cpu_blocks: int | None = None) -> None:
        """Allocate `num_blocks` blocks of both cache groups (and `num_cpu_blocks` in the CPU
        tier, by default this rank's share) and capture the decode graphs."""
        if num_blocks < 2:
            draft = (f" beside the draft's window pool ({self.draft_pool_bytes} bytes)"
                     if self.draft_pool_bytes else "")
            raise ValueError(f"the KV cache budget ({self._kv_cache_bytes()} bytes) holds fewer than "
                             f"2 blocks{draft}; raise --kv-cache-memory or --gpu-memory-utilization")
        config = self.config
        from m3serve.worker.cuda_graphs import capture_sizes
        sizes = self.capture_sizes = capture_sizes(config, self.device.type)
        max_reqs = max([config.scheduler.max_num_seqs, *sizes])
        k = config.speculative.num_speculative_tokens
        self.num_blocks = num_blocks
        grammars = rejection = None
        if self.is_driver or self.proposer is not None:      # the ranks that sample
            from m3serve.structured.compiler import GrammarBook
            grammars = GrammarBook(self.model_dir, self.model_config.vocab_size)
            grammars.warm_up(self.device)
        graph_sizes, graph_widths, rule = [], [], None
        if self.proposer is not None:
            from m3serve.core.spec_gate import rule_of
            from m3serve.worker.rejection import RejectionSampler
            spec = config.speculative
            self.proposer.allocate_caches(self.num_draft_blocks or num_blocks, self.block_size, self.kv_dtype,
                                          self.index_dtype)
            rejection = RejectionSampler(
                spec.rejection_sample_method, spec.synthetic_acceptance_length, spec.num_speculative_tokens,
                torch.Generator(device=self.device).manual_seed(config.model.seed + 1))
            rule = rule_of(config, self.device.type)
            if sizes:
                from m3serve.worker.spec_graphs import spec_graph_widths
                graph_sizes, graph_widths = sizes, spec_graph_widths(k, rule)
        self.runner = ModelRunner(
            self.model, self.block_size, num_blocks, self.device, self.max_model_len, max_reqs,
            max(config.scheduler.max_num_batched_tokens, max_reqs * (k + 1)), kv_cache_dtype=self.kv_dtype,
            index_cache_dtype=self.index_dtype, seed=config.model.seed, is_driver=self.is_driver,
            extra_positions=k, draft_tables=self.draft_window > 0, vision=self.vision,
            proposer=self.proposer, rejection=rejection, grammars=grammars,
            spec_graph_sizes=graph_sizes, spec_graph_widths=graph_widths)
        if sizes and self.proposer is not None:
            self.runner.spec_graphs.capture(self.runner.batch)
            # the steps that decode without drafts: at disable_by_batch_size and above, or at
            # any size the measured rule may turn drafts off for (core/spec_gate.py)
            limit = config.speculative.disable_by_batch_size
            plain = ([s for s in sizes if s >= limit] if rule == "fixed"
                     else sizes if rule == "measured" else [])
            if plain:
                self.runner.capture_cuda_graphs(plain)
        elif sizes:
            self.runner.capture_cuda_graphs(sizes)
        if self.device.type == "cuda":   # compile prefill / mixed-step kernels before serving
            start = time.perf_counter()
            max_tokens = min(config.scheduler.max_num_batched_tokens, self.max_model_len)
            self.runner.warm_up(self.runner.warm_up_shapes(max_tokens))
            logger.info("warmed up the prefill kernels in %.1f s", time.perf_counter() - start)
            if self.vision is not None:
                self._warm_up_vision()
        self.num_cpu_blocks = self.available_cpu_blocks() if num_cpu_blocks is None else num_cpu_blocks
        from m3serve.core.kv_connector import MultiConnectorWorker, combine
        from m3serve.worker.kv_connectors import worker_connectors
        self.kv_connector = combine(worker_connectors(config, self), MultiConnectorWorker)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens) on %s", num_blocks,
                    self.block_size, (num_blocks - 1) * self.block_size, self.device)
        if self.draft_window:
            logger.info("draft KV: its own pool of %d blocks (%.3f GiB), a %d-token window for each of "
                        "%d running requests", self.num_draft_blocks, self.draft_pool_bytes / (1 << 30),
                        self.draft_window, config.scheduler.max_num_seqs)

    def cache_planes(self) -> list[tuple[str, torch.Tensor]]:
        """Every cache tensor indexed by block id, as (group, view with the block id first):
        each layer's K and V, each sparse layer's index keys, and the draft's caches on these
        block ids (a window draft's own pool is not among them: the CPU tier carries none of it)."""
        runner = self.runner
        planes = []
        for kv in runner.kv_caches:
            planes += [("main", kv[0]), ("main", kv[1])]
        planes += [("index", index) for index in runner.index_caches if index is not None]
        if self.proposer is not None:
            planes += self.proposer.cache_planes()
        return planes

    @torch.inference_mode()
    def _warm_up_vision(self) -> None:
        """Two encoder forwards on zero pixels (one 672 x 672 image; that image beside a smaller
        one) so the first served image does not pay the GEMM and attention libraries' start-up."""
        start = time.perf_counter()
        cfg = self.vision.cfg
        for grids in ([(1, 48, 48)], [(1, 48, 48), (1, 16, 24)]):
            patches = sum(t * h * w for t, h, w in grids)
            self.vision(torch.zeros(patches, cfg.patch_dim, device=self.device), grids)
        torch.cuda.synchronize(self.device)
        logger.info("warmed up the vision encoder in %.1f s", time.perf_counter() - start)

    def transfer_planes(self) -> list[tuple]:
        """This rank's cache planes as P/D transfer registers them: per layer (index, K/V
        cache, index cache or None, first KV head held here, total KV heads)."""
        from m3serve.layers.linear import kv_head_range

        total = self.model_config.num_key_value_heads
        first, _ = kv_head_range(total, self.parallel.tp)
        runner = self.runner
        return [(i, kv, index, first, total)
                for i, (kv, index) in enumerate(zip(runner.kv_caches, runner.index_caches))]

    @property
    def cpu_tier(self):
        """This rank's CPU tier (`worker.kv_offload.KVOffloadWorker`), or None."""
        return self.kv_connector.find("cpu_tier") if self.kv_connector is not None else None

    def _kv_cache_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        # what loading freed (e.g. the bf16 shards an online quantisation read: 7 GB per layer's
        # experts at TP 2) stays reserved by torch's caching allocator and would read as used
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # keep headroom for activations of a full token budget (logits dominate), and room for
        # the encoder outputs within --mm-encoder-cache-gb (core/encoder_cache.py)
        headroom = 2 << 30
        if self.vision is not None:
            headroom += self.config.model.mm_encoder_cache_bytes
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - headroom
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                             f"{cache.gpu_memory_utilization}")
        return budget

    def execute_model(self, scheduler_output, dp: DPStep | None = None):
        """One step; the KV connectors' work starts before the forward and is reported after it
        (`kv_reports`): loads write only into blocks of requests that are not in the batch, and
        copies out run on a side stream after the work already queued."""
        meta = scheduler_output.kv_connector_metadata
        if meta:
            if self.kv_connector is None:
                raise RuntimeError(f"the step carries work for KV connector(s) {sorted(meta)}, "
                                   f"but this rank has none")
            self.kv_connector.start_step(meta)
        out = self.runner.execute_model(scheduler_output, dp)
        self.kv_reports = self.kv_connector.step_reports(meta) if meta else {}
        return out

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def describe(self) -> dict:
        """What this rank is and holds (for state reports and tests)."""
        p, ex = self.parallel, None
        moe = next((layer.mlp for layer in self.model.model.layers if layer.is_moe), None)
        if moe is not None:
            ex = moe.experts
        return {
            "pid": os.getpid(), "device": str(self.device),
            "tp_rank": p.tp.rank, "tp_size": p.tp.size, "dp_rank": p.dp.rank, "dp_size": p.dp.size,
            "expert_parallel": p.enable_expert_parallel,
            "num_local_experts": ex.num_local if ex else 0, "first_expert": ex.first if ex else 0,
            "expert_inter_local": ex.inter_local if ex else 0,
            "vocab_rows": self.model.lm_head.rows, "num_blocks": self.num_blocks,
            "num_cpu_blocks": self.num_cpu_blocks, "num_draft_blocks": self.num_draft_blocks,
            "num_batch_rows": self.runner.batch.num_rows if self.runner else 0,
            "index_cache_layers": ([i for i, c in enumerate(self.runner.index_caches) if c is not None]
                                   if self.runner else []),
            # the store of vision-encoder outputs (the same keys on every rank)
            "encoder_outputs": sorted(store) if (store := self.runner and self.runner.encoder_outputs) else [],
        }
