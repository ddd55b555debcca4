"""Speculation through the other front ends: `LLM` with TP 2 and with DP 2 + EP 2 (gloo CPU
processes; every rank samples and proposes the same drafts), and `m3serve serve
--speculative-config` (greedy texts equal speculation off, with structured outputs too;
spec-decode counters in /metrics; the synthetic mode flagged there and logged loudly)."""
import json

import httpx
import pytest

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from refgreedy import assert_engine_no_near_ties
from test_spec_engine import _prompts
from serverutil import LiveServer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _structured():
    """A greedy request constrained to a JSON schema (every sampling rank holds its matcher)."""
    from m3serve.sampling_params import StructuredOutputsParams
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=COLOR))


@pytest.fixture(scope="module")
def plain(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2), use_tqdm=False)
    # compared with TP 2 and DP 2 ranks, whose float32 logits differ in the last bits (~1e-6),
    # and with a server process: no greedy step may be near that close to a tie (the
    # constrained request is not checked: its runner-up is the best token the grammar allows)
    assert_engine_no_near_ties(outs, margin=0.01)
    [constrained] = llm.generate([{"prompt_token_ids": _prompts()[1]}], _structured(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs], constrained.outputs[0].token_ids


@pytest.mark.parametrize("layout,kind", [(dict(tensor_parallel_size=2), "eagle3"),
                                         (dict(data_parallel_size=2, enable_expert_parallel=True), "eagle3"),
                                         (dict(tensor_parallel_size=2), "dspark")],
                         ids=["tp2", "dp2-ep2", "tp2-dspark"])
def test_parallel_speculation_is_lossless(tiny_dir, drafts, plain, layout, kind):
    spec = {"method": "eagle3", "model": str(drafts["eagle3-gqa"]), "num_speculative_tokens": 3}
    if kind == "dspark":          # the draft split over the ranks like the target (block scales whole)
        spec = {"method": "dspark", "num_speculative_tokens": 4}
    llm = LLM(str(drafts["dspark"] if kind == "dspark" else tiny_dir), dtype="float32",
              speculative_config=spec, **layout)
    try:
        prompts = _prompts() + [_prompts()[1]]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [GREEDY] * len(_prompts()) + [_structured()],
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain[0] + [plain[2]]
        for state in llm.engine.engine_states():
            assert state.num_free_blocks == state.num_usable_blocks and state.integrity_error is None
            assert all(r["num_batch_rows"] == 0 for r in state.ranks)
    finally:
        llm.shutdown()


def test_tp2_seeded_sampling_with_plain_steps_equals_one_rank(tiny_dir, drafts):
    """Seeded sampling through plain (disable_by_batch_size) and speculative steps: TP 2 emits
    what one rank emits. (Every rank also draws in the plain steps, so the other ranks'
    generators, which only steer their share of the drafts, stay in step with the driver's;
    the outputs alone would not show a lag, since the driver decides them.)"""
    spec = {"method": "eagle3", "model": str(drafts["eagle3-gqa"]), "num_speculative_tokens": 3,
            "disable_by_batch_size": 3}
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:5]]
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(5)]
    outs = []
    for tp in (1, 2):
        llm = LLM(str(tiny_dir), dtype="float32", speculative_config=spec, tensor_parallel_size=tp)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "dspark"])
