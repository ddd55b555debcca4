"""OpenAI request models: type errors name the field path, value errors come from
SamplingParams naming the field, and request fields map onto SamplingParams."""
import pytest
from pydantic import ValidationError

from m3serve.serving.openai.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, error_body, param_of
from m3serve.serving.request_body import validation_message


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


def test_json_check_exempts_free_json_from_the_64_bit_rule():
    """Tool-call inputs and tool schemas are arbitrary JSON: integers of any size pass there
    (the model may write them, and clients send them back), and stay refused elsewhere."""
    from m3serve.serving.anthropic.protocol import MessagesRequest
    from m3serve.serving.errors import APIError
    from m3serve.serving.openai.protocol import TokenizeRequest
    from m3serve.serving.request_body import check_json
    from m3serve.serving.openai.responses_protocol import ResponsesRequest
    big = 10 ** 80
    anthropic = {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {"n": big, "deep": [{"m": [big, -big]}]}}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"n": {"maximum": big}}}}]}
    check_json(anthropic, free_json=MessagesRequest.free_json)
    chat = {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"n": big}}}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": big}}}]}
    check_json(chat, free_json=ChatCompletionRequest.free_json)
    check_json(chat, free_json=TokenizeRequest.free_json)
    check_json({"input": [{"type": "function_call", "arguments": {"n": big}}],
                "tools": [{"type": "function", "parameters": {"maximum": big}}]}, free_json=ResponsesRequest.free_json)
    for body, free, param in (
            ({**anthropic, "max_tokens": big}, MessagesRequest.free_json, "max_tokens"),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "input": big}]}]},
             (), "messages.0.content.0.input"),
            ({**chat, "seed": big}, ChatCompletionRequest.free_json, "seed"),
            ({**chat, "stop_token_ids": [1, big]}, ChatCompletionRequest.free_json, "stop_token_ids.1"),
            ({"input": [{"type": "function_call", "arguments": {"n": big}}]}, (), "input.0.arguments.n")):
        with pytest.raises(APIError, match="64-bit") as info:
            check_json(body, free_json=free)
        assert info.value.param == param
