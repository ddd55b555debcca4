"""Pixels released once encoded, and the encoder-output cache (`--mm-encoder-cache-gb`), on the
tiny vision checkpoint (fp32): no pixel bytes or tensors stay referenced once a request holds
its image's output; a returning image whose prefix left the KV cache is not encoded again and
answers as a fresh encode; the byte bound holds with LRU eviction; 0 keeps nothing past the
requests; a preempted request recomputes from the outputs it holds, with the same tokens. Every
engine test ends with the scheduler's integrity check (encoder-cache book included)."""
import gc
import sys

import pytest
import torch

from m3serve.core.encoder_cache import EncoderCacheBook
from m3serve.llm import LLM
from m3serve.multimodal.inputs import process_multi_modal_data
from m3serve.multimodal.processor import ProcessorOptions
from m3serve.sampling_params import SamplingParams
from test_mm_engine import assert_all_blocks_free, image

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompt(*seeds, text=None, size=(150, 100)):
    text = text or " and ".join(["]<]image[>["] * len(seeds)) + " compare them"
    return {"prompt": text, "multi_modal_data": {"image": [image(*size, s) for s in seeds]}}


def count_encodes(llm) -> list:
    """Every image or video `llm`'s rank encodes from now on (one entry each, whether a step
    encodes it alone or in one forward with others)."""
    store, calls = llm.engine.worker.runner.encoder_outputs, []
    put = store.put
    store.put = lambda key, features: calls.append(key) or put(key, features)
    return calls


def tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def book(llm) -> EncoderCacheBook:
    return llm.engine.core.scheduler.encoder_cache


