"""DSpark: the drafts the engine proposes equal an independent dense computation of the draft
(taps of the dense reference target, the context projection, the non-causal windowed query
block, the target head and the sequential Markov head, from the checkpoint's dequantised
tensors); the default number of drafts is the draft's block size; malformed dspark/ folders are
refused naming the key or the tensor; the draft's window pool holds only each request's window.
(Lossless serving with chunked prefill, preemption,
prefix hits, stop strings, max_tokens and n = 2 is `test_spec_engine.py`'s `dspark` case.)"""
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3serve.kernels.ref.packed import dequantize
from m3serve.llm import LLM
from m3serve.model.config import load_config
from m3serve.model.reference import apply_rope, gemma_rms_norm, rope_cos_sin, swiglu_oai
from m3serve.sampling_params import SamplingParams
from m3serve.spec_decode.dspark import PREFIX

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from refgreedy import reference_model  # noqa: E402  (the dense reference over a checkpoint)


def _draft_weights(draft_dir) -> dict[str, torch.Tensor]:
    raw = load_file(str(draft_dir / "model.safetensors"))
    out = {}
    for key, t in raw.items():
        name = key[len(PREFIX):]
        if name.endswith("weight_scale_inv"):
            continue
        scale = raw.get(key[:-len("weight")] + "weight_scale_inv") if key.endswith(".weight") else None
        out[name] = dequantize("mxfp8", t, scale) if scale is not None else t.float()
    return out


def _taps(ref, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """The residual stream after each of `layer_ids` of the dense reference, concatenated."""
    cfg, w = ref.cfg, ref.w
    positions = torch.arange(ids.shape[0])
    x = w["model.embed_tokens.weight"][ids].float()
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    after = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = x + ref._attention(i, gemma_rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                               positions, cos, sin, [])
        xn = gemma_rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        x = x + (ref._moe(p + "block_sparse_moe.", xn) if cfg.is_moe(i) else ref._mlp(p + "mlp.", xn))
        after.append(x)
    return torch.cat([after[i] for i in layer_ids], dim=-1)


def _dense_dspark(ref, draft_cfg: dict, w: dict, taps: torch.Tensor, anchor: int, k: int) -> list[int]:
    """The DSpark forward written out densely: context rows 0..p, the block at p+1..p+k."""
    cfg = ref.cfg
    eps, H, G, D = cfg.rms_norm_eps, draft_cfg["num_attention_heads"], draft_cfg["num_key_value_heads"], cfg.head_dim
    window, p = draft_cfg["sliding_window"], taps.shape[0] - 1
    main = gemma_rms_norm(taps @ w["fc.weight"].t(), w["hidden_norm.weight"], eps)
    ctx_pos, blk_pos = torch.arange(p + 1), torch.arange(p + 1, p + 1 + k)
    cos_c, sin_c = rope_cos_sin(cfg, ctx_pos, torch.float32)
    cos_b, sin_b = rope_cos_sin(cfg, blk_pos, torch.float32)
    ids = torch.tensor([anchor] + [draft_cfg["dspark_noise_token_id"]] * (k - 1))
    x = ref.w["model.embed_tokens.weight"][ids].float()
    key_pos = torch.cat([ctx_pos, blk_pos])
    visible = key_pos[None, :] >= blk_pos[:, None] - (window - 1)               # [k, p + 1 + k]
    group = torch.arange(H) // (H // G)
    for l in range(draft_cfg["num_hidden_layers"]):
        a = f"layers.{l}.decoder_layer."
        kc = apply_rope(gemma_rms_norm((main @ w[a + "self_attn.k_proj.weight"].t()).view(-1, G, D),
                                       w[a + "self_attn.k_norm.weight"], eps), cos_c, sin_c)
        vc = (main @ w[a + "self_attn.v_proj.weight"].t()).view(-1, G, D)
        xn = gemma_rms_norm(x, w[a + "input_layernorm.weight"], eps)
        q = apply_rope(gemma_rms_norm((xn @ w[a + "self_attn.q_proj.weight"].t()).view(k, H, D),
                                      w[a + "self_attn.q_norm.weight"], eps), cos_b, sin_b)
        kb = apply_rope(gemma_rms_norm((xn @ w[a + "self_attn.k_proj.weight"].t()).view(k, G, D),
                                       w[a + "self_attn.k_norm.weight"], eps), cos_b, sin_b)
        vb = (xn @ w[a + "self_attn.v_proj.weight"].t()).view(k, G, D)
        keys, values = torch.cat([kc, kb])[:, group], torch.cat([vc, vb])[:, group]
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(D)
        probs = torch.softmax(scores.masked_fill(~visible[None], -math.inf), -1)
        o = torch.einsum("hqk,khd->qhd", probs, values).reshape(k, H * D)
        x = x + o @ w[a + "self_attn.o_proj.weight"].t()
        xn = gemma_rms_norm(x, w[a + "post_attention_layernorm.weight"], eps)
        x = x + swiglu_oai(xn @ w[a + "mlp.gate_proj.weight"].t(), xn @ w[a + "mlp.up_proj.weight"].t(),
                           cfg.swiglu_alpha, cfg.swiglu_limit) @ w[a + "mlp.down_proj.weight"].t()
    base = gemma_rms_norm(x, w["final_norm.weight"], eps) @ ref.w["lm_head.weight"].float().t()
    prev, drafts = anchor, []
    for i in range(k):
        logits = base[i] + w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][prev]
        prev = int(logits.argmax())
        drafts.append(prev)
    return drafts


