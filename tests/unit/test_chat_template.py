"""Tests for the MiniMax-M3-style chat template and its renderer."""
import json
from pathlib import Path

import pytest

from m3serve.model.tokenizer_build import build_tokenizer
from m3serve.serving.chat_template import load_chat_template, render_chat

NS = "]<]minimax[>["
TEMPLATE = (Path(__file__).resolve().parents[2] / "m3serve" / "model" / "chat_template.jinja").read_text()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "opts": {"type": "object", "properties": {"unit": {"type": "string"}}},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}
WEATHER_ARGS = {"city": "Paris", "days": 3, "opts": {"unit": "C", "wind": None}, "tags": ["a", "b"], "lang": None}
EXPECTED_CALL = (
    f"{NS}<tool_call>\n"
    f'{NS}<invoke name="get_weather">\n'
    f"{NS}<city>Paris{NS}</city>\n"
    f"{NS}<days>3{NS}</days>\n"
    f"{NS}<opts>{NS}<unit>C{NS}</unit>{NS}</opts>\n"
    f"{NS}<tags>{NS}<item>a{NS}</item>{NS}<item>b{NS}</item>{NS}</tags>\n"
    f"{NS}</invoke>\n"
    f"{NS}</tool_call>"
)


def _assistant_call(arguments):
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def render(messages, **kwargs):
    return render_chat(TEMPLATE, messages, **kwargs)


def test_roles_rendered_with_markers():
    text = render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        add_generation_prompt=False,
    )
    assert text == (
        "]~!b[]~b]system\nBe brief.[e~[\n"
        "]~b]user\nHi[e~[\n"
        "]~b]ai\nHello![e~[\n"
        "]~b]user\nBye[e~[\n"
    )


def test_generation_prompt_opens_assistant_turn():
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages) == "]~!b[]~b]user\nHi[e~[\n]~b]ai\n"
    assert render(messages, add_generation_prompt=False) == "]~!b[]~b]user\nHi[e~[\n"


@pytest.mark.parametrize(
    "mode, suffix",
    [(None, ""), ("adaptive", ""), ("enabled", "<mm:think>\n"), ("disabled", "<mm:think>\n</mm:think>\n")],
)
def test_thinking_modes(mode, suffix):
    kwargs = {"thinking_mode": mode} if mode else None
    text = render([{"role": "user", "content": "Hi"}], chat_template_kwargs=kwargs)
    assert text == "]~!b[]~b]user\nHi[e~[\n]~b]ai\n" + suffix


def test_thinking_mode_does_not_touch_history_without_generation_prompt():
    text = render([{"role": "user", "content": "Hi"}], add_generation_prompt=False,
                  chat_template_kwargs={"thinking_mode": "enabled"})
    assert "<mm:think>" not in text


def test_reasoning_content_in_history():
    text = render(
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": " add them \n"}],
        add_generation_prompt=False,
    )
    assert text.endswith("]~b]ai\n<mm:think>\nadd them\n</mm:think>\n4[e~[\n")
    # The "reasoning" alias used by some clients renders the same.
    alias = render(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": " add them \n"}],
        add_generation_prompt=False,
    )
    assert alias == text


def test_tools_rendered_into_system_part():
    text = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    system_part = text.split("[e~[\n")[0]
    assert system_part.startswith("]~!b[]~b]system\nBe brief.\n\n")
    assert "<tool>" + json.dumps(WEATHER_TOOL["function"], ensure_ascii=False) + "</tool>" in system_part
    assert f"{NS}<tool_call>" in system_part and f'{NS}<invoke name="TOOL_NAME">' in system_part
    assert text.count("]~b]system") == 1


