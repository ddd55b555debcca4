"""Images and video with speculative decoding on the tiny vision checkpoint (fp32).

Greedy outputs equal speculation off with EAGLE3, MTP and DSpark, through prefill chunks that cut
image spans. Losslessness cannot see what the draft was fed, so the drafts' inputs are checked
directly: EAGLE3 and MTP must embed, at row t, the vision encoder's output for position t + 1
when that is a placeholder (also across a chunk boundary: the chunk's last row looks one position
ahead) and the token embedding elsewhere, every prompt position exactly once; DSpark's context
(the target's taps) must not depend on how the prompt was chunked and must carry the image. The
scheduler's encoder plan counts that look-ahead against `--max-num-encoder-input-tokens`.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from m3serve.llm import LLM
from m3serve.multimodal.inputs import media_token_ids, process_multi_modal_data
from m3serve.multimodal.processor import ProcessorOptions
from m3serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# chunks of at most 7 tokens cut every span; the encoder budget lets a chunk's look-ahead start
# an image (20 = the largest item)
CHUNKED = dict(dtype="float32", max_num_batched_tokens=7, max_num_encoder_input_tokens=20)


def image(width, height, seed):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def video(num_frames, seed):
    return np.random.default_rng(seed).integers(0, 256, (num_frames, 56, 84, 3), dtype=np.uint8)


CASES = [
    ("look ]<]image[>[ and tell me", {"image": image(150, 100, 1)}),                        # 20 placeholders
    ("first ]<]image[>[ then ]<]image[>[ compare", {"image": [image(60, 90, 2), image(130, 70, 3)]}),  # 6, 10
    ("watch ]<]video[>[ now", {"video": video(5, 4)}),                                      # 3 x 6, timestamps between
]


def _spec(kind, vision_drafts) -> dict:
    if kind == "dspark":                               # the target copy's own dspark/ folder
        return {"method": "dspark", "num_speculative_tokens": 3}
    # MTP's MoE layer is the slow part on a CPU: two modules, one step each
    return {"method": kind, "model": str(vision_drafts[kind]), "num_speculative_tokens": 2 if kind == "mtp" else 3}


def _target(kind, vision_drafts, tiny_vision_dir):
    return vision_drafts["dspark"] if kind == "dspark" else tiny_vision_dir


def _prompts(cases=CASES):
    return [{"prompt": p, "multi_modal_data": d} for p, d in cases]


def _check_clean(llm):
    core = llm.engine.core
    llm.engine.engine_states()                         # a step that tells the worker who finished
    assert llm.engine.worker.runner.media == {}
    assert not core.scheduler.has_unfinished_requests()
    core.scheduler.check_integrity()
    core.kv_manager.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    draft = core.kv_manager.draft                      # DSpark's window pool
    assert draft is None or draft.num_free_blocks == draft.pool.num_usable_blocks


def _capture_draft_inputs(llm, dspark: bool) -> list:
    """Record, for every draft first pass, per request: (prompt ids, positions [n], the draft's
    input rows [n, ...]) -- EAGLE3 / MTP: the embeddings `prepare` gets; DSpark: the taps."""
    runner = llm.engine.worker.runner
    drafter, step_fn = runner.proposer.drafter, runner._speculative_step
    seen, state = [], {}

    def speculative_step(so, batch, dp):
        b = runner.batch
        state["prompts"] = [tuple(b.token_ids[row, :int(b.num_prompt_tokens[row])].tolist())
                            for row in batch.rows.tolist()]
        return step_fn(so, batch, dp)

    def record(rows, positions, meta):
        qsl = meta.query_start_loc_cpu
        for i, prompt in enumerate(state["prompts"]):
            seen.append((prompt, positions[qsl[i]:qsl[i + 1]].tolist(), rows[qsl[i]:qsl[i + 1]].clone()))

    if dspark:
        first = drafter.first

        def first_(next_ids, hidden, positions, meta, last_index, next_media=None, context_rows=None):
            record(hidden, positions, meta)
            return first(next_ids, hidden, positions, meta, last_index, next_media, context_rows)
        drafter.first = first_
    else:
        prepare = drafter.prepare

        def prepare_(embeds, hidden, positions, meta, last_index):
            record(embeds, positions, meta)
            return prepare(embeds, hidden, positions, meta, last_index)
        drafter.prepare = prepare_
    runner._speculative_step = speculative_step
    return seen


def _encoder_rows(llm, prompt_ids, data) -> dict[int, torch.Tensor]:
    """prompt position -> the vision encoder's output row for it, computed here from the
    preprocessed pixels (the k-th item of a modality fills that modality's next placeholders)."""
    ids = np.asarray(prompt_ids)
    tokens = media_token_ids(llm.get_tokenizer().token_to_id)
    items = process_multi_modal_data(data, ProcessorOptions(), {"image": 99, "video": 99})
    encoder, out = llm.engine.worker.runner.vision, {}
    for modality in ("image", "video"):
        positions = np.flatnonzero(ids == tokens[modality])
        k = 0
        for item in (x for x in items if x.modality == modality):
            with torch.inference_mode():
                feats = encoder(item.pixel_values, [tuple(g) for g in item.grids])        # [n, H]
            for r, pos in enumerate(positions[k:k + item.num_tokens]):
                out[int(pos)] = feats[r]
            k += item.num_tokens
        assert k == len(positions)
    return out


def _check_next_embeddings(llm, seen, outputs, cases=CASES) -> int:
    """Every prompt position p >= 1 was embedded exactly once, at row p - 1: the encoder's row
    where p is a placeholder, the token's embedding elsewhere. -> how many chunks ended right
    before a placeholder (their last row's input came from the look-ahead)."""
    embed = llm.engine.worker.runner.model.model.embed_tokens
    lookahead = 0
    for out, (_, data) in zip(outputs, cases):
        prompt = tuple(out.prompt_token_ids)
        features = _encoder_rows(llm, prompt, data)
        covered = []
        for seen_prompt, positions, rows in seen:
            if seen_prompt != prompt:
                continue
            for j, pos in enumerate(positions):
                nxt = pos + 1
                if nxt >= len(prompt):             # the sampled token, or drafts: not the prompt's
                    continue
                want = features.get(nxt)
                if want is None:
                    with torch.inference_mode():
                        want = embed(torch.tensor([prompt[nxt]]))[0]
                elif j == len(positions) - 1:
                    lookahead += 1
                torch.testing.assert_close(rows[j], want, atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"position {nxt} of {prompt}: {m}")
                covered.append(nxt)
        assert sorted(covered) == list(range(1, len(prompt)))
    return lookahead


@pytest.fixture(scope="module")
def reference(tiny_vision_dir):
    llm = LLM(str(tiny_vision_dir), **CHUNKED)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "dspark"])
