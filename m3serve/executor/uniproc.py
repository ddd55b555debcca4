"""The executor of a one-rank engine: the worker in this process, no process group."""
from __future__ import annotations

from m3serve.config import EngineConfig
from m3serve.executor import EngineGeometry, geometry_of
from m3serve.worker.worker import Worker


class UniProcExecutor:
    needs_lockstep = False

    def __init__(self, config: EngineConfig, model_dir, progress: bool = True):
        self.worker = Worker(config, model_dir, progress=progress)
        self.worker.initialize(self.worker.available_blocks())
        self._geometry = geometry_of(self.worker, model_dir, self.worker.num_blocks)

    def geometry(self) -> EngineGeometry:
        return self._geometry

    def execute_model(self, scheduler_output):
        out = self.worker.execute_model(scheduler_output)
        if scheduler_output.kv_connector_metadata:
            out.kv_connector_output = {name: [r] for name, r in self.worker.kv_reports.items()}
        return out

    def kv_rank_metadata(self) -> list:
        return [self.worker.kv_connector.find("nixl").rank_metadata()]

    def describe(self) -> list[dict]:
        return [{**self.worker.describe(), "rank": 0, "world_size": 1}]

    def shutdown(self) -> None:
        self.worker.shutdown()
