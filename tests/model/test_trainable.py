"""The training forward (`model/trainable.py`) means what the served weights mean: its logits equal
the dense reference's on the same weights, sparse selection and MoE routing included; and a
training run is a function of its seed."""
import os
import subprocess
import sys

import torch

from m3serve.model.config import load_config
from m3serve.model.reference import ReferenceM3, gemma_rms_norm
from m3serve.model.trainable import TrainableM3
from refgreedy import canonical_weights


def test_training_forward_equals_the_reference(tiny_dir):
    cfg = load_config(tiny_dir)
    weights = canonical_weights(tiny_dir)
    model = TrainableM3(cfg, weights)
    # 112 tokens: 7 blocks of 16, more than the 4 an MSA query may select
    ids = torch.randint(0, cfg.vocab_size, (2, 112), generator=torch.Generator().manual_seed(3))
    out = model(ids, taps=(1, cfg.num_hidden_layers))
    ref = ReferenceM3(cfg, weights)
    for b in range(2):
        want, selections = ref.forward(ids[b])
        assert (out.logits[b] - want).abs().max() <= 1e-4 * want.abs().max()
        assert all((s >= 0).sum(-1).max() == cfg.index_topk_blocks for s in selections)   # sparse for real
    assert out.streams.shape == (2, 112, 2 * cfg.hidden_size)
    final_input = out.streams[..., cfg.hidden_size:]           # tap L: the final norm's input
    assert torch.allclose(gemma_rms_norm(final_input, weights["model.norm.weight"], cfg.rms_norm_eps), out.hidden)
    assert out.stats.index_loss > 0
    assert set(out.stats.expert_load) == {f"model.layers.{i}.block_sparse_moe." for i in range(5) if cfg.is_moe(i)}
    for load in out.stats.expert_load.values():
        assert load.sum() == 2 * 112 * cfg.num_experts_per_tok


def test_the_index_loss_trains_the_indexer_alone(tiny_dir):
    cfg = load_config(tiny_dir)
    model = TrainableM3(cfg, canonical_weights(tiny_dir))
    ids = torch.randint(0, cfg.vocab_size, (1, 96), generator=torch.Generator().manual_seed(4))
    model(ids).stats.index_loss.backward()
    with_grad = {n for n in model.w.names if model.w[n].grad is not None and model.w[n].grad.abs().sum() > 0}
    assert with_grad and all(".self_attn.index_" in n for n in with_grad), sorted(with_grad)


_TRAIN = """
import hashlib, sys, torch
torch.set_num_threads(2)
from m3serve.model.config import parse_config
from m3serve.model.train_tiny import TrainSettings, WindowSampler, train_target, trained_config_dict
cfg = parse_config(trained_config_dict())
seed = int(sys.argv[1])
stream = torch.randint(0, cfg.vocab_size, (20000,), generator=torch.Generator().manual_seed(9))
s = TrainSettings(seed=seed, steps=3, batch_size=4, seq_len=128, warmup_steps=1, log_every=1)
model, report = train_target(cfg, WindowSampler(stream[:15000], stream[15000:], 129, 0.5, seed), s)
digest = hashlib.sha256()
for t in model.w.export(torch.float32).values():
    digest.update(t.numpy().tobytes())
print(digest.hexdigest(), [p["step"] for p in report["curve"]])
"""


def _train(seed: int) -> str:
    """Three steps of the shipped model's training in a process of its own, on two threads
    (some CPU kernels' sums vary between processes, not within one) -> digest of the weights."""
    run = subprocess.run([sys.executable, "-c", _TRAIN, str(seed)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    return run.stdout.strip()


def test_training_is_a_function_of_its_seed():
    a, b, c = _train(1), _train(1), _train(2)
    assert a == b and a.endswith("[1, 2, 3]")
    assert c.split()[0] != a.split()[0]