@pytest.fixture(scope="module")
def fresh(tiny_vision_dir):
    """Every image encoded afresh: no cache, no prefix hits (the reference answers)."""
    return LLM(model=str(tiny_vision_dir), dtype="float32", mm_encoder_cache_gb=0, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached(tiny_vision_dir):
    return LLM(model=str(tiny_vision_dir), dtype="float32")


# ------------------------------------------------------------------ the book alone

def test_book_lru_within_the_byte_bound():
    b = EncoderCacheBook(capacity_bytes=250, bytes_per_token=10)     # two 10-token outputs fit
    assert not b.use("A", "r1", 10) and not b.use("B", "r2", 10)
    b.release("r1", ["A"])
    b.release("r2", ["B"])
    assert b.num_bytes == 200 and b.take_freed() == []
    assert b.use("A", "r3", 10)                      # a hit: A is now the most recently used
    b.release("r3", ["A"])
    assert not b.use("C", "r4", 10)                  # B, the least recently used, makes room
    assert b.take_freed() == ["B"] and "A" in b and b.num_bytes == 200
    assert not b.use("D", "r5", 10) and not b.use("E", "r6", 10)
    # held outputs are never evicted, even past the bound: only A (nobody holds it) went
    assert b.take_freed() == ["A"] and b.num_bytes == 300 > b.capacity_bytes
    assert b.check_integrity({"r4": {"C"}, "r5": {"D"}, "r6": {"E"}}) == []
    for rid, key in (("r4", "C"), ("r5", "D"), ("r6", "E")):
        b.release(rid, [key])
    assert b.take_freed() == ["C"] and b.num_bytes == 200          # back within the bound
    assert (b.stats.queries, b.stats.hits, b.stats.evictions) == (6, 1, 3)
    assert b.check_integrity({}) == []
    assert not b.use("F", "r7", 10)                  # after a failed step: all but the held go
    b.drop_unheld()
    assert sorted(b.take_freed()) == ["D", "E"] and len(b) == 1 and b.num_bytes == 100
    b.release("r7", ["F"])
    assert b.check_integrity({"r9": {"D"}})          # a holder the book does not know of
    with pytest.raises(RuntimeError, match="does not hold"):
        b.release("r9", ["D"])


def test_book_zero_keeps_only_what_is_held():
    b = EncoderCacheBook(0, 10)
    assert not b.use("A", "r1", 3) and b.use("A", "r2", 3)          # running requests share
    b.release("r1", ["A"])
    assert b.take_freed() == [] and b.num_bytes == 30
    b.release("r2", ["A"])
    assert b.take_freed() == ["A"] and b.num_bytes == 0 and len(b) == 0


# ------------------------------------------------------------------ pixels

def test_pixels_released_once_encoded(cached):
    """Once the step that encodes the image has run, nothing but this test refers to the
    pixel bytes the request arrived with (the request, the scheduler output, the worker's
    media state all let go), no [num_patches, 1176] tensor is alive, and the request still
    runs (it holds the output instead)."""
    engine, core = cached.engine, cached.engine.core
    engine.add_request("pixels", prompt(40), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    request = core.scheduler.requests["pixels"]
    item = request.mm_inputs[0]
    pixels, shape = item.pixel_values, (item.num_patches, 1176)
    assert len(pixels) == item.num_patches * 1176 * 4 > 0
    del item
    assert sys.getrefcount(pixels) > 2               # held by the request: the check can fail
    engine.step()                                    # the prompt fits one step: it encodes
    engine.step()                                    # (the deferred step's output is dropped)
    assert not request.is_finished and request.mm_held == {0}
    assert request.mm_inputs[0].pixel_values == b""
    assert engine.worker.runner.media["pixels"].pixels == [None]
    gc.collect()
    assert sys.getrefcount(pixels) == 2, gc.get_referrers(pixels)
    assert not [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and tuple(t.shape) == shape]
    while engine.has_unfinished_requests():
        engine.step()
    cached.engine.engine_states()
    assert "pixels" not in engine.worker.runner.media
    assert_all_blocks_free(cached)


# ------------------------------------------------------------------ hits

def test_returning_image_hits_after_prefix_eviction(cached, fresh):
    """The same two images again, once the prefix cache has lost them, and then in the other
    order: the encoder does not run, and the answers equal fresh encodes'."""
    first, swapped = prompt(41, 42), prompt(42, 41)
    want = tokens(fresh, [first, swapped])
    calls, stats = count_encodes(cached), book(cached).stats
    queries, hits = stats.queries, stats.hits
    assert tokens(cached, [first]) == want[:1] and len(calls) == 2
    assert cached.engine.core.kv_manager.reset_prefix_cache()
    out = cached.generate([first], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0                # nothing came from the prefix cache
    assert out.outputs[0].token_ids == want[0]
    assert tokens(cached, [swapped]) == want[1:]
    assert len(calls) == 2                           # neither the return nor the swap encoded
    assert (stats.queries - queries, stats.hits - hits) == (6, 4)
    assert_all_blocks_free(cached)


def test_one_encode_per_image_within_a_step_and_a_prompt(cached, fresh):
    """Two requests with the same image admitted in one step, and one prompt with an image
    twice: each image is encoded once, the answers are fresh encodes'."""
    batch = [prompt(43), prompt(43, text="the same ]<]image[>[ again"), prompt(44, 44)]
    want = tokens(fresh, batch)
    calls = count_encodes(cached)
    assert tokens(cached, batch) == want
    assert len(calls) == 2
    assert_all_blocks_free(cached)


def test_a_steps_images_go_through_one_encoder_forward(cached, fresh):
    """Three requests admitted together, four distinct images of three sizes: one encoder
    forward for the step (grids of all four), the answers equal to encodes one by one."""
    batch = [prompt(61), prompt(62, 63, size=(90, 60)), prompt(64, size=(60, 130))]
    want = tokens(fresh, batch)
    runner = cached.engine.worker.runner
    encoder, forwards = runner.vision, []
    runner.vision = lambda pixels, grids: forwards.append(len(grids)) or encoder(pixels, grids)
    try:
        assert tokens(cached, batch) == want
    finally:
        runner.vision = encoder
    assert forwards == [4]
    assert_all_blocks_free(cached)


# ------------------------------------------------------------------ the bound

def test_byte_bound_evicts_least_recently_used(tiny_vision_dir, fresh):
    """Room for two outputs (no prefix cache, so every request needs its images): A, B, C
    evicts A; B hits (now the most recent); A evicts C; C evicts B. The bytes held, on the
    book and on the rank, never pass the bound between requests."""
    [item] = process_multi_modal_data(prompt(50)["multi_modal_data"], ProcessorOptions(), {"image": 1})
    one = item.num_tokens * book(fresh).bytes_per_token          # one image's output, in bytes
    llm = LLM(model=str(tiny_vision_dir), dtype="float32", enable_prefix_caching=False,
              mm_encoder_cache_gb=2.5 * one / (1 << 30))
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = dict(zip((50, 51, 52), tokens(fresh, [prompt(50), prompt(51), prompt(52)], short)))
    calls, b, store = count_encodes(llm), book(llm), llm.engine.worker.runner.encoder_outputs
    encodes, held = [], []
    for seed in (50, 51, 52, 51, 50, 52):
        before = len(calls)
        assert tokens(llm, [prompt(seed)], short) == [want[seed]]
        llm.engine.engine_states()                   # the ranks drop what the book evicted
        encodes.append(len(calls) - before)
        held.append((b.num_bytes, store.num_bytes, len(b), len(store)))
    assert encodes == [1, 1, 1, 0, 1, 1]
    assert all(bb == sb <= 2 * one and n == m for bb, sb, n, m in held), held
    assert b.stats.evictions == 3
    assert_all_blocks_free(llm)


def test_zero_disables_reuse(fresh):
    """`fresh` has a bound of 0 (and no prefix cache): the same image twice is encoded twice,
    and nothing stays once the requests are done."""
    calls, hits = count_encodes(fresh), book(fresh).stats.hits
    first = tokens(fresh, [prompt(60)])
    assert tokens(fresh, [prompt(60)]) == first
    assert len(calls) == 2 and book(fresh).stats.hits == hits
    fresh.engine.engine_states()
    assert book(fresh).num_bytes == 0 and len(fresh.engine.worker.runner.encoder_outputs) == 0
    assert_all_blocks_free(fresh)


# ------------------------------------------------------------------ preemption

PREEMPTED = [prompt(70), prompt(71, 72), prompt(73, text="one more ]<]image[>[ here")]
LONGER = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def unpreempted(fresh):
    return tokens(fresh, PREEMPTED, LONGER)


@pytest.mark.parametrize("gb", [1.0, 0.0], ids=["cache", "no_cache"])
def test_preempted_image_requests_keep_their_outputs(tiny_vision_dir, unpreempted, gb):
    """A pool of 7 blocks preempts some of three image requests after their images were
    encoded and their pixels dropped: the recompute reads the outputs they hold (no second
    encode, also with a bound of 0) and the greedy tokens equal an unpreempted engine's."""
    llm = LLM(model=str(tiny_vision_dir), dtype="float32", mm_encoder_cache_gb=gb, max_num_batched_tokens=48,
              kv_cache_memory=7 * 16 * 2944, async_scheduling=False)
    calls = count_encodes(llm)
    assert tokens(llm, PREEMPTED, LONGER) == unpreempted
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert len(calls) == 4
    assert_all_blocks_free(llm)
