"""minimax_m3 tool-call parser: docs/model.md §7 markup -> OpenAI tool_calls, streamed at every boundary.

Expected arguments are written by hand from the typing rules of docs/model.md §7; every case is also
streamed split at each single boundary and char by char, and must assemble to the same result.
"""
import json
import random

import pytest

from m3serve.model.markup import NAMESPACE as NS
from m3serve.serving.tool_parser import MiniMaxM3ToolParser, get_tool_parser


def tool(name, properties, **extra):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties, **extra}}}


TOOLS = [
    tool("get_weather", {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "nothing": {"type": "null"},
        "opts": {"type": "object", "properties": {"unit": {"type": "string"}, "level": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "label": {"type": ["integer", "string"]},
        "maybe": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    }),
    tool("create_order", {
        "user_id": {"type": "integer"},
        "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}}}},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "meta": {"type": "object"},
        "note": {"type": "string"},
    }),
    tool("ping", {}),
]


def el(name, inner=""):
    return f"{NS}<{name}>{inner}{NS}</{name}>"


def invoke(name, *params, quote='"'):
    return f"{NS}<invoke name={quote}{name}{quote}>\n" + "".join(p + "\n" for p in params) + f"{NS}</invoke>\n"


def block(*invokes):
    return f"{NS}<tool_call>\n" + "".join(invokes) + f"{NS}</tool_call>"


def chunkings(text, seed=0):
    """Whole text, every two-chunk split, char by char, and a few random multi-chunk splits."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def run_stream(chunks, tools=TOOLS, tool_choice="auto"):
    """Streams chunks; checks the OpenAI delta shape and assembles content and calls."""
    parser = MiniMaxM3ToolParser(tools, tool_choice)
    content, calls = "", []
    for chunk in chunks + [None]:
        delta = parser.finish() if chunk is None else parser.stream(chunk)
        assert delta.content != ""
        content += delta.content or ""
        for d in delta.tool_call_deltas:
            if "id" in d:  # first delta of a call
                assert d["index"] == len(calls) and d["type"] == "function" and d["id"].startswith("call_")
                assert d["function"]["arguments"] == ""
                calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content or None, calls


def named(calls):
    """(name, arguments string) per call: everything but the random ids."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def check(text, want_content, want_calls, tools=TOOLS, tool_choice="auto"):
    """extract() gives the expected result, and so does streaming at every chunking."""
    result = MiniMaxM3ToolParser(tools, tool_choice).extract(text)
    assert result.content == want_content
    assert [(n, json.loads(a)) for n, a in named(result.tool_calls)] == want_calls
    for call in result.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    assert len({c["id"] for c in result.tool_calls}) == len(result.tool_calls)
    for chunks in chunkings(text):
        content, calls = run_stream(chunks, tools, tool_choice)
        assert content == want_content, chunks
        assert named(calls) == named(result.tool_calls), chunks
        if want_calls:
            assert NS not in (content or "") and "invoke" not in (content or "")


def test_single_call_typed_by_schema_with_content_before():
    text = "Let me check.\n\n" + block(invoke(
        "get_weather",
        el("city", "Paris"),
        el("days", "3"),
        el("ratio", "0.25"),
        el("metric", "true"),
        el("nothing", "null"),
        el("opts", el("unit", "C") + el("level", "2")),
        el("tags", el("item", "a") + el("item", "b")),
    ))
    check(text, "Let me check.\n\n", [("get_weather", {
        "city": "Paris", "days": 3, "ratio": 0.25, "metric": True, "nothing": None,
        "opts": {"unit": "C", "level": 2}, "tags": ["a", "b"],
    })])


def test_values_that_do_not_parse_as_their_type_stay_strings():
    text = block(invoke(
        "get_weather",
        el("days", "three"),
        el("ratio", "1e999"),  # overflows a float
        el("metric", "yes"),
        el("opts", "not json"),
        el("city", " null "),  # a string schema keeps "null" literally, spaces included
        el("label", "7"),
        el("maybe", "null"),
    ))
    check(text, None, [("get_weather", {
        "days": "three", "ratio": "1e999", "metric": "yes", "opts": "not json", "city": " null ",
        "label": 7, "maybe": None,
    })])


def test_nested_objects_arrays_of_objects_and_arrays_of_arrays():
    text = block(invoke(
        "create_order",
        el("user_id", "42"),
        el("shipping", "\n" + el("city", "Singapore") + "\n" + el("zip", "018956") + "\n"),
        el("items", el("item", el("sku", "book-001") + el("qty", "2")) + el("item", el("sku", "pen") + el("qty", "10"))),
        el("matrix", el("item", el("item", "1") + el("item", "2.5")) + el("item", el("item", "-3"))),
        el("meta", ""),
        el("note", ""),
    ))
    check(text, None, [("create_order", {
        "user_id": 42,
        "shipping": {"city": "Singapore", "zip": "018956"},
        "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen", "qty": 10}],
        "matrix": [[1, 2.5], [-3]],
        "meta": {},
        "note": "",
    })])


