"""The CPU tier with speculative decoding. EAGLE3's and MTP's caches share the block ids, so they
are copied out and back with the target's: a second turn whose first turn was evicted to the
tier proposes at every position the first draft it proposes when the first turn's blocks stayed
in the GPU pool (the draft that reads the restored prefix's draft KV); a prefix restored without
its draft KV would stay lossless but propose other drafts (acceptance would collapse), which a
corrupted host copy of the draft caches shows. DSpark's window pool is not carried: a GPU hit
finds the draft blocks of the hit's last window, a restored prefix is a hole its queries never
read (garbage in the null block, where holes point, changes no draft)."""
import pytest
import torch

from m3serve.core.kv_cache.specs import window_pool_blocks
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams

DRAFT_BYTES = {"mtp": 1280, "eagle3": 1024, "dspark": 1024}  # draft cache bytes per token (fp32 tiny drafts)
DRAFT_GROUPS = {"mtp": ("mtp", "mtp_index"), "eagle3": ("draft",)}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def ids(n, seed):
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _second_turn(tiny_dir, drafts, kind, num_blocks: int, tier: bool, corrupt: bool = False,
                 caching: bool = True, garbage: bool = False):
    """Turn 1 of a session, two other prompts, then turn 2: its tokens and the first draft
    proposed at each of its positions. (Only the first: the later draft steps also read KV
    slots no step has written yet, so they vary with what earlier requests left in the pages,
    with or without a tier.) DSpark's window pool comes on top of `num_blocks` target blocks;
    `garbage` fills its null block with large values before turn 2."""
    per_token = 2944 + (0 if kind == "dspark" else DRAFT_BYTES[kind])
    draft_pool = 0
    if kind == "dspark":          # a 32-token window, 2 drafts, 16-token blocks, 4 requests
        draft_pool = window_pool_blocks(32, 2, 16, 4, 4096) * 16 * DRAFT_BYTES["dspark"]
    flags = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096,
                 kv_cache_memory=num_blocks * 16 * per_token + draft_pool, enable_prefix_caching=caching,
                 speculative_config={"method": kind, "model": str(drafts[kind]), "num_speculative_tokens": 2})
    if kind == "dspark":                           # the draft lives in the target's dspark/ folder
        flags["speculative_config"] = {"method": "dspark", "num_speculative_tokens": 2}
    if tier:
        flags["kv_offloading_size"] = 64 * 16 * per_token / (1 << 30)
    llm = LLM(str(drafts["dspark"] if kind == "dspark" else tiny_dir), **flags)
    core = llm.engine.core
    assert core.kv_manager.num_blocks == num_blocks      # the draft's window pool costs no target block
    first = ids(70, 31)
    turn1 = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for p in (ids(80, 32), ids(70, 33)):          # one at a time: the same steps in every run
        llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
    if corrupt:
        offload = llm.engine.worker.cpu_tier
        for i, group in enumerate(offload.groups):
            if group in DRAFT_GROUPS[kind]:
                offload.host_planes[i].view(torch.float32).mul_(-1)
    if garbage:
        for cache in llm.engine.worker.proposer.drafter.draft.kv_caches:
            cache[:, 0] = 1e4
    proposed = {}
    usable = core.scheduler._usable_drafts

    def log_drafts(request, drafts_):
        out = usable(request, drafts_)
        proposed[request.num_tokens] = out[0] if out else None
        return out
    core.scheduler._usable_drafts = log_drafts
    second = first + turn1 + ids(12, 34)
    out = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    while core.has_unfinished_requests():
        core.step()
    core.scheduler.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    return out.outputs[0].token_ids, proposed, out.num_cached_tokens, core.scheduler


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_drafts_after_a_restore_equal_drafts_after_a_gpu_hit(tiny_dir, drafts, kind):
    want, want_drafts, hit, sched = _second_turn(tiny_dir, drafts, kind, num_blocks=64, tier=False)
    assert hit == 64 and sched.num_kv_loads == 0            # turn 1 stayed in the GPU pool
    got, got_drafts, hit, sched = _second_turn(tiny_dir, drafts, kind, num_blocks=10, tier=True)
    assert hit == 64 and sched.num_kv_loads == 1            # ... here it came back from the tier
    assert got == want
    assert got_drafts == want_drafts and len(want_drafts) > 2
    if kind == "mtp":
        got, got_drafts, _, _ = _second_turn(tiny_dir, drafts, kind, num_blocks=10, tier=True, corrupt=True)
        assert got == want                     # still lossless ...
        assert got_drafts != want_drafts       # ... but other drafts: the draft KV is restored


def test_dspark_window_after_a_gpu_hit_and_a_restore(tiny_dir, drafts):
    want, want_drafts, hit, sched = _second_turn(tiny_dir, drafts, "dspark", num_blocks=64, tier=False)
    assert hit == 64 and sched.num_kv_loads == 0
    assert sched.kv_manager.draft.num_hit_blocks > 0              # the hit's last window was still cached
    got, got_drafts, hit, _ = _second_turn(tiny_dir, drafts, "dspark", num_blocks=64, tier=False, caching=False)
    assert hit == 0 and got == want
    assert got_drafts == want_drafts and len(want_drafts) > 2     # as if the prefix were computed here
    restored, restored_drafts, hit, sched = _second_turn(tiny_dir, drafts, "dspark", num_blocks=10, tier=True)
    assert hit == 64 and sched.num_kv_loads == 1 and sched.kv_manager.draft.num_hit_blocks == 0
    assert restored == want                                       # lossless without the draft's KV
    got, got_drafts, _, _ = _second_turn(tiny_dir, drafts, "dspark", num_blocks=10, tier=True, garbage=True)
    assert got == want and got_drafts == restored_drafts          # the hole is never read
