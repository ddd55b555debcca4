"""The cross-layer top-k reuse measurement (`python -m m3serve.bench.index_reuse`): F = 1 is the
exact model (zero KL, full agreement); the selection overlap counts exactly what it says on
hand-made selections; on the tiny model F = 2 moves the outputs."""
import dataclasses

import torch

from m3serve.bench.index_reuse import main, selection_overlap
from m3serve.model.config import parse_config
from m3serve.model.tiny import tiny_config_dict


def test_selection_overlap_by_hand():
    cfg = parse_config(tiny_config_dict())               # sparse layers 1, 2, 3; top-4 of 16-token blocks
    first = cfg.index_topk_blocks * cfg.index_block_size
    rows = first + 2
    sel = {layer: torch.full((rows, 2, 4), -1, dtype=torch.int32) for layer in (1, 2, 3)}
    sel[1][first:] = torch.tensor([[4, 0, 1, 2], [4, 0, 1, 2]], dtype=torch.int32)
    sel[2][first:] = torch.tensor([[4, 0, 1, 3], [4, 3, 2, 1]], dtype=torch.int32)   # 3 of 4, 3 of 4
    sel[3][first:] = torch.tensor([[4, 3, 5, 6], [4, 0, 1, 2]], dtype=torch.int32)   # vs layer 1: 1/4, 4/4
    sel[2][:first] = 7                                   # rows before top-k x block are not counted
    assert selection_overlap(cfg, sel, 2, 0) == 0.75     # layer 2 reuses layer 1; layer 3 indexes
    assert selection_overlap(cfg, sel, 4, 0) == (0.75 + 0.625) / 2
    assert selection_overlap(cfg, sel, 2, 5) is None     # offset 5: every layer indexes
    assert dataclasses.replace(cfg).index_topk_freq == 1


def test_measurement_on_the_tiny_model(tiny_dir, capsys):
    result = main([str(tiny_dir), "--freqs", "1", "2", "--prompt-len", "90", "--gen-len", "3",
                   "--num-prompts", "1", "--chunk", "64", "--dtype", "float32", "--device", "cpu"])
    exact, reuse = result["results"]
    assert exact["mean_kl_nats"] == 0.0 and exact["greedy_agreement"] == 1.0
    assert exact["teacher_forced_top1_agreement"] == 1.0 and exact["selection_overlap"] is None
    assert reuse["indexer_layers"] == 2 and reuse["mean_kl_nats"] > 1e-3
    assert 0.0 < reuse["selection_overlap"] < 1.0
    assert '"results"' in capsys.readouterr().out