def _record_proposals(llm):
    runner = llm.engine.worker.runner
    real, seen = runner.proposer.propose, []

    def propose(step):
        out = real(step)
        seen.append((step.last_position_cpu[0], int(step.last_token[0]), out[0].tolist()))
        return out
    runner.proposer.propose = propose
    return seen


def test_drafts_equal_the_dense_dspark(drafts):
    target = drafts["dspark"]
    draft_cfg = json.loads((target / "dspark" / "config.json").read_text())["text_config"]
    llm = LLM(str(target), dtype="float32", speculative_config={"method": "dspark"})
    assert llm.engine.worker.runner.proposer.k == draft_cfg["dspark_block_size"] == 7   # the default
    seen = _record_proposals(llm)
    prompt = [(11 * j) % 1900 + 20 for j in range(45)]           # longer than the 32-token window
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12,
                                                                      ignore_eos=True), use_tqdm=False)
    tokens = prompt + list(out[0].outputs[0].token_ids)
    ref, w = reference_model(target), _draft_weights(target / "dspark")
    assert len(seen) >= 2
    checked = 0
    for last_pos, anchor, got in seen[:3]:
        assert anchor == tokens[last_pos + 1]
        taps = _taps(ref, torch.tensor(tokens[:last_pos + 1]), draft_cfg["dspark_target_layer_ids"])
        assert _dense_dspark(ref, draft_cfg, w, taps, anchor, 7) == got
        checked += 1
    assert checked >= 2


def _copy_with(drafts, tmp_path, edit_config=None, edit_weights=None):
    target = tmp_path / "target"
    shutil.copytree(drafts["dspark"], target)
    cfg_path, w_path = target / "dspark" / "config.json", target / "dspark" / "model.safetensors"
    if edit_config:
        raw = json.loads(cfg_path.read_text())
        edit_config(raw)
        cfg_path.write_text(json.dumps(raw))
    if edit_weights:
        tensors = load_file(str(w_path))
        edit_weights(tensors)
        save_file(tensors, str(w_path))
    return target


def _text(raw, key, value):
    raw["text_config"][key] = value


L0 = PREFIX + "layers.0.decoder_layer."


@pytest.mark.parametrize("edit_config,edit_weights,message", [
    (lambda r: r.update(architectures=["Qwen3DSparkModel"]), None, "'architectures'"),
    (lambda r: _text(r, "dspark_markov_head_type", "gated"), None, "'dspark_markov_head_type'"),
    (lambda r: _text(r, "dspark_target_layer_ids", [0, 1, 99]), None, "'dspark_target_layer_ids'"),
    (lambda r: _text(r, "dspark_hybrid_context_fusion", True), None, "'dspark_hybrid_context_fusion'"),
    (lambda r: _text(r, "hidden_size", 128), None, "'hidden_size'"),
    (lambda r: r.update(dspark_block_size=5), None, "disagrees with text_config"),
    (lambda r: r.update(quantization_config={"quant_method": "fp8"}), None, "quant_method"),
    (lambda r: r["text_config"].pop("dspark_noise_token_id"), None, "'dspark_noise_token_id'"),
    (None, lambda t: t.pop(L0 + "self_attn.k_proj.weight_scale_inv"), "k_proj.weight_scale_inv"),
    (None, lambda t: t.update({L0 + "mlp.down_proj.weight": t[L0 + "mlp.down_proj.weight"].to(torch.bfloat16)}),
     "wrong dtype"),
    (None, lambda t: t.update({PREFIX + "fc.weight": t[PREFIX + "fc.weight"][:, :-1].contiguous()}),
     "wrong shape"),
    (None, lambda t: t.update({PREFIX + "extra.weight": torch.zeros(2)}), "unexpected"),
], ids=["arch", "markov", "taps", "fusion", "hidden", "top-level", "quant", "noise", "missing-scale",
        "dtype", "shape", "extra"])
def test_malformed_dspark_folders_are_refused(drafts, tmp_path, edit_config, edit_weights, message):
    target = _copy_with(drafts, tmp_path, edit_config, edit_weights)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        LLM(str(target), dtype="float32", speculative_config={"method": "dspark", "num_speculative_tokens": 3})