def test_greedy_lossless_with_media(tiny_vision_dir, vision_drafts, reference, kind):
    """Chunked prefill through every span, drafts on: the tokens speculation off gives; the
    draft's inputs at placeholder positions checked as the module docstring says."""
    llm = LLM(str(_target(kind, vision_drafts, tiny_vision_dir)), speculative_config=_spec(kind, vision_drafts),
              **CHUNKED)
    seen = _capture_draft_inputs(llm, dspark=kind == "dspark")
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == reference[0]
    assert [o.outputs[0].token_ids for o in outs] == reference[1]
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0
    if kind != "dspark":
        assert _check_next_embeddings(llm, seen, outs) > 0
    else:
        _check_dspark_context(vision_drafts, seen, outs)
    _check_clean(llm)


def _check_dspark_context(vision_drafts, chunked_seen, chunked_outs):
    """The taps DSpark's context is projected from: at every prompt position the same with
    chunks of 7 as with the whole prompt in one step; and another image changes them at the
    image's positions (and not before it)."""
    llm = LLM(str(vision_drafts["dspark"]), speculative_config=_spec("dspark", vision_drafts), dtype="float32",
              enable_prefix_caching=False)
    seen = _capture_draft_inputs(llm, dspark=True)
    prompt, data = CASES[0]
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image(150, 100, 99)}},
                         GREEDY, use_tqdm=False)[0]
    seen_other = list(seen)
    seen.clear()
    whole = llm.generate(_prompts(CASES[:1]), GREEDY, use_tqdm=False)[0]
    ids = tuple(whole.prompt_token_ids)
    assert ids == tuple(chunked_outs[0].prompt_token_ids) == tuple(other.prompt_token_ids)

    def taps(captured):
        by_pos = {}
        for p, positions, rows in captured:
            if p == ids:
                by_pos.update((pos, rows[j]) for j, pos in enumerate(positions) if pos < len(ids))
        return torch.stack([by_pos[pos] for pos in range(len(ids))])           # [P, n x H]
    mine, theirs = taps(seen), taps(seen_other)
    torch.testing.assert_close(taps(chunked_seen), mine, atol=1e-4, rtol=1e-4)
    placeholders = np.flatnonzero(np.asarray(ids) == media_token_ids(llm.get_tokenizer().token_to_id)["image"])
    first = int(placeholders[0])
    torch.testing.assert_close(theirs[:first], mine[:first])
    assert ((theirs[placeholders] - mine[placeholders]).abs().amax(dim=-1) > 1e-3).all()
    _check_clean(llm)


