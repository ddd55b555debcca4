"""The executor of a one-rank engine: the worker in this process, no process group."""
from __future__ import annotations

from m3serve.config import EngineConfig
from m3serve.worker.worker import Worker


class UniProcExecutor:
    needs_lockstep = False

    def __init__(self, config: EngineConfig, model_dir, progress: bool = True):
        self.model_dir = model_dir
        self.worker = Worker(config, model_dir, progress=progress)
        self.worker.initialize(self.worker.available_blocks())
        self.model_config = self.worker.model_config
        self.block_size, self.num_blocks = self.worker.block_size, self.worker.num_blocks
        self.num_cpu_blocks = self.worker.num_cpu_blocks
        self.device_type = self.worker.device.type
        self.encoder_bytes_per_token = self.worker.encoder_bytes_per_token   # of an encoder output
        # a window draft's own pool (DSpark): the same on every rank, from the configuration
        self.draft_window, self.num_draft_blocks = self.worker.draft_window, self.worker.num_draft_blocks
        tier = self.worker.cpu_tier
        self.cpu_block_bytes = tier.bytes_per_block if tier is not None else 0

    def execute_model(self, scheduler_output):
        out = self.worker.execute_model(scheduler_output)
        if scheduler_output.kv_connector_metadata:
            out.kv_connector_output = {name: [r] for name, r in self.worker.kv_reports.items()}
        return out

    @property
    def has_vision(self) -> bool:
        """Whether the ranks hold a vision encoder (images and videos accepted)."""
        return self.worker.runner.vision is not None

    def kv_rank_metadata(self) -> list:
        return [self.worker.kv_connector.find("nixl").rank_metadata()]

    def describe(self) -> list[dict]:
        return [{**self.worker.describe(), "rank": 0, "world_size": 1}]

    def shutdown(self) -> None:
        self.worker.shutdown()
