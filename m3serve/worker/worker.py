"""One worker = one device and one TP rank: loads the model, sizes and allocates the KV caches,
and runs steps through its model runner. The engine core talks to it through `execute_model`.
"""
from __future__ import annotations

import logging

import torch

from m3serve.config import EngineConfig
from m3serve.core.kv_cache.specs import cache_group_specs, num_blocks_for_memory
from m3serve.distributed import TPInfo
from m3serve.model.loader import load_model
from m3serve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device: unsupported value {name!r} (auto, cpu, cuda)")
    return torch.device(name)


class Worker:
    def __init__(self, config: EngineConfig, model_dir, tp: TPInfo = TPInfo(), progress: bool = True):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.model, self.model_config, _ = load_model(
            model_dir, dtype=config.model.dtype, tp=tp, device=self.device, progress=progress,
            load_format=config.model.load_format, seed=config.model.seed,
            quantization=config.model.quantization)
        cfg = self.model_config
        self.block_size = config.cache.block_size or cfg.index_block_size
        if self.block_size != cfg.index_block_size:
            raise ValueError(f"block_size {self.block_size} must equal the model's sparse block size "
                             f"({cfg.index_block_size}): one KV block is one MSA block")
        fp8 = torch.float8_e4m3fn
        kv_dtype = fp8 if config.cache.kv_cache_dtype != "auto" else self.model.dtype
        index_dtype = fp8 if config.cache.index_cache_dtype != "auto" else self.model.dtype
        specs = cache_group_specs(cfg, self.model.attention_layers[0].num_kv_heads, kv_dtype.itemsize,
                                  index_dtype.itemsize)
        self.num_blocks = num_blocks_for_memory(specs, self.block_size, self._kv_cache_bytes())
        if self.num_blocks < 2:
            raise ValueError(f"the KV cache budget ({self._kv_cache_bytes()} bytes) holds fewer than "
                             f"2 blocks; raise --kv-cache-memory or --gpu-memory-utilization")
        self.runner = ModelRunner(self.model, self.block_size, self.num_blocks, self.device,
                                  kv_cache_dtype=kv_dtype, index_cache_dtype=index_dtype,
                                  seed=config.model.seed)
        self.max_model_len = config.model.max_model_len or cfg.max_position_embeddings
        if self.device.type == "cuda" and not config.compilation.enforce_eager:
            from m3serve.worker.cuda_graphs import DecodeGraphs, default_capture_sizes
            sizes = config.compilation.cudagraph_capture_sizes or default_capture_sizes(
                config.scheduler.max_num_seqs)
            self.runner.graphs = DecodeGraphs(self.model, list(sizes), self.block_size,
                                              self.max_model_len, self.device)
            self.runner.graphs.capture()
        logger.info("KV cache: %d blocks of %d tokens (%d tokens) on %s", self.num_blocks,
                    self.block_size, (self.num_blocks - 1) * self.block_size, self.device)

    def _kv_cache_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        # keep headroom for activations of a full token budget (logits dominate)
        headroom = 2 << 30
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - headroom
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                             f"{cache.gpu_memory_utilization}")
        return budget

    def execute_model(self, scheduler_output):
        return self.runner.execute_model(scheduler_output)