def test_server_speculation(tiny_dir, drafts, plain, tmp_path, kind):
    spec = {"method": kind, "model": str(drafts[kind]), "num_speculative_tokens": 3, "attention_backend": "FLASH_ATTN"}
    target = tiny_dir
    if kind == "dspark":          # the target's own dspark/ folder, k = the draft's block size
        spec, target = {"method": "dspark", "attention_backend": "FLASH_ATTN"}, drafts["dspark"]
    srv = LiveServer(target, "--dtype", "float32", "--speculative-config", json.dumps(spec),
                     "--tool-call-parser", "minimax_m3",
                     log_path=tmp_path / "s.log")
    try:
        body = {"model": "tiny", "prompt": _prompts(), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert texts == plain[1]
        if kind == "eagle3":
            _structured_outputs_served(srv, tiny_dir)
        m = srv.wait_idle()
        assert m["m3serve:spec_decode_num_drafts_total"] > 0
        k = 7 if kind == "dspark" else 3
        assert m["m3serve:spec_decode_num_draft_tokens_total"] >= k * m["m3serve:spec_decode_num_drafts_total"] - 10 * k
        assert m["m3serve:spec_decode_synthetic_acceptance"] == 0
    finally:
        srv.stop()
    log = (tmp_path / "s.log").read_text()
    assert "not applicable here, ignored" in log and "attention_backend" in log


def test_server_synthetic_acceptance_is_flagged(tiny_dir, drafts, tmp_path):
    spec = json.dumps({"method": "eagle3", "model": str(drafts["eagle3-gqa"]), "num_speculative_tokens": 3,
                       "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.78})
    srv = LiveServer(tiny_dir, "--speculative-config", spec, log_path=tmp_path / "syn.log")
    try:
        body = {"model": "tiny", "prompt": [[5, 6, 7]] * 8, "max_tokens": 60, "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code == 200
        m = srv.wait_idle()
        assert m["m3serve:spec_decode_synthetic_acceptance"] == 1
        mean = 1 + m["m3serve:spec_decode_num_accepted_tokens_total"] / m["m3serve:spec_decode_num_drafts_total"]
        assert 2.3 < mean < 3.3          # ~150 verify steps around 2.78
    finally:
        srv.stop()
    assert "SYNTHETIC ACCEPTANCE" in (tmp_path / "syn.log").read_text()


@pytest.mark.parametrize("bad,words", [
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method must be one of"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2}', "needs rejection_sample_method"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_length": 4}', "[1, num_speculative_tokens + 1 = 3]"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "typo_key": 1}', "unknown key(s) ['typo_key']"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 1}', "disable_by_batch_size must be"),
    ('not json', "not valid JSON"),
])
def test_bad_speculative_config(bad, words):
    from m3serve.config import SpeculativeConfig

    with pytest.raises(ValueError) as e:
        SpeculativeConfig(bad)
    assert words in str(e.value)


def test_eagle3_without_a_model_needs_a_target_with_an_eagle3_folder(tiny_dir):
    """The draft folder defaults to the target's eagle3/ (the embedded model ships one); a target
    without one is refused when the engine's config is built, naming what is missing."""
    from m3serve.engine_args import build_engine_config

    spec = '{"method": "eagle3", "num_speculative_tokens": 3}'
    with pytest.raises(ValueError) as e:
        build_engine_config(model=str(tiny_dir), speculative_config=spec)
    assert "model (the EAGLE3 draft" in str(e.value) and f"{tiny_dir}/eagle3" in str(e.value)
    assert build_engine_config(model=None, speculative_config=spec).speculative.method == "eagle3"


def test_draft_checkpoint_errors_name_the_tensor(tiny_dir, drafts, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(drafts["eagle3"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["midlayer.self_attn.o_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(tensors, str(broken / "model.safetensors"))
    spec = {"method": "eagle3", "model": str(broken), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"wrong shape for tensor 'midlayer.self_attn.o_proj.weight' in model.safetensors"):
        LLM(str(tiny_dir), speculative_config=spec)
    del tensors["midlayer.self_attn.o_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"is missing tensor\(s\) \['layers.0.self_attn.o_proj.weight'\]"):
        LLM(str(tiny_dir), speculative_config=spec)
    tensors["midlayer.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor 'midlayer.extra.weight'"):
        LLM(str(tiny_dir), speculative_config=spec)


DOOR = {"type": "function", "function": {"name": "lock_door", "parameters": {
    "type": "object", "required": ["locked"], "properties": {"locked": {"type": "boolean"}}}}}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
         "required": ["color"], "additionalProperties": False}


def _structured_outputs_served(srv, tiny_dir):
    """With speculation on, response_format (greedy) gives what speculation off gives for the
    same rendered prompt and grammar, and a named tool_choice is served, not refused (the tool
    grammar itself is checked lossless in test_spec_structured.py; its markup is too long in
    the tiny vocabulary to complete here cheaply)."""
    from m3serve.sampling_params import StructuredOutputsParams

    messages = [{"role": "user", "content": "pick one"}]
    kwargs = {"thinking_mode": "disabled"}
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 40, "temperature": 0, "chat_template_kwargs": kwargs,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])["color"] in ("red", "green", "blue")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=COLOR))
    [out] = LLM(str(tiny_dir), dtype="float32").chat(messages, params, use_tqdm=False, chat_template_kwargs=kwargs)
    assert choice["message"]["content"] == out.outputs[0].text
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "lock it"}], "max_tokens": 16, "temperature": 0,
        "tools": [DOOR], "tool_choice": {"type": "function", "function": {"name": "lock_door"}},
        "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and not r.json()["choices"][0]["message"]["content"]
