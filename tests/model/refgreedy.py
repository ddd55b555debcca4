"""Test helper: the dense reference (`model/reference.py`) over a checkpoint's own tensors, and
its greedy continuation with a guard against near-ties."""
from __future__ import annotations

import torch

from m3serve.model.config import load_config
from m3serve.model.checkpoint import canonicalize, iter_checkpoint, materialize, weight_files
from m3serve.model.reference import ReferenceM3


def canonical_weights(model_dir) -> dict:
    """Every text tensor of the checkpoint in canonical names, as fp32."""
    out = {}
    for _, key, t in iter_checkpoint(weight_files(model_dir)):
        for name, tensor in canonicalize(key, t) or []:
            out[name] = materialize(tensor).float()
    return out


def paged_against_reference(model, ref: ReferenceM3, ids: torch.Tensor) -> tuple[list, list]:
    """Run ids [180] through the serving model paged (two prefill chunks, then five decode
    steps) and the reference in one dense pass; assert the logits agree. Returns (each sparse
    layer's block choices from the paged run, the reference's), in layer order."""
    from paged import PagedRunner

    from m3serve.layers import probes
    ref_logits, ref_sel = ref.forward(ids)
    runner = PagedRunner(model, seed=1)
    with probes.installed(probes.Recorder()) as rec:
        logits = [runner.step({0: ids[:70].tolist()}), runner.step({0: ids[70:175].tolist()})]
        for t in ids[175:].tolist():
            logits.append(runner.step({0: [t]}))
    record = rec.tensors(probes.SPARSE_BLOCKS)
    logits = torch.cat(logits)
    assert (logits - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()
    n_sparse = len(ref_sel)
    return [torch.cat(record[i::n_sparse]) for i in range(n_sparse)], ref_sel


def reference_model(model_dir) -> ReferenceM3:
    return ReferenceM3(load_config(model_dir), canonical_weights(model_dir))


def reference_greedy(ref: ReferenceM3, prompt: list[int], n: int, margin: float = 1e-3) -> list[int]:
    """The reference's greedy continuation of `prompt`; each chosen token leads its runner-up by
    `margin` (fp32 logits), so last-bit differences of a batched, paged engine cannot flip it."""
    ids = list(prompt)
    for _ in range(n):
        logits = ref.forward(torch.tensor(ids))[0][-1]
        top = logits.topk(2).values
        assert top[0] - top[1] >= margin, f"near-tie in the reference at length {len(ids)}"
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def engine_greedy_gaps(completion) -> list[float]:
    """Per token of an engine's greedy completion (a CompletionOutput that asked for logprobs
    >= 2): the chosen token's logprob minus the best other token's, i.e. its lead in logits."""
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    gaps = []
    for token, pos in zip(completion.token_ids, completion.logprobs):
        others = [v.logprob for k, v in pos.items() if k != token]
        assert others and pos[token].logprob >= max(others), pos          # greedy took the best
        gaps.append(pos[token].logprob - max(others))
    return gaps


def assert_engine_no_near_ties(outputs, margin: float) -> None:
    """Every greedy step of the engine's `outputs` (RequestOutputs of requests with logprobs >= 2)
    leads its runner-up by `margin`, so that comparing their tokens with another computation
    whose logits differ in the last bits (TP layouts, another process) can never flip on a tie,
    and a mismatch is a real difference; a prompt that has a near-tie is the test's mistake."""
    for i, out in enumerate(outputs):
        gaps = engine_greedy_gaps(out.outputs[0])
        assert min(gaps) >= margin, f"request {i} has a near-tie (gaps {gaps}) below {margin}: choose other prompts"


def greedy_after_shared_prefix(llm, a: list[int], b: list[int], chunk: int) -> list[list[int]]:
    """6 greedy tokens of prompt `a`, then of `b` (its first 64 tokens shared with `a`) on an
    engine that prefills `chunk` tokens a step: asserts that `b` hit 4 full blocks of 16, that
    the prefills were chunked and that every block is free again. Returns both token lists."""
    from m3serve.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": b}], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 64                    # 4 full blocks of 16 shared
    core = llm.engine.core
    assert core.num_steps > (len(a) + len(b) - 64) // chunk  # prefill was chunked
    core.kv_manager.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    return [first.outputs[0].token_ids, second.outputs[0].token_ids]