def test_tools_without_system_message_create_one():
    text = render([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    assert text.startswith("]~!b[]~b]system\n# Tools\n")
    assert text.endswith("[e~[\n]~b]user\nHi[e~[\n]~b]ai\n")


def test_tool_call_markup_nested_object_array_and_null_omitted():
    messages = [{"role": "user", "content": "Weather?"}, _assistant_call(WEATHER_ARGS),
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    text = render(messages)
    assert "]~b]ai\n" + EXPECTED_CALL + "[e~[\n]~b]tool\nsunny[e~[\n]~b]ai\n" in text
    assert "lang" not in text and "wind" not in text


def test_tool_call_arguments_string_and_dict_equivalent():
    as_dict = render([{"role": "user", "content": "q"}, _assistant_call(WEATHER_ARGS)])
    as_string = render([{"role": "user", "content": "q"}, _assistant_call(json.dumps(WEATHER_ARGS))])
    assert as_dict == as_string


def test_tool_call_after_content_and_scalar_types():
    message = _assistant_call({"flag": True, "ratio": 0.5, "n": [1, None, {"k": False}]})
    message["content"] = "Let me check."
    text = render([{"role": "user", "content": "q"}, message], add_generation_prompt=False)
    assert "]~b]ai\nLet me check.\n" + f"{NS}<tool_call>\n" in text
    assert f"{NS}<flag>true{NS}</flag>\n" in text
    assert f"{NS}<ratio>0.5{NS}</ratio>\n" in text
    items = f"{NS}<item>1{NS}</item>{NS}<item>null{NS}</item>{NS}<item>{NS}<k>false{NS}</k>{NS}</item>"
    assert f"{NS}<n>{items}{NS}</n>" in text


def test_several_invokes_in_one_block():
    message = _assistant_call({"city": "Paris"})
    message["tool_calls"].append({"type": "function", "function": {"name": "get_time", "arguments": "{}"}})
    text = render([{"role": "user", "content": "q"}, message])
    assert text.count(f"{NS}<tool_call>") == 1
    assert f'{NS}</invoke>\n{NS}<invoke name="get_time">\n{NS}</invoke>\n{NS}</tool_call>' in text


def test_content_text_parts_are_joined():
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert render([{"role": "user", "content": parts}]) == render([{"role": "user", "content": "Hello there"}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], r"messages\[1\]\.role 'robot'"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}],
         r"messages\[0\]\.content\[0\]\.type 'input_audio'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"messages\[0\]\.content\[0\]\.text"),
        ([_assistant_call("{not json")], r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"),
        ([_assistant_call("[1, 2]")], r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"),
        (["hello"], r"messages\[0\] must be an object"),
        ([], "messages must be a non-empty list"),
    ],
)
def test_malformed_messages_raise_value_error(messages, match):
    with pytest.raises(ValueError, match=match):
        render(messages)


def test_bad_thinking_mode_and_tools_raise():
    with pytest.raises(ValueError, match="thinking_mode"):
        render([{"role": "user", "content": "hi"}], chat_template_kwargs={"thinking_mode": "always"})
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        render([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"description": "x"}}])


def test_template_errors_surface_as_value_error():
    with pytest.raises(ValueError, match="boom"):
        render_chat("{{ raise_exception('boom') }}", [{"role": "user", "content": "hi"}])


def test_tojson_does_not_html_escape():
    tool = {"type": "function", "function": {"name": "f", "description": "a < b & c > d"}}
    assert "a < b & c > d" in render([{"role": "user", "content": "hi"}], tools=[tool])


def test_load_chat_template_sources(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from-config"}))
    assert load_chat_template(tmp_path) == "from-config"
    (tmp_path / "chat_template.jinja").write_text("from-file")
    assert load_chat_template(tmp_path) == "from-file"


def test_matches_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    build_tokenizer(tmp_path, vocab_size=512)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]},
        {"role": "tool", "content": "sunny"},
    ]
    ours = render_chat(load_chat_template(tmp_path), messages, tools=[WEATHER_TOOL],
                       chat_template_kwargs={"thinking_mode": "enabled"})
    theirs = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True,
                                    thinking_mode="enabled")
    assert ours == theirs
    assert EXPECTED_CALL in ours


def test_reasoning_effort_in_the_system_turn_and_checked_by_the_template_itself():
    """The template writes M3.1's level and refuses others on its own (other renderers, e.g.
    transformers' apply_chat_template, do not run our checks)."""
    import jinja2
    ask = [{"role": "user", "content": "hi"}]
    assert render_chat(TEMPLATE, ask, chat_template_kwargs={"reasoning_effort": "xhigh"}) == \
        "]~!b[]~b]system\n<effort>xhigh</effort>[e~[\n]~b]user\nhi[e~[\n]~b]ai\n"
    assert render_chat(TEMPLATE, ask, chat_template_kwargs={"reasoning_effort": None}) == render_chat(TEMPLATE, ask)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    raw = env.from_string(TEMPLATE)
    assert "<effort>low</effort>" in raw.render(messages=ask, add_generation_prompt=True, reasoning_effort="low")
    with pytest.raises(ValueError, match="reasoning_effort must be one of max, xhigh, high, medium, low; got fast"):
        raw.render(messages=ask, add_generation_prompt=True, reasoning_effort="fast")


def test_server_default_reasoning_effort_is_checked_at_startup():
    from m3serve.serving.server_args import ServerConfig
    assert ServerConfig(default_chat_template_kwargs={"reasoning_effort": "max"})
    with pytest.raises(ValueError, match=r"default_chat_template_kwargs.reasoning_effort must be one of .* got 'huge'"):
        ServerConfig(default_chat_template_kwargs={"reasoning_effort": "huge"})
