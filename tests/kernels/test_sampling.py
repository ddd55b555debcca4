"""The radix top-k / top-p cut-offs on a GPU at the real vocabulary: each meets the definition,
equals the sort-based PyTorch twin (top-k exactly; top-p wherever the row is not within fp32
rounding of its target, since the GPU's exp may differ from torch's in the last bit), and the
CUDA sampler never draws outside the nucleus."""
import pytest
import torch

from sampling_cases import check_top_k, check_top_p, hard_rows

pytestmark = pytest.mark.gpu
V = 200064


def _batches():
    yield hard_rows(V, "cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    for R in (1, 8, 64):
        logits = torch.randn(R, V, device="cuda", generator=g) * 2
        logits[:, :20] += 8 + 4 * torch.rand(R, 20, device="cuda", generator=g)
        p = torch.rand(R, device="cuda", generator=g).clamp(0.05, 0.999)
        k = torch.randint(1, 2000, (R,), device="cuda", generator=g)
        yield logits, p, k


def test_top_p_cut_off_on_gpu():
    from m3serve.kernels.ref.sampling import top_p_threshold_ref
    from m3serve.kernels.sampling import top_p_threshold
    rows = same = 0
    for logits, p, _ in _batches():
        tau, ref = top_p_threshold(logits, p), top_p_threshold_ref(logits, p)
        check_top_p(logits, p, tau)
        check_top_p(logits, p, ref)
        rows += len(tau)
        same += int((tau == ref).sum())
        assert torch.equal(tau, top_p_threshold(logits, p))          # the same on every run
    assert same >= rows - 1, f"{same} of {rows} rows equal the reference"


def test_top_k_cut_off_on_gpu():
    from m3serve.kernels.ref.sampling import top_k_threshold_ref
    from m3serve.kernels.sampling import top_k_threshold
    for logits, _, k in _batches():
        tau = top_k_threshold(logits, k)
        check_top_k(logits, k, tau)
        assert torch.equal(tau, top_k_threshold_ref(logits, k, int(k.max())))


def test_cuda_sampler_stays_in_the_nucleus():
    from m3serve.layers.dispatch import executed
    from m3serve.sampling_params import SamplingParams
    from m3serve.worker.sampler import Sampler, SamplingMetadata
    R = 2000
    logits = torch.full((R, V), -30.0, device="cuda")
    logits[:, [5, 900, 70000, 200063]] = torch.tensor([0.40, 0.25, 0.20, 0.15], device="cuda").log()
    cases = [(dict(top_p=0.6), {5, 900}), (dict(top_p=0.7), {5, 900, 70000}),
             (dict(top_k=3, top_p=0.99), {5, 900, 70000}), (dict(top_k=1), {5})]
    for kwargs, support in cases:
        params = [SamplingParams(temperature=1.0, **kwargs)] * R
        meta = SamplingMetadata.from_params(params, [[]] * R, [[]] * R, [None] * R, V, "cuda")
        before = executed[("top_k_top_p", "triton")]
        tokens = Sampler(torch.Generator(device="cuda").manual_seed(0))(logits, meta).sampled_token_ids
        assert executed[("top_k_top_p", "triton")] == before + 1
        drawn = set(tokens.unique().tolist())
        assert drawn == support, (kwargs, drawn)