def test_leaves_without_a_schema_type_stay_raw_strings():
    # rule: only a schema type coerces a leaf; a parameter the schema does not list, a tool not
    # in the request, and a tool without parameters keep the raw text
    text = block(
        invoke("get_weather", el("extra", "42"), el("flag", "false"), el("word", "hello"), el("list", '["x", 1]')),
        invoke("unknown_tool", el("n", "1.5"), el("obj", el("k", "v") + el("k", "w")), el("s", "{bad")),
        invoke("bare", el("n", "7"), el("z", "null")),
    )
    bare = {"type": "function", "function": {"name": "bare"}}
    check(text, None, [
        ("get_weather", {"extra": "42", "flag": "false", "word": "hello", "list": '["x", 1]'}),
        ("unknown_tool", {"n": "1.5", "obj": {"k": ["v", "w"]}, "s": "{bad"}),
        ("bare", {"n": "7", "z": "null"}),
    ], tools=TOOLS + [bare])


def test_content_before_the_call_is_verbatim():
    for before in ("Sure:  \n\n", "a \n b  ", "\n\n  x"):
        check(before + block(invoke("ping")), before, [("ping", {})])


@pytest.mark.parametrize("before", ["\t", "   ", "\n\n  ", "\n"])
def test_whitespace_alone_before_a_call_is_no_content(before):
    """vLLM's parser answers null there: the blank line a model (or the template, after a
    reasoning block) puts before its tool call is not an answer."""
    check(before + block(invoke("ping")), None, [("ping", {})])
    check(before + f"{NS}<tool_call>\n{NS}<invoke name=\"ping\">", None, [("ping", {})])   # cut off too
    check(before, before, [])                           # no call: the text as it came


FORCED = ["required", {"type": "function", "function": {"name": "get_weather"}}]
CALL = block(invoke("get_weather", el("city", "Paris")))


@pytest.mark.parametrize("tool_choice", ["auto"] + FORCED)
@pytest.mark.parametrize("cut", range(len(NS), len(NS) + len("<tool_call>")))
def test_an_opener_cut_by_max_tokens_is_not_content(tool_choice, cut):
    """`]<]minimax[>[<tool_c` at the end of an output is the start of a call, not text."""
    for before in ("", "\n\n"):
        check(before + CALL[:cut], None, [], tool_choice=tool_choice)
    check("Sure." + CALL[:cut], "Sure.", [], tool_choice=tool_choice)


@pytest.mark.parametrize("tool_choice", FORCED)
def test_a_forced_call_cut_anywhere_leaks_no_markup(tool_choice):
    """Every prefix of a forced call (the grammar admits only markup): no content at all; a
    call once its header is whole, with the arguments completed before the cut."""
    header_end = CALL.index('">') + 2
    city_end = CALL.index("</city>") + len("</city>")
    for cut in range(1, len(CALL) + 1):
        result = MiniMaxM3ToolParser(TOOLS, tool_choice).extract(CALL[:cut])
        assert result.content is None, CALL[:cut]
        want = [] if cut < header_end else [("get_weather", {} if cut < city_end else {"city": "Paris"})]
        assert [(n, json.loads(a)) for n, a in named(result.tool_calls)] == want, CALL[:cut]
    check(CALL[:len(NS) - 3], None, [], tool_choice=tool_choice)    # a bit of the marker itself


def test_a_short_marker_tail_under_auto_stays_content():
    """Under "auto" only a tail holding the whole namespace marker (one token in M3's vocabulary)
    counts as markup: text that merely ends in `]` or `]<` keeps it."""
    check("see a[0]", "see a[0]", [])
    check("x ]<", "x ]<", [])


