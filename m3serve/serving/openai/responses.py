"""`POST /v1/responses` (OpenAI's Responses API) and `GET /v1/responses/{id}`.

The Responses dialect of a chat turn: a request becomes a chat request (`responses_input`), whose
turn the chat dialect prepares; the turn's typed deltas become Responses output items
(reasoning, message, function_call), returned whole or streamed as Responses events with
sequence numbers. Reasoning can travel back signed (`encrypted_content`) so thinking continues
across turns without server state; with --enable-response-store, `previous_response_id` continues
a stored conversation.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from m3serve.engine.errors import EngineDeadError, RequestFailed
from m3serve.serving.chat_template import EFFORT_TO_THINKING_MODE, REASONING_EFFORTS
from m3serve.serving.chat_turn import ChatTurn
from m3serve.serving.context import ServerContext, collect
from m3serve.serving.errors import APIError, internal_error
from m3serve.serving.openai import chat as chat_api
from m3serve.serving.openai.protocol import ChatCompletionRequest
from m3serve.serving.openai.responses_input import (ResponseStore,
                                                    chat_tool_choice, chat_tools, input_messages,
                                                    output_messages, response_format)
from m3serve.serving.openai.responses_protocol import KNOWN_INCLUDES, ResponsesRequest
from m3serve.serving.output_parsers import combine
from m3serve.serving.request_body import validation_message
from m3serve.serving.sampling import shared_fields
from m3serve.serving.signing import ReasoningSigner

STORE_FLAG = "--enable-response-store"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The response's output items, built from parsed deltas; each call returns the stream
    events it causes (a non-streaming response ignores them). One item is open at a time: a
    delta of another kind closes it."""

    def __init__(self, events: "_Events", sign, namespaces: dict[str, str] | None = None,
                 summary: bool = False):
        self.items: list[dict] = []
        self.events = events
        self.sign = sign            # reasoning text -> encrypted_content, or None
        self.namespaces = namespaces or {}      # function name -> the namespace tool it came from
        self.summary = summary      # reasoning.summary asked for: the reasoning text is its summary too
        self._open: dict | None = None
        self._call_items: dict[int, dict] = {}     # tool parser's call index -> item

    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, item: dict, part: dict | None) -> list[str]:
        self.items.append(item)
        self._open = item
        shown = {**item, "content": []} if "content" in item else item
        out = [self.events("response.output_item.added", output_index=self._index(), item=shown)]
        if part is not None:
            out.append(self.events("response.content_part.added", output_index=self._index(),
                                   item_id=item["id"], content_index=0, part=part))
        return out

    def reasoning(self, text: str) -> list[str]:
        out = []
        if self._open is None or self._open["type"] != "reasoning":
            out += self.close()
            out += self._start({"id": _id("rs"), "type": "reasoning", "summary": [],
                                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"},
                               {"type": "reasoning_text", "text": ""})
        self._open["content"][0]["text"] += text
        out.append(self.events("response.reasoning_text.delta", output_index=self._index(),
                               item_id=self._open["id"], content_index=0, delta=text))
        return out

    def text(self, text: str) -> list[str]:
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self.close()
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._start({"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                                "content": [dict(part)]}, part)
        self._open["content"][0]["text"] += text
        out.append(self.events("response.output_text.delta", output_index=self._index(),
                               item_id=self._open["id"], content_index=0, delta=text, logprobs=[]))
        return out

    def call(self, delta: dict) -> list[str]:
        """A tool parser's call delta ({index, id?, function: {name?, arguments?}})."""
        out = []
        item = self._call_items.get(delta["index"])
        function = delta.get("function") or {}
        if item is None:
            out += self.close()
            name = function.get("name") or ""
            item = {"id": _id("fc"), "type": "function_call", "call_id": delta.get("id") or _id("call"),
                    "name": name, "arguments": "", "status": "in_progress"}
            if name in self.namespaces:
                item["namespace"] = self.namespaces[name]
            self._call_items[delta["index"]] = item
            out += self._start(item, None)
        pieces = function.get("arguments") or ""
        if pieces:
            item["arguments"] += pieces
            out.append(self.events("response.function_call_arguments.delta", output_index=self.items.index(item),
                                   item_id=item["id"], delta=pieces))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if self.sign is not None:
                item["encrypted_content"] = self.sign(text)
            out.append(self.events("response.reasoning_text.done", output_index=index, item_id=item["id"],
                                   content_index=0, text=text))
            out.append(self.events("response.content_part.done", output_index=index, item_id=item["id"],
                                   content_index=0, part=item["content"][0]))
            if self.summary:
                out += self._summary(item, index, text)
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.events("response.output_text.done", output_index=index, item_id=item["id"],
                                   content_index=0, text=part["text"], logprobs=[]))
            out.append(self.events("response.content_part.done", output_index=index, item_id=item["id"],
                                   content_index=0, part=part))
        else:
            item["arguments"] = item["arguments"] or "{}"
            out.append(self.events("response.function_call_arguments.done", output_index=index,
                                   item_id=item["id"], name=item["name"], arguments=item["arguments"]))
        out.append(self.events("response.output_item.done", output_index=index, item=item))
        return out

    def _summary(self, item: dict, index: int, text: str) -> list[str]:
        """The reasoning's summary part and its events (M3 writes no separate summary: the
        summary is the reasoning text, sent once the reasoning is complete)."""
        part = {"type": "summary_text", "text": text}
        item["summary"] = [part]
        where = {"output_index": index, "item_id": item["id"], "summary_index": 0}
        return [self.events("response.reasoning_summary_part.added", **where, part={**part, "text": ""}),
                self.events("response.reasoning_summary_text.delta", **where, delta=text),
                self.events("response.reasoning_summary_text.done", **where, text=text),
                self.events("response.reasoning_summary_part.done", **where, part=part)]

    def feed(self, reasoning: str | None, content: str | None, tool_calls: list[dict]) -> list[str]:
        """One step of the turn: its reasoning, content and tool-call deltas, in that order."""
        out = []
        if reasoning:
            out += self.reasoning(reasoning)
        if content:
            out += self.text(content)
        for call in tool_calls:
            out += self.call(call)
        return out


class _Events:
    """SSE framing of Responses events, numbered in order (`sequence_number`)."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class ResponsesAPI:
    """The endpoint's state: the signing key of reasoning blobs and the optional store."""

    def __init__(self, store: ResponseStore | None, signer: ReasoningSigner):
        self.store, self.signer = store, signer

    def retrieve(self, response_id: str) -> dict:
        found = self.store.get(response_id) if self.store is not None else None
        if found is None:
            why = "" if self.store is not None else f" (the response store is off: start the server with {STORE_FLAG})"
            raise APIError(404, f"Response with id '{response_id}' not found{why}.", "response_id")
        return found[0]

    def _prepare(self, ctx: ServerContext, request: ResponsesRequest):
        """(chat request, conversation messages without instructions) of a Responses request."""
        if request.background:
            raise APIError(400, "background: background responses are not supported", "background")
        if request.top_logprobs:
            raise APIError(400, "top_logprobs: output logprobs are not supported on /v1/responses", "top_logprobs")
        for i, value in enumerate(request.include or []):
            if value not in KNOWN_INCLUDES:
                raise APIError(400, f"include[{i}]: unknown value {value!r}", f"include[{i}]")
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise APIError(400, f"max_output_tokens must be >= 1, got {request.max_output_tokens}",
                           "max_output_tokens")
        prior: list[dict] = []
        if request.previous_response_id is not None:
            if self.store is None:
                raise APIError(400, f"previous_response_id needs the response store, which is off: start the "
                                    f"server with {STORE_FLAG} (or send the conversation in input)",
                               "previous_response_id")
            found = self.store.get(request.previous_response_id)
            if found is None:
                raise APIError(404, f"previous_response_id: response '{request.previous_response_id}' not found "
                                    f"(never stored, or evicted)", "previous_response_id")
            prior = found[1]
        if request.input is None and not prior:
            raise APIError(400, "input is required", "input")
        messages = prior + (input_messages(request.input, prior, self.signer) if request.input is not None else [])
        if not messages:
            raise APIError(400, "input must hold at least one item", "input")
        kwargs = dict(request.chat_template_kwargs or {})
        effort = request.reasoning.effort if request.reasoning else None
        if effort is not None and "thinking_mode" not in kwargs:
            kwargs["thinking_mode"] = EFFORT_TO_THINKING_MODE[effort]
        if effort in REASONING_EFFORTS and "reasoning_effort" not in kwargs:
            kwargs["reasoning_effort"] = effort      # M3.1's level of the same name
        fmt = response_format(request.text.format if request.text else None)
        if fmt is not None and kwargs.get("thinking_mode", ctx.default_chat_template_kwargs.get("thinking_mode")) \
                == "enabled":
            # the grammar holds from the first output token, so an opened thinking block would
            # hold the JSON and the answer would be empty
            why = f"reasoning.effort {effort!r}" if effort else "the thinking_mode"
            raise APIError(400, f"text.format: a structured output cannot follow forced thinking ({why} -> "
                                f"thinking_mode enabled); use reasoning.effort minimal, low or medium", "text.format")
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        tools, namespaces = chat_tools(request.tools)
        fields = {"model": request.model, "messages": system + messages, "max_tokens": request.max_output_tokens,
                  **shared_fields(request), "tools": tools or None,
                  "tool_choice": chat_tool_choice(request.tool_choice),
                  "response_format": fmt,
                  "chat_template_kwargs": kwargs, "cache_salt": request.cache_salt}
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            message, param = validation_message(e)
            raise APIError(400, message, param) from None
        return chat, messages, namespaces

    async def create(self, ctx: ServerContext, request: ResponsesRequest, arrival_time: float, is_disconnected):
        ctx.check_model(request.model)
        chat, messages, namespaces = self._prepare(ctx, request)
        turn = await chat_api.prepare(ctx, chat)
        max_tokens = turn.resolve_max_tokens(chat.max_tokens, "max_output_tokens")
        params = turn.sampling_params(chat.sampling_fields(None), max_tokens)
        if params.structured_outputs is not None:       # errors name the field this request used
            params.structured_outputs.source = ("text.format.schema" if params.structured_outputs.json is not None
                                                else "text.format")
        turn.constrain_tools(params)
        response_id = _id("resp")
        await turn.start(response_id, params, arrival_time, chat.cache_salt)
        tool_use = turn.request.tool_use
        sign = self.signer.sign if "reasoning.encrypted_content" in (request.include or []) else None
        summary = bool(request.reasoning and (request.reasoning.summary or request.reasoning.generate_summary))
        new_output = lambda events: _Output(events, sign, namespaces, summary)      # noqa: E731
        store = self.store is not None and request.store is not False
        base = self._body(ctx, request, response_id, turn.thinking_mode, store)
        if request.stream:
            return StreamingResponse(self._stream(ctx, base, turn, new_output, messages if store else None),
                                     media_type="text/event-stream")
        [state] = await collect([turn.stream], is_disconnected)
        [seq] = state.sequences
        output = new_output(lambda *a, **k: "")
        [parsers] = turn.parsers
        whole = parsers.whole(seq.text)
        output.feed(whole.reasoning, tool_use.visible_content(whole.content),
                    [{"index": i, "id": c["id"], "function": c["function"]} for i, c in enumerate(whole.tool_calls)])
        body = self._finish(ctx, base, output, state, seq, messages if store else None)
        return JSONResponse(body)

    def _body(self, ctx: ServerContext, request: ResponsesRequest, response_id: str, thinking_mode, store) -> dict:
        effort = request.reasoning.effort if request.reasoning else None
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "model": ctx.model_name,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": request.instructions, "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
            "temperature": request.temperature, "top_p": request.top_p,
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [], "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": effort, "summary": request.reasoning.summary if request.reasoning else None,
                          "thinking_mode": thinking_mode},
            "text": {"format": (request.text.format if request.text and request.text.format else {"type": "text"})},
            "truncation": request.truncation or "disabled", "store": store, "usage": None,
            "user": request.user}

    def _finish(self, ctx: ServerContext, base: dict, output: _Output, state, seq, messages) -> dict:
        incomplete = seq.finish_reason == "length"
        output.close("incomplete" if incomplete else "completed")
        reasoning = "".join(i["content"][0]["text"] for i in output.items if i["type"] == "reasoning")
        num_output = len(seq.token_ids)
        num_reasoning = min(num_output, len(ctx.engine.tokenizer.encode(reasoning, add_special_tokens=False).ids)
                            if reasoning else 0)
        body = {**base, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output.items,
                "usage": {"input_tokens": len(state.prompt_token_ids),
                          "input_tokens_details": {"cached_tokens": seq.num_cached_tokens},
                          "output_tokens": num_output,
                          "output_tokens_details": {"reasoning_tokens": num_reasoning},
                          "total_tokens": len(state.prompt_token_ids) + num_output}}
        if messages is not None:
            self.store.put(body["id"], body, messages + output_messages(output.items))
        return body

    async def _stream(self, ctx: ServerContext, base: dict, turn: ChatTurn, new_output, messages):
        events = _Events()
        output = new_output(events)
        yield events("response.created", response=base)
        yield events("response.in_progress", response=base)
        tool_use = turn.request.tool_use
        try:
            async for step in turn.steps(stream_interval=0):
                delta = combine(step.deltas)
                for event in output.feed(delta.reasoning, tool_use.visible_content(delta.content), delta.tool_calls):
                    yield event
            state = turn.state
            [seq] = state.sequences
            for event in output.close("incomplete" if seq.finish_reason == "length" else "completed"):
                yield event
            body = self._finish(ctx, base, output, state, seq, messages)
            yield events("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                         response=body)
        except Exception as e:      # the stream has begun: the failure is reported in it
            if isinstance(e, EngineDeadError):
                code, message = "server_error", str(e)
            elif isinstance(e, RequestFailed):
                code, message = "invalid_request", str(e)
            else:
                code, message = "server_error", internal_error(e)
            yield events("error", code=code, message=message, param=None)
            yield events("response.failed", response={**base, "status": "failed", "output": output.items,
                                                      "error": {"code": code, "message": message}})
