"""The dense single-file oracle (`model/reference.py`) against the serving model."""
import torch

from m3serve.model.loader import load_model
from m3serve.model.reference import ReferenceM3
from paged import PagedRunner
from refgreedy import canonical_weights, paged_against_reference


def test_reference_equals_serving_model(tiny_dir):
    """Prefill in two chunks, then decode 5 tokens one at a time: the same logits as one dense
    pass, and the same blocks chosen in every sparse layer."""
    model, cfg, _ = load_model(tiny_dir, dtype="float32", progress=False)
    ref = ReferenceM3(cfg, canonical_weights(tiny_dir))
    ids = torch.randint(0, 2000, (180,), generator=torch.Generator().manual_seed(5))
    ours, ref_sel = paged_against_reference(model, ref, ids)
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