def test_enum_without_type_takes_the_type_of_its_values():
    tools = [tool("pick", {"n": {"enum": [1, 2, 3]}, "x": {"enum": [0.5, 1]}, "b": {"enum": [True, False]},
                           "s": {"enum": ["1", "2"]}, "m": {"enum": [1, "auto", None]}})]
    text = block(invoke("pick", el("n", "2"), el("x", "1"), el("b", "false"), el("s", "1"), el("m", "auto")),
                 invoke("pick", el("m", "3"), el("n", "null")))
    check(text, None, [("pick", {"n": 2, "x": 1, "b": False, "s": "1", "m": "auto"}),
                       ("pick", {"m": 3, "n": None})], tools=tools)


def test_inline_json_is_typed_by_the_nested_schema_as_elements_are():
    inline = '{"unit": 5, "level": "2"}'
    tags = '[1, "b", true]'
    items = '[{"sku": 7, "qty": "3"}]'
    text = block(invoke("get_weather", el("opts", inline), el("tags", tags)),
                 invoke("get_weather", el("opts", el("unit", "5") + el("level", "2")),
                        el("tags", el("item", "1") + el("item", "b") + el("item", "true"))),
                 invoke("create_order", el("items", items), el("matrix", '[["1", 2], ["-3.5"]]')))
    same = {"opts": {"unit": "5", "level": 2}, "tags": ["1", "b", "true"]}
    check(text, None, [("get_weather", same), ("get_weather", same),
                       ("create_order", {"items": [{"sku": "7", "qty": 3}], "matrix": [[1, 2], [-3.5]]})])


def test_a_value_failing_its_type_is_json_decoded_then_kept_raw():
    text = block(invoke("get_weather", el("days", "[1, 2]"), el("metric", '{"a": 1}'), el("ratio", '"0.5"'),
                        el("days", "3.5")),
                 invoke("get_weather", el("days", "three"), el("metric", "maybe"), el("opts", "[1]")))
    check(text, None, [("get_weather", {"days": [[1, 2], 3.5], "metric": {"a": 1}, "ratio": "0.5"}),
                       ("get_weather", {"days": "three", "metric": "maybe", "opts": [1]})])


def test_repeated_elements_mixed_text_and_no_tools_at_all():
    text = block(invoke("anything", el("tag", "a"), el("tag", "b"), el("tag", "c"), el("box", "hi " + el("n", "1"))))
    check(text, None, [("anything", {"tag": ["a", "b", "c"], "box": {"n": "1", "$text": "hi "}})], tools=None)


def test_parallel_calls_in_one_block_and_in_a_second_block():
    text = "Calling tools." + block(
        invoke("get_weather", el("city", "Oslo")),
        invoke("get_weather", el("city", "Rome"), quote="'"),
        invoke("ping", quote=""),
    ) + "\nbetween blocks is dropped\n" + block(invoke("create_order", el("user_id", "7")))
    check(text, "Calling tools.", [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
        ("ping", {}),
        ("create_order", {"user_id": 7}),
    ])


def test_text_after_tool_call_block_is_dropped():
    text = block(invoke("ping")) + " and then I said more </tool_call> stuff"
    check(text, None, [("ping", {})])


def test_malformed_element_keeps_earlier_params_and_later_calls():
    bad = f"{NS}<days>3{NS}</city>"  # closed with the wrong name
    text = "ok" + block(
        invoke("get_weather", el("city", "Paris"), bad, el("metric", "true")),
        invoke("get_weather", el("city", "Lima"), el("days", "5")),
    )
    check(text, "ok", [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lima", "days": 5}),
    ])


def test_stray_text_and_bad_headers_inside_the_block_do_not_break_the_stream():
    text = block(
        invoke("get_weather", el("city", "Paris"), "some words", el("days", "2")),
        f"{NS}<invoke>{el('city', 'X')}{NS}</invoke>\n",  # no name: no call
        "chatter between invokes\n",
        invoke("ping"),
    )
    check(text, None, [("get_weather", {"city": "Paris"}), ("ping", {})])


def test_missing_invoke_closer_ends_at_tool_call_closer():
    text = block(f"{NS}<invoke name=\"get_weather\">{el('city', 'Paris')}") + block(invoke("ping"))
    check(text, None, [("get_weather", {"city": "Paris"}), ("ping", {})])


def test_truncated_output_keeps_completed_parameters():
    text = "Sure." + f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n{el('city', 'Paris')}\n{NS}<days>1"
    check(text, "Sure.", [("get_weather", {"city": "Paris"})])


def nested(depth):
    """`depth` elements named n nested around the leaf text "x"."""
    text = "x"
    for _ in range(depth):
        text = el("n", text)
    return text


