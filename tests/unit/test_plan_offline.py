"""`m3serve plan <known hub id>` reads the config.json copy shipped with m3serve, with no network,
and says which config it used (the M3.1-Flash copy labelled as reconstructed)."""
import argparse

import pytest

from m3serve import plan as plan_cli
from m3serve.bench.realshape import realshape_config_dict
from m3serve.config import ParallelConfig
from m3serve.model.config import parse_config


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any hub access fails, as on a machine without a network."""
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(model: str, *flags: str) -> dict:
    parser = argparse.ArgumentParser()
    plan_cli.add_cli_args(parser)
    return plan_cli.main(parser.parse_args([model, *flags]))


def test_m3_plans_offline_like_the_real_shape(capsys):
    result = run("MiniMaxAI/MiniMax-M3", "-tp", "8")
    shown = capsys.readouterr().out
    assert "shipped copy of MiniMaxAI/MiniMax-M3's config.json" in shown and "RECONSTRUCTED" not in shown
    real = plan_cli.plan(parse_config(realshape_config_dict(60, dense_layers=3)), ParallelConfig(tensor_parallel_size=8))
    assert result["weights_per_gpu_bytes"] == real.total_weight_bytes
    # index cache: one 128-wide bf16 key per token in each of the 57 sparse layers
    assert result["kv_bytes_per_token_per_gpu_by_cache"]["index"] == 57 * 128 * 2
    assert result["max_model_len"] == 1048576


def test_mxfp8_counts_its_stored_format(capsys):
    result = run("minimaxai/minimax-m3-mxfp8", "-tp", "4")
    assert "own formats: MXFP8" in result["quantization_note"]
    shown = capsys.readouterr().out
    assert "MiniMax-M3-MXFP8" in shown and "bf16 + online mxfp4 experts" in shown
    bf16 = run("MiniMaxAI/MiniMax-M3", "-tp", "4")
    # every linear 1 + 1/32 bytes per element instead of 2; embedding, lm_head, router, norms as they were
    assert 0.5 < result["weights_per_gpu_bytes"] / bf16["weights_per_gpu_bytes"] < 0.53


def test_flash_is_labelled_reconstructed_and_all_msa(capsys):
    result = run("MiniMaxAI/MiniMax-M3.1-Flash", "-tp", "8", "--json")
    assert "RECONSTRUCTED" in result["config_source"]
    assert result["kv_bytes_per_token_per_gpu_by_cache"]["index"] == 60 * 128 * 2     # MSA in every layer
    assert "NVFP4" in result["quantization_note"]
    assert (result["flavor"], result["index_cache_layers"]) == ("m3.1-flash", 60)
    capsys.readouterr()
    run("MiniMaxAI/MiniMax-M3.1-Flash", "-tp", "8")
    assert "index 15,360 in 60 of 60 layers" in capsys.readouterr().out


def test_unknown_hub_id_still_needs_the_network():
    with pytest.raises(ValueError, match="hub download failed"):
        run("someone/other-model")