def test_encoder_plan_counts_the_drafts_lookahead():
    """With drafts a chunk [start, end) also needs position end: an item starting there is
    encoded in this step when the budget takes it, else the chunk stops one token short."""
    from m3serve.config import SchedulerConfig
    from m3serve.core.kv_cache.manager import KVCacheManager
    from m3serve.core.request import Request
    from m3serve.core.scheduler import Scheduler

    def plan(k, start, num_new, budget_left, budget=16):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_encoder_input_tokens=budget),
                          KVCacheManager(64, 16, enable_caching=False), 256, num_speculative_tokens=k)
        items = [SimpleNamespace(num_tokens=6), SimpleNamespace(num_tokens=10)]
        request = Request("r", list(range(27)), SamplingParams(max_tokens=4), None, mm_inputs=items,
                          mm_spans=[(4, 10, "a"), (14, 24, "b")])
        request.mm_keys = ["a", "b"]                     # neither in the encoder cache
        return sched._encoder_plan(request, start, num_new, budget_left)

    assert plan(0, 0, 14, 16) == (14, [0])            # no draft: the chunk ends before b
    assert plan(3, 0, 14, 16) == (14, [0, 1])         # its look-ahead reaches b: both
    assert plan(3, 0, 14, 10) == (13, [0])            # b does not fit: one token short
    assert plan(3, 10, 4, 10) == (4, [1])             # b alone fits the step's whole budget
    assert plan(3, 10, 4, 6) == (3, [])               # b waits: the chunk stops at 13
    assert plan(3, 13, 1, 6) == (0, [])               # ... and the next chunk for the budget
    assert plan(3, 0, 13, 16) == (13, [0])            # a chunk ending at 13 looks at 13: text


def test_lookahead_encodes_within_the_budget(tiny_vision_dir, vision_drafts, reference):
    """Two images (6 and 10 placeholders at 4 and 14), chunks of 14: with an encoder budget of
    16 the first step encodes both (its last row embeds the second's first row); with 10 it
    stops at 13 and the second image is encoded alone in the next step. Same tokens."""
    def run(budget):
        llm = LLM(str(tiny_vision_dir), speculative_config=_spec("eagle3", vision_drafts), dtype="float32",
                  max_num_batched_tokens=14, max_num_encoder_input_tokens=budget)
        runner, steps = llm.engine.worker.runner, []
        encoder = runner.vision
        runner.vision = lambda pixels, grids: steps.append(
            (llm.engine.core.num_steps, sum(t * h * w // 4 for t, h, w in grids))) or encoder(pixels, grids)
        seen = _capture_draft_inputs(llm, dspark=False)
        out = llm.generate(_prompts(CASES[1:2]), GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == reference[1][1]
        runner.vision = encoder
        assert _check_next_embeddings(llm, seen, out, CASES[1:2]) == (1 if budget == 16 else 0)
        first_chunk = seen[0][1]
        _check_clean(llm)
        return steps, first_chunk
    steps, chunk = run(16)
    assert [n for _, n in steps] == [6, 10] and steps[0][0] == steps[1][0] and chunk == list(range(14))
    steps, chunk = run(10)
    assert [n for _, n in steps] == [6, 10] and steps[1][0] == steps[0][0] + 1 and chunk == list(range(13))
