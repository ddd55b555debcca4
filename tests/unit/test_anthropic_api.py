"""Messages API pieces that need no server: the block builder's streamed tool input and
whitespace handling, and API-key auth by `x-api-key` as well as `Authorization: Bearer`."""
import asyncio
import json

import httpx
from fastapi import FastAPI

from m3serve.serving.anthropic.blocks import BlockBuilder
from m3serve.serving.api_server import _BearerAuth
from m3serve.serving.output_parsers import OutputParsers

NS = "]<]minimax[>["
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}}]


def _run(text: str, chunk: int, tools=TOOLS, mode=None):
    builder = BlockBuilder(OutputParsers("minimax_m3", mode, "minimax_m3" if tools else None, tools,
                                         "auto" if tools else "none", open_arguments=True))
    events = []
    for start in range(0, len(text), chunk):
        events += builder.feed(text[start:start + chunk])
    events += builder.feed("", finished=True)
    return builder, events


def _input_pieces(events):
    return [e["delta"]["partial_json"] for e in events
            if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]


def test_tool_input_streams_one_piece_per_argument_and_parses_to_the_input():
    call = (f"{NS}<tool_call>\n{NS}<invoke name=\"f\">\n{NS}<a>1{NS}</a>\n{NS}<b>x y{NS}</b>\n"
            f"{NS}</invoke>\n{NS}</tool_call>")
    for chunk in (1, 5, len(call)):
        builder, events = _run(call, chunk)
        pieces = _input_pieces(events)
        [block] = builder.content
        assert block["input"] == {"a": 1, "b": "x y"}
        assert json.loads("".join(pieces)) == block["input"]
        if chunk < len(call):
            assert pieces[0] == '{"a": 1' and len(pieces) == 3     # a, b, then the closing brace


def test_each_argument_is_sent_as_soon_as_it_is_complete():
    call = (f"{NS}<tool_call>\n{NS}<invoke name=\"f\">\n{NS}<a>1{NS}</a>\n{NS}<b>x y{NS}</b>\n"
            f"{NS}</invoke>\n{NS}</tool_call>")
    builder = BlockBuilder(OutputParsers("minimax_m3", None, "minimax_m3", TOOLS, "auto", open_arguments=True))
    sent_at = {}
    for end in range(1, len(call) + 1):
        for piece in _input_pieces(builder.feed(call[end - 1])):
            sent_at[piece] = end
    assert sent_at['{"a": 1'] == call.index(f"{NS}</a>") + len(f"{NS}</a>")   # before b's tag begins
    assert sent_at[', "b": "x y"'] == call.index(f"{NS}</b>") + len(f"{NS}</b>")


def test_repeated_argument_still_parses_to_the_final_input():
    """A name repeated in the markup becomes a list at the call's close; what was streamed
    before must still parse to that final input."""
    call = (f"{NS}<tool_call>\n{NS}<invoke name=\"f\">\n{NS}<b>one{NS}</b>\n{NS}<a>2{NS}</a>\n"
            f"{NS}<b>two{NS}</b>\n{NS}</invoke>\n{NS}</tool_call>")
    builder, events = _run(call, 3)
    [block] = builder.content
    assert block["input"] == {"b": ["one", "two"], "a": 2}
    assert json.loads("".join(_input_pieces(events))) == block["input"]


def test_no_whitespace_only_text_blocks():
    call = f"{NS}<tool_call>\n{NS}<invoke name=\"f\">\n{NS}</invoke>\n{NS}</tool_call>"
    for text in (f"\n\n  {call}", f"<mm:think>hm</mm:think>\n\n{call}"):
        builder, events = _run(text, 2)
        assert [b["type"] for b in builder.content] == (["tool_use"] if text.startswith("\n") else
                                                         ["thinking", "tool_use"])
        assert builder.content[-1]["input"] == {}
        assert "".join(_input_pieces(events)) == "{}"
    builder, _ = _run("  Hello,\n  world \n", 3, tools=None)
    assert builder.content == [{"type": "text", "text": "Hello,\n  world"}]


def _auth_app():
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages():
        return {"ok": True}

    @app.get("/v1/models")
    async def models():
        return {"ok": True}
    app.add_middleware(_BearerAuth, api_key="sekret")
    return app


def test_api_key_by_bearer_or_x_api_key():
    async def check():
        transport = httpx.ASGITransport(app=_auth_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for headers in ({"x-api-key": "sekret"}, {"Authorization": "Bearer sekret"}):
                assert (await client.post("/v1/messages", headers=headers)).status_code == 200
                assert (await client.get("/v1/models", headers=headers)).status_code == 200
            for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "sekret"}):
                r = await client.post("/v1/messages", headers=headers)
                assert r.status_code == 401
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
            r = await client.get("/v1/models", headers={"x-api-key": "wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == 401     # OpenAI's shape there
    asyncio.run(check())


def test_draining_refusal_has_each_api_shape():
    from m3serve.serving.lifecycle import Drain

    drain = Drain(1.0, 1, client=None)
    drain.draining = True
    app = drain.middleware(_auth_app())

    async def check():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.post("/v1/messages")
            assert r.status_code == 503 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
            r = await client.post("/v1/chat/completions")
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
    asyncio.run(check())
