"""`POST /v1/completions`: one or several prompts (text or token ids), n choices each,
streamed as SSE chunks or returned whole, with OpenAI-shaped logprobs and usage.
"""
from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from m3serve.engine.errors import EngineError
from m3serve.serving.context import ServerContext, admit, collect, merge
from m3serve.serving.openai.common import SSE_DONE, engine_error_event, kv_transfer_field, sse, usage_block
from m3serve.serving.openai.logprobs import clamp_logprob, prompt_logprobs_field, top_entries
from m3serve.serving.openai.kv_transfer import resolve_kv_transfer
from m3serve.serving.openai.protocol import CompletionRequest
from m3serve.serving.output_processor import RequestState, SequenceState


MAX_PROMPTS = 1024     # prompts in one completions request


def prompts_of(ctx: ServerContext, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompt)} "
                         f"(send several requests)")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, ctx.engine.encode(p, request.add_special_tokens)))
        else:
            ctx.engine.check_token_ids(p)
            out.append((None, list(p)))
    return out


def _logprob_block(positions, token_ids, text_offset: int, k: int, decode=None) -> dict:
    """Completions-style logprobs of these positions. A position of None (the first prompt
    token, which nothing predicts) has its text from `decode` and null logprobs."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for position, token_id in zip(positions, token_ids):
        if position is None:
            text, logprob, entries = decode([token_id]), None, None
        else:
            chosen = position[token_id]
            text, logprob = chosen.decoded_token or "", clamp_logprob(chosen.logprob)
            entries = {text: logprob}
            for _, lp, t in top_entries(position, k):
                # distinct tokens can decode to one string (byte fragments): keep its best logprob
                entries[t] = max(lp, entries.get(t, lp))
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append(entries)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def _logprobs(seq: SequenceState, start: int, end: int, text_offset: int, k: int) -> dict:
    """Completions-style logprobs of output positions [start, end)."""
    return _logprob_block(seq.logprobs[start:end], seq.token_ids[start:end], text_offset, k)


def _echo_logprobs(ctx: ServerContext, state: RequestState, seq: SequenceState, k: int) -> dict:
    """echo with logprobs: the prompt tokens' logprobs (the first one null), as vLLM gives them."""
    decode = lambda ids: ctx.engine.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    positions = list(seq.prompt_logprobs or [None])
    positions += [None] * (len(state.prompt_token_ids) - len(positions))
    return _logprob_block(positions, state.prompt_token_ids, 0, k, decode)


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


async def create_completion(ctx: ServerContext, request: CompletionRequest, arrival_time: float,
                            is_disconnected):
    created = int(time.time())      # the response's (and each of its chunks')
    ctx.check_model(request.model)
    if request.echo and request.logprobs is not None and request.kv_transfer_params is not None:
        raise ValueError("echo with logprobs needs the prompt computed here: not with kv_transfer_params")
    if request.suffix:
        raise ValueError("suffix is not supported")
    if request.best_of is not None and request.best_of != request.n:
        raise ValueError(f"best_of must equal n ({request.n}) when set, got {request.best_of}")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = await ctx.engine.off_loop(prompts_of, ctx, request)     # long prompts: off the event loop
    kv = await resolve_kv_transfer(ctx, request.kv_transfer_params, [ids for _, ids in prompts], request.n)
    # echo: each choice's text starts with its prompt (token-id prompts are decoded)
    echoed = [(text if text is not None else ctx.engine.tokenizer.decode(ids, skip_special_tokens=False))
              if request.echo else "" for text, ids in prompts]
    streams = []
    for i, (text, ids) in enumerate(prompts):
        max_tokens = ctx.engine.resolve_max_tokens(len(ids), request.max_tokens)
        params = request.sampling_params(max_tokens, request.logprobs, ctx.engine.sampling_defaults)
        if request.echo and request.logprobs is not None:
            params.prompt_logprobs = max(request.logprobs, request.prompt_logprobs or 0)
        streams.append(ctx.engine.generate(f"{request_id}-{i}", text, ids, params, arrival_time,
                                           request.cache_salt, kv))
    ctx.engine.check_fan_out(len(prompts), request.n)     # after the params' own checks (n's range)
    streams = await admit(streams)
    header = {"id": request_id, "object": "text_completion", "created": created,
              "model": ctx.model_name}
    if request.stream:
        return StreamingResponse(_stream(ctx, header, request, streams, echoed),
                                 media_type="text/event-stream")
    ordered = await collect(streams, is_disconnected)
    choices = []
    for i, state in enumerate(ordered):
        prompt_field = prompt_logprobs_field(state, request.prompt_logprobs)   # shared by its n choices
        for seq in state.sequences:
            logprobs = None
            if request.logprobs is not None:
                logprobs = _logprobs(seq, 0, len(seq.token_ids), len(echoed[i]), request.logprobs)
                if request.echo:
                    logprobs = _joined(_echo_logprobs(ctx, state, seq, request.logprobs), logprobs)
            choices.append({
                "index": i * request.n + seq.index, "text": echoed[i] + seq.text, "logprobs": logprobs,
                "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                **prompt_field,
                **({"prompt_token_ids": state.prompt_token_ids, "token_ids": seq.token_ids}
                   if request.return_token_ids else {})})
    return JSONResponse({**header, "choices": choices, "usage": usage_block(ordered),
                         **kv_transfer_field(ordered, request.kv_transfer_params is not None)})


