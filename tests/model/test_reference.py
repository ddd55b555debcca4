"""The dense single-file oracle (`model/reference.py`) against the serving model."""
import torch

from m3serve.model.loader import canonicalize, iter_checkpoint, load_model, materialize, weight_files
from m3serve.model.reference import ReferenceM3
from paged import PagedRunner


def canonical_weights(model_dir) -> dict:
    out = {}
    for _, key, t in iter_checkpoint(weight_files(model_dir)):
        for name, tensor in canonicalize(key, t) or []:
            out[name] = materialize(tensor).float()
    return out


def test_reference_equals_serving_model(tiny_dir):
    model, cfg, _ = load_model(tiny_dir, dtype="float32", progress=False)
    ref = ReferenceM3(cfg, canonical_weights(tiny_dir))
    ids = torch.randint(0, 2000, (180,), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_sel = ref.forward(ids)
    record = []
    runner = PagedRunner(model, seed=1)
    # prefill in two chunks, then decode 5 tokens one at a time: same logits as one dense pass
    logits = [runner.step({0: ids[:70].tolist()}, record), runner.step({0: ids[70:175].tolist()}, record)]
    for t in ids[175:].tolist():
        logits.append(runner.step({0: [t]}, record))
    logits = torch.cat(logits)
    assert (logits - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()
    n_sparse = len(ref_sel)
    ours = [torch.cat(record[i::n_sparse]) for i in range(n_sparse)]
    for a, b in zip(ours, ref_sel):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)


def test_batched_requests_do_not_interfere(tiny_dir):
    """Two sequences in one flattened batch give the same logits as each run alone."""
    model, _, _ = load_model(tiny_dir, dtype="float32", progress=False)
    a = torch.randint(0, 2000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    b = torch.randint(0, 2000, (130,), generator=torch.Generator().manual_seed(2)).tolist()
    alone_a = PagedRunner(model).step({0: a})
    alone_b = PagedRunner(model).step({1: b})
    both = PagedRunner(model).step({0: a, 1: b})
    assert torch.allclose(both[:90], alone_a, atol=1e-5)
    assert torch.allclose(both[90:], alone_b, atol=1e-5)