def test_nesting_depth_128_parses_and_129_is_malformed():
    args = json.loads(MiniMaxM3ToolParser(None).extract(block(invoke("f", nested(128)))).tool_calls[0]["function"]["arguments"])
    depth = 0
    while isinstance(args, dict):
        args, depth = args["n"], depth + 1
    assert (depth, args) == (128, "x")
    text = block(invoke("f", el("a", "1"), nested(129), el("b", "2")), invoke("g", el("c", "3")))
    result = MiniMaxM3ToolParser(None).extract(text)
    assert named(result.tool_calls) == [("f", '{"a": "1"}'), ("g", '{"c": "3"}')]   # no schemas: raw
    content, calls = run_stream(list(text), tools=None)  # every boundary is too slow for 8k chars
    assert content is None and named(calls) == named(result.tool_calls)


def test_mutated_markup_streams_like_extract():
    """Random insertions/deletions/truncations of valid markup: never raises, always valid JSON,
    and streaming in random chunks gives exactly the extract() result."""
    rng = random.Random(1234)
    base = "Hi. " + block(
        invoke("get_weather", el("city", "Paris"), el("opts", el("unit", "C")), el("tags", el("item", "a"))),
        invoke("ping"),
    ) + " tail" + block(invoke("create_order", el("user_id", "1")))
    noise = [NS, "<", ">", "</", "invoke", "tool_call", "city", " ", "\n", "x", '"', NS + "</invoke>", NS + "<tool_call>"]
    for _ in range(300):
        text = base
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text) + 1)
            op = rng.random()
            if op < 0.4:
                text = text[:i] + rng.choice(noise) + text[i:]
            elif op < 0.8:
                text = text[:i] + text[i + rng.randint(1, 15):]
            else:
                text = text[:i]
        result = MiniMaxM3ToolParser(TOOLS).extract(text)
        for _, arguments in named(result.tool_calls):
            assert isinstance(json.loads(arguments), dict)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40)))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        content, calls = run_stream(chunks)
        assert (content, named(calls)) == (result.content, named(result.tool_calls)), chunks


def test_plain_text_and_partial_markers_stay_content():
    check("no tools here, just ]<]minimax[>[ talk ]<]mini", "no tools here, just ]<]minimax[>[ talk ]<]mini", [])
    check("trailing space kept without a call  \n", "trailing space kept without a call  \n", [])


def test_tool_choice_none_leaves_markup_as_content():
    text = "hi" + block(invoke("ping"))
    check(text, text, [], tool_choice="none")


def test_required_and_named_tool_choice_parse_like_auto():
    text = block(invoke("ping"))
    check(text, None, [("ping", {})], tool_choice="required")
    check(text, None, [("ping", {})], tool_choice={"type": "function", "function": {"name": "ping"}})


def test_streamed_deltas_arrive_at_the_right_time():
    parser = MiniMaxM3ToolParser(TOOLS)
    assert parser.stream("Hi ").content == "Hi "  # content is verbatim, sent at once
    assert parser.stream(f"{NS}<tool_").content is None
    delta = parser.stream(f"call>\n{NS}<invoke name=\"ping\">")
    assert delta.content is None and [d["function"]["name"] for d in delta.tool_call_deltas] == ["ping"]
    assert parser.stream(el("x", "1")).tool_call_deltas == []  # arguments only at </invoke>
    delta = parser.stream(f"{NS}</invoke>")
    assert delta.tool_call_deltas == [{"index": 0, "function": {"arguments": '{"x": "1"}'}}]   # ping has no x
    assert parser.has_tool_calls


def test_bad_tool_choice_and_unknown_parser_raise():
    with pytest.raises(ValueError, match="tool_choice.*'sometimes'"):
        MiniMaxM3ToolParser(TOOLS, "sometimes")
    with pytest.raises(ValueError, match="tool_choice.*'nope'"):
        MiniMaxM3ToolParser(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        MiniMaxM3ToolParser([{"type": "function", "function": {}}])
    assert get_tool_parser("minimax_m3") is MiniMaxM3ToolParser
    with pytest.raises(ValueError, match="minimax_m3"):
        get_tool_parser("hermes")


def test_integer_past_pythons_digit_limit_stays_a_string():
    digits = "9" * 5000
    result = MiniMaxM3ToolParser(TOOLS).extract(block(invoke("get_weather", el("days", digits), el("extra", digits))))
    assert json.loads(result.tool_calls[0]["function"]["arguments"]) == {"days": digits, "extra": digits}