def _ids(request: CompletionRequest, state: RequestState, seq: SequenceState, start: int, end: int,
         first: bool) -> dict:
    """return_token_ids: a chunk's token ids, and the prompt's in a choice's first chunk."""
    if not request.return_token_ids:
        return {}
    return {**({"prompt_token_ids": state.prompt_token_ids} if first else {}), "token_ids": seq.token_ids[start:end]}


async def _stream(ctx: ServerContext, header: dict, request: CompletionRequest, streams, echoed: list[str]):
    stream_interval = ctx.stream_interval
    states: dict[int, RequestState] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    sent_chars: dict[tuple[int, int], int] = {}
    done: set[tuple[int, int]] = set()
    # echo: the prompts come first; with logprobs each one comes with its sequence's first output,
    # when the prompt's logprobs (computed by the prefill that samples that output) are all in
    echo_with_output = request.echo and request.logprobs is not None
    try:
        for index, text in enumerate(echoed):
            if text and not echo_with_output:
                for j in range(request.n):
                    yield sse({**header, "choices": [{"index": index * request.n + j, "text": text, "logprobs": None,
                                                      "finish_reason": None, "stop_reason": None}]})
        async for index, state in merge(streams):
            states[index] = state
            for seq in state.sequences:
                key = (index, seq.index)
                if key in done:
                    continue
                if echo_with_output and key not in sent_chars and (seq.token_ids or seq.finished):
                    sent_chars[key] = len(echoed[index])
                    yield sse({**header, "choices": [{
                        "index": index * request.n + seq.index, "text": echoed[index],
                        "logprobs": _echo_logprobs(ctx, state, seq, request.logprobs),
                        "finish_reason": None, "stop_reason": None, **_ids(request, state, seq, 0, 0, first=True)}]})
                start, end = sent_tokens.get(key, 0), len(seq.token_ids)
                if not seq.finished and end - start < stream_interval:
                    continue          # --stream-interval: the next chunk carries these tokens too
                delta = seq.text_delta()
                if not delta and start == end and not seq.finished:
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(seq, start, end, sent_chars.get(key, len(echoed[index])), request.logprobs)
                choice = {"index": index * request.n + seq.index, "text": delta, "logprobs": logprobs,
                          "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                          **_ids(request, state, seq, start, end, first=key not in sent_chars)}
                sent_tokens[key] = end
                sent_chars[key] = sent_chars.get(key, len(echoed[index])) + len(delta)
                extra = {}
                if seq.finished:
                    done.add(key)
                    extra = kv_transfer_field([state], request.kv_transfer_params is not None)
                yield sse({**header, "choices": [choice], **extra})
        if request.include_usage:
            yield sse({**header, "choices": [], "usage": usage_block([states[i] for i in sorted(states)])})
    except EngineError as e:
        yield engine_error_event(e)
    yield SSE_DONE
