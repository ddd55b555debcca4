"""CPU interpreter tests of the radix top-k / top-p cut-off kernels: each equals its PyTorch twin
and the definition, on rows with ties, -inf masks, one dominant token, p = 1 and underflow."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.ref.sampling import top_k_threshold_ref, top_p_threshold_ref  # noqa: E402
from m3serve.kernels.sampling import top_k_threshold, top_p_threshold  # noqa: E402
from sampling_cases import check_top_k, check_top_p, hard_rows  # noqa: E402

V = 9000  # three histogram programs per row, the last one part-masked


def test_top_p_cut_off_equals_reference_and_definition():
    logits, p, _ = hard_rows(V)
    tau = top_p_threshold(logits, p)
    ref = top_p_threshold_ref(logits, p)
    check_top_p(logits, p, ref)
    check_top_p(logits, p, tau)
    assert torch.equal(tau, ref)


def test_top_k_cut_off_equals_reference_and_definition():
    logits, _, k = hard_rows(V)
    tau = top_k_threshold(logits, k)
    check_top_k(logits, k, tau)
    assert torch.equal(tau, top_k_threshold_ref(logits, k, int(k.max())))


def test_cut_off_rejects_other_layouts():
    logits, p, _ = hard_rows(64)
    with pytest.raises(ValueError, match="fp32 logits"):
        top_p_threshold(logits.half(), p)
    with pytest.raises(ValueError, match="unit column stride"):
        top_p_threshold(logits.t().contiguous().t(), p)
    assert top_p_threshold(logits[:0], p[:0]).shape == (0,)
