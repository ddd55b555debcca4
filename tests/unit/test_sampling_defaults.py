"""Request sampling defaults from the checkpoint's generation_config.json (vLLM's
--generation-config / --override-generation-config), and where they apply."""
import json

import pytest

from m3serve.config import EngineConfig, GenerationConfig
from m3serve.sampling_defaults import load_sampling_defaults
from m3serve.serving.openai.protocol import ChatCompletionRequest


def model_dir(tmp_path, **values):
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                 "do_sample": True, **values}))
    return tmp_path


CARD = {"temperature": 1.0, "top_p": 0.95, "top_k": 40}


def test_auto_reads_the_models_sampling_values(tmp_path):
    d = model_dir(tmp_path, **CARD, max_new_tokens=512, repetition_penalty=1.05, min_p=None)
    assert load_sampling_defaults(GenerationConfig(), d) == {**CARD, "max_tokens": 512, "repetition_penalty": 1.05}


def test_vllm_mode_ignores_the_file_and_overrides_win(tmp_path):
    d = model_dir(tmp_path, **CARD)
    assert load_sampling_defaults(GenerationConfig("vllm"), d) == {}
    cfg = GenerationConfig(override_generation_config='{"temperature": 0.6, "max_new_tokens": 9, "foo": 1}')
    assert load_sampling_defaults(cfg, d) == {**CARD, "temperature": 0.6, "max_tokens": 9}


def test_a_directory_of_its_own(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "empty").mkdir()
    other = model_dir(tmp_path / "other", top_k=7)
    assert load_sampling_defaults(GenerationConfig(str(other)), model_dir(tmp_path, **CARD)) == {"top_k": 7}
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_sampling_defaults(GenerationConfig(str(tmp_path / "empty")), tmp_path)
    with pytest.raises(ValueError, match="not auto, vllm, or a directory"):
        load_sampling_defaults(GenerationConfig("/does/not/exist"), tmp_path)


def test_bad_values_are_named(tmp_path):
    with pytest.raises(ValueError, match="generation config defaults.*top_p"):
        load_sampling_defaults(GenerationConfig(), model_dir(tmp_path, top_p=3.0))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json: not a readable JSON"):
        load_sampling_defaults(GenerationConfig(), tmp_path)
    with pytest.raises(ValueError, match="override_generation_config: not valid JSON"):
        EngineConfig.from_kwargs(override_generation_config="{")


def test_a_requests_own_values_win():
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.0)
    params = request.sampling_params(10, None, {**CARD, "max_tokens": 512})
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 0.95, 40, 10)


def test_llm_default_sampling_params(tiny_dir, tmp_path):
    import shutil

    from m3serve.llm import LLM
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    model_dir(d, top_k=1, max_new_tokens=4)
    llm = LLM(str(d))
    assert (llm.get_default_sampling_params().top_k, llm.get_default_sampling_params().max_tokens) == (1, 4)
    from m3serve.sampling_params import SamplingParams
    [out] = llm.generate("hello there", use_tqdm=False)     # no params: top_k 1 is greedy, 4 tokens
    [greedy] = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_vllm_compilation_config_and_hf_overrides(tiny_dir):
    from m3serve.config import CompilationConfig
    from m3serve.model.config import load_config
    c = CompilationConfig(compilation_config='{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 1, 2]}')
    assert (c.enforce_eager, c.cudagraph_capture_sizes, c.not_applicable) == (False, (1, 2, 4), {})
    assert CompilationConfig(compilation_config={"cudagraph_mode": "NONE", "level": 3}).enforce_eager
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        CompilationConfig(compilation_config={"cudagraph_mode": "SOMETIMES"})
    base = load_config(tiny_dir)
    over = load_config(tiny_dir, {"max_position_embeddings": 1024, "text_config": {"rms_norm_eps": 1e-5}})
    assert (over.max_position_embeddings, over.rms_norm_eps) == (1024, 1e-5) != (base.max_position_embeddings,
                                                                                  base.rms_norm_eps)
    yarn = load_config(tiny_dir, {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})   # not ignored
    assert yarn.rope_yarn.factor == 2.0
    assert yarn.rope_yarn.original_max_position_embeddings == base.max_position_embeddings // 2
    with pytest.raises(ValueError, match="only default and yarn RoPE"):        # nor is an unknown kind
        load_config(tiny_dir, {"text_config": {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}})


def test_unknown_flags_are_named_with_the_commands_usage(capsys):
    from m3serve.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--no-such-flag", "5", "some/model"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "usage: m3serve serve" in err and "unrecognized argument(s): --no-such-flag" in err
