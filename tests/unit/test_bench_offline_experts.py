"""`bench offline` on the tiny model (CPU): the roofline's distinct experts per MoE layer are
measured through the probe the bench installs (layers/probes.py), not assumed."""
import argparse

from m3serve.bench.offline import add_cli_args, main
from m3serve.layers import probes


def test_distinct_experts_are_measured(tiny_dir, capsys):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--points", "16:2", "--osl", "3",
                              "--dtype", "float32"])
    (row,) = main(args)
    from m3serve.model.config import load_config
    cfg = load_config(tiny_dir)
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    # batch 2 on CPU (no graphs): the last step decodes two tokens, whose choices cover k to 2k
    # distinct experts in every MoE layer, a whole number (the balanced-routing expectation an
    # unmeasured run falls back to is not one, and no report at all counts 0)
    k = cfg.num_experts_per_tok
    expected = cfg.num_local_experts * (1 - (1 - k / cfg.num_local_experts) ** 2)
    assert expected != int(expected)
    assert len(row["distinct_experts"]) == n_moe
    assert all(e == int(e) and k <= e <= 2 * k for e in row["distinct_experts"])
    assert probes.active is None          # the bench's probe is gone after the run
