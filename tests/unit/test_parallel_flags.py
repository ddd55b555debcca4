"""Parallel flags: vLLM's names on the command line (and torchrun's variables as defaults), bad
values refused with the numbers named, and the layout arithmetic the executors rely on."""
import pytest

from m3serve.cli import build_parser
from m3serve.config import EngineConfig, ParallelConfig
from m3serve.rank_layout import RankLayout
from m3serve.engine_args import engine_kwargs


def _config(argv, monkeypatch=None, env=None) -> EngineConfig:
    if env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    args = build_parser().parse_args(["serve", *argv])
    return EngineConfig.from_kwargs(**engine_kwargs(args))


def test_vllm_flag_names():
    p = _config(["-tp", "8", "-dp", "2", "--enable-expert-parallel", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "10.0.0.1", "--master-port", "29600",
                 "--distributed-executor-backend", "mp"]).parallel
    assert (p.tensor_parallel_size, p.data_parallel_size, p.enable_expert_parallel) == (8, 2, True)
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (2, 1, "10.0.0.1", 29600)
    assert p.world_size == 16 and RankLayout.of(p).per_node == 8 and p.uses_processes


def test_torchrun_variables_are_defaults(monkeypatch):
    env = {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400", "GROUP_RANK": "1", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}
    p = _config(["-tp", "2"], monkeypatch, env).parallel
    # torchrun's own store listens on MASTER_PORT: the ranks meet one port above it
    assert (p.master_addr, p.master_port, p.node_rank, p.nnodes) == ("10.0.0.9", 29401, 1, 2)
    assert _config(["-tp", "2", "--node-rank", "0"], monkeypatch, env).parallel.node_rank == 0


@pytest.mark.parametrize("kwargs,words", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=3, nnodes=2), "cannot be spread evenly over nnodes=2"),
    (dict(nnodes=2, node_rank=2, tensor_parallel_size=2), "node_rank must be in [0, nnodes=2)"),
    (dict(distributed_executor_backend="ray"), "unsupported value 'ray'"),
    (dict(distributed_executor_backend="uni", tensor_parallel_size=2), "'uni' runs one rank"),
    (dict(master_port=70000), "master_port must be in [1, 65535]"),
])
def test_bad_parallel_values(kwargs, words):
    with pytest.raises(ValueError) as e:
        ParallelConfig(**kwargs)
    assert words in str(e.value)


def test_rank_layout():
    layout = RankLayout(tp=2, dp=3, nnodes=2)          # 6 ranks, 3 per host
    assert [layout.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [layout.leader_of(r) for r in range(6)] == [0, 0, 2, 2, 4, 4]
    assert layout.tp_group_ranks(1) == [2, 3] and layout.dp_group_ranks(1) == [1, 3, 5]
    assert [layout.local_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]


def test_impossible_layout_refused_before_any_process(tiny_dir):
    from m3serve.llm import LLM

    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(str(tiny_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_local_experts=8 divisible by 16"):
        LLM(str(tiny_dir), tensor_parallel_size=4, data_parallel_size=4, enable_expert_parallel=True)


def test_api_process_imports_no_torch():
    """The API process (server app, engine client, model files, planner) never imports torch."""
    import subprocess
    import sys

    code = ("import sys, m3serve.serving.api_server, m3serve.engine.core_client, m3serve.engine.sync_client, "
            "m3serve.model.files, m3serve.plan, m3serve.engine_args; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'm3serve.llm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