def test_dspark_config_errors(drafts, tmp_path):
    with pytest.raises(ValueError, match="exceeds the DSpark draft's dspark_block_size 7"):
        LLM(str(drafts["dspark"]), dtype="float32",
            speculative_config={"method": "dspark", "num_speculative_tokens": 8})
    bare = tmp_path / "bare"
    shutil.copytree(drafts["dspark"], bare, ignore=shutil.ignore_patterns("dspark"))
    with pytest.raises(ValueError, match="dspark/config.json|dspark_block_size|cannot be read"):
        LLM(str(bare), dtype="float32", speculative_config={"method": "dspark"})
    # the draft named explicitly, away from its target
    llm = LLM(str(bare), dtype="float32", max_num_seqs=2,
              speculative_config={"method": "dspark", "model": str(drafts["dspark"] / "dspark"),
                                  "num_speculative_tokens": 2})
    assert llm.engine.worker.runner.proposer.k == 2
    cfg = load_config(bare)
    assert cfg.hidden_size == 64


def test_lossless_on_the_all_msa_target(tiny_m31_dir, tmp_path):
    """DSpark on MiniMax-M3.1-Flash's layout (the tiny all-MSA flavor, bf16 weights): greedy
    outputs equal speculation off, with chunked prefill, a prefix hit and accepted runs (drafts
    replaced by the true continuation, every third one wrong)."""
    from test_spec_engine import _oracle, _prompts

    from m3serve.distill.tiny_drafts import make_draft

    target = tmp_path / "m31"
    shutil.copytree(tiny_m31_dir, target)
    make_draft(target, "dspark", target, seed=3)
    flags = dict(dtype="float32", max_num_batched_tokens=40, max_num_seqs=8)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = LLM(str(target), **flags)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                          use_tqdm=False)]
    for oracle in (False, True):
        llm = LLM(str(target), speculative_config={"method": "dspark", "num_speculative_tokens": 4}, **flags)
        if oracle:
            _oracle(llm, {tuple(p): p + w for p, w in zip(prompts, want)}, 4)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                            use_tqdm=False)]
        assert got == want
        stats = llm.engine.core.scheduler.spec_stats
        assert stats.num_drafts > 0 and (not oracle or stats.mean_acceptance_length > 2.0)
        assert llm.engine.core.kv_manager.prefix_cache_hits > 0


def test_the_draft_keeps_only_each_requests_window(drafts, tiny_dir):
    """Through the engine: long generations under preemption hold at most a window of draft
    blocks each (a 32-token window, k = 3: 37 tokens span at most 4 blocks of 16), release the
    blocks the window has left, stay lossless, and leave the draft pool whole."""
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    flags = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                 kv_cache_memory=20 * 16 * 2944 + 17 * 16 * 1024)       # 20 target blocks: preemption
    prompts = [[(13 * j + i) % 1900 + 20 for j in range(n)] for i, n in enumerate((150, 70, 20))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(drafts["dspark"]), speculative_config=spec, **flags)
    core = llm.engine.core
    draft = core.kv_manager.draft
    assert core.kv_manager.num_blocks == 20 and draft.pool.num_blocks == 4 * 4 + 1
    held, lowest = [], {}
    update = core.scheduler.update_from_output

    def record(so, out):
        result = update(so, out)
        for rid in draft.request_ids:
            blocks = draft.get_block_ids(rid)
            held.append(len(blocks))
            lowest[rid] = max(lowest.get(rid, 0), min(blocks))
        core.scheduler.check_integrity()
        return result
    core.scheduler.update_from_output = record
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    plain = LLM(str(tiny_dir), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    assert got == want and core.scheduler.num_preemptions > 0
    assert max(held) <= 4 and max(lowest.values()) >= 8      # block 8+ of 11: the head released
    assert draft.request_ids == [] and draft.num_free_blocks == draft.pool.num_usable_blocks


def test_context_rows_below_the_window_are_not_computed(drafts):
    """A prompt chunk's rows below the first block of the request's window after the step would
    only be written to the null block: the draft skips them (`ModelRunner._window_rows`). The
    proposals -- every draft of every step -- and the outputs are those of the draft computing
    every row, with fewer rows computed."""
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    prompts = [[(13 * j + i) % 1900 + 20 for j in range(n)] for i, n in enumerate((150, 70, 20))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for skip in (True, False):
        llm = LLM(str(drafts["dspark"]), speculative_config=spec, dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=256)
        runner = llm.engine.worker.runner
        if not skip:
            runner._window_rows = lambda batch, dev: None
        draft, rows, proposals = runner.proposer.drafter.draft, [0], []
        write, propose = draft.write_context, runner.proposer.propose
        draft.write_context = lambda taps, *a: rows.__setitem__(0, rows[0] + taps.shape[0]) or write(taps, *a)
        runner.proposer.propose = lambda step: proposals.append(propose(step).tolist()) or torch.tensor(proposals[-1])
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
        runs[skip] = outs, proposals, rows[0]
    (got, drafted, computed), (want, all_drafted, all_rows) = runs[True], runs[False]
    assert got == want and drafted == all_drafted
    # one chunk each: the 150-token prompt keeps rows from block 7 (lo = 150 - 3 - 32 + 1 = 116),
    # the 70-token one from block 2 (lo = 36), the 20-token one all
    assert all_rows - computed == 112 + 32
