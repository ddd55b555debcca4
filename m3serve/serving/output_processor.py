"""Turns engine-core outputs (token ids) into user-facing outputs: incremental text, stop
strings (which end the request and free its blocks), logprobs with decoded tokens, and the
fan-in of n > 1 child sequences into one `RequestOutput`. Shared by the offline `LLM` and the
API server.
"""
from __future__ import annotations

import math
import time

from tokenizers import Tokenizer

from m3serve.core.scheduler_output import EngineCoreOutput
from m3serve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from m3serve.protocol import EngineCoreRequest
from m3serve.sampling_params import SamplingParams
from m3serve.serving.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


def to_position_logprobs(entry, tokenizer: Tokenizer) -> PositionLogprobs:
    """(token, logprob, rank, top ids, top logprobs) -> {token id: Logprob}, chosen token first."""
    token, lp, rank, top_ids, top_lps = entry
    out = {token: Logprob(lp, rank, tokenizer.decode([token], skip_special_tokens=False))}
    for r, (t, v) in enumerate(zip(top_ids, top_lps), start=1):
        if t not in out:
            out[t] = Logprob(v, r, tokenizer.decode([t], skip_special_tokens=False))
    return out


class SequenceState:
    """One generated sequence (one child of a request) as the front end tracks it."""

    def __init__(self, request_id: str, index: int, params: SamplingParams, tokenizer: Tokenizer,
                 prompt_token_ids: list[int]):
        self.request_id, self.index, self.params, self.tokenizer = request_id, index, params, tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None   # a prefill held for a decode worker
        self.sent = 0  # characters of `text` already streamed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply one engine output (one token, or an accepted run of several). Returns True
        when a stop string ended the sequence here (the caller must then abort it in the
        engine core); tokens after the one that completed the stop string are dropped, so a
        run cuts exactly where one-token-at-a-time decoding would."""
        self.num_cached_tokens = out.num_cached_tokens
        if getattr(out, "kv_transfer_params", None):
            self.kv_transfer_params = out.kv_transfer_params
        if out.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(to_position_logprobs(e, self.tokenizer) for e in out.new_prompt_logprobs)
        stops = self.params.stop
        tokens = out.new_token_ids
        # one token at a time when a stop string could end the run inside it
        pieces = [[t] for t in tokens] if stops and len(tokens) > 1 else [tokens]
        for n, piece in enumerate(pieces):
            self.token_ids.extend(piece)
            if out.new_logprobs and self.logprobs is not None:
                for entry in out.new_logprobs[n:n + len(piece)] if len(pieces) > 1 else out.new_logprobs:
                    self.logprobs.append(to_position_logprobs(entry, self.tokenizer))
                    self.cumulative_logprob += entry[1]
            checked = len(self.text)
            self.text += self.detok.add_tokens(piece)
            last = n == len(pieces) - 1
            if out.finished and last:
                self.text += self.detok.finish()
            if stops:
                at = find_stop(self.text, stops, checked)
                if at is not None:
                    matched = next(s for s in stops if self.text.startswith(s, at))
                    end = at + len(matched) if self.params.include_stop_str_in_output else at
                    self.text = self.text[:end]
                    self.finish_reason, self.stop_reason = "stop", matched
                    return not (out.finished and last)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def text_delta(self) -> str:
        """Visible text not streamed yet; a tail that may still become a stop string waits."""
        hold = 0 if self.finished or not self.params.stop else stop_holdback(self.text, self.params.stop)
        end = max(self.sent, len(self.text) - hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def completion(self) -> CompletionOutput:
        cum = self.cumulative_logprob
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.token_ids),
            cumulative_logprob=None if cum is None or math.isnan(cum) else cum,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class RequestState:
    """A user request: prompt plus its n sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.sequences = [SequenceState(child_request_id(request_id, i, params.n), i,
                                        params.for_child(i) if params.n > 1 else params,
                                        tokenizer, prompt_token_ids) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def engine_requests(self, eos_token_id: int | None, cache_salt: str | None = None,
                        kv_transfer_params=None, mm_inputs=None) -> list[EngineCoreRequest]:
        """The n fan-out: one engine request per sequence (its child id and params), each
        stopping at the model's EOS token unless it ignores EOS."""
        requests = []
        for seq in self.sequences:
            if eos_token_id is not None:
                seq.params.add_eos_token_ids([eos_token_id])
            requests.append(EngineCoreRequest(seq.request_id, self.prompt_token_ids, seq.params, eos_token_id,
                                              time.time(), cache_salt, kv_transfer_params, mm_inputs))
        return requests

    def output(self) -> RequestOutput:
        first = self.sequences[0]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs, outputs=[s.completion() for s in self.sequences],
            finished=self.finished, num_cached_tokens=first.num_cached_tokens)
