"""OpenAI request models: type errors name the field path, value errors come from
SamplingParams naming the field, and request fields map onto SamplingParams."""
import pytest
from pydantic import ValidationError

from m3serve.serving.openai.protocol import (MAX_N, ChatCompletionRequest, CompletionRequest, error_body,
                                             param_of, validation_message)


def _message(model, data):
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return validation_message(info.value)


def test_validation_message_names_the_field_path_not_the_union_member():
    assert _message(CompletionRequest, {"prompt": 5}) == (
        "prompt: expected one of str, list[str], list[int], list[list[int]] (got 5)", "prompt")
    assert _message(CompletionRequest, {}) == ("prompt is required", "prompt")
    message, param = _message(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                      "tools": [{"function": {}}]})
    assert param == "tools.0.function.name" and "required" in message


def test_sampling_fields_map_and_defaults():
    req = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0, "top_k": 5, "stop": "x",
                                            "seed": 3, "n": 2, "ignore_eos": True, "extra": 1})
    params = req.sampling_params(max_tokens=7, logprobs=2)
    assert (params.temperature, params.top_k, params.stop, params.seed, params.n) == (0.0, 5, ["x"], 3, 2)
    assert (params.max_tokens, params.logprobs, params.ignore_eos) == (7, 2, True)
    assert req.model_extra == {"extra": 1}
    default = CompletionRequest.model_validate({"prompt": "hi"}).sampling_params(16, None)
    assert (default.temperature, default.top_p, default.top_k) == (1.0, 1.0, 0)


@pytest.mark.parametrize("field,value,words", [
    ("n", MAX_N + 1, f"n must be <= {MAX_N}"), ("temperature", -0.5, "temperature"),
    ("top_p", 0.0, "top_p"), ("presence_penalty", 9, "presence_penalty")])
def test_value_errors_name_the_field(field, value, words):
    req = CompletionRequest.model_validate({"prompt": "hi", field: value})
    with pytest.raises(ValueError, match=words) as info:
        req.sampling_params(16, None)
    assert param_of(str(info.value), CompletionRequest.model_fields) == field


def test_error_body_shape():
    assert error_body(400, "bad", "n") == {"error": {"message": "bad", "type": "BadRequestError",
                                                     "param": "n", "code": 400}}
    assert error_body(503, "busy")["error"]["type"] == "ServiceUnavailableError"
