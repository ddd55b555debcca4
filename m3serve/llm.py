"""The offline API, shaped like vLLM's: `LLM(model=..., **engine_flags).generate(prompts, params)`
and `.chat(messages, params)`, running the engine core in-process.
"""
from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

from tokenizers import Tokenizer
from tqdm import tqdm

from m3serve.config import EngineConfig
from m3serve.core.engine_core import EngineCore
from m3serve.core.request import Request
from m3serve.model.loader import resolve_model_dir
from m3serve.outputs import RequestOutput
from m3serve.sampling_params import SamplingParams
from m3serve.serving.chat_template import load_chat_template, render_chat
from m3serve.serving.output_processor import RequestState
from m3serve.worker.worker import Worker

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {model_dir}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"{path}: unreadable tokenizer ({e})") from None


def model_directory(model: str | None) -> Path:
    """The checkpoint directory for `model` (None = the embedded tiny model)."""
    if model is None:
        from m3serve.model.tiny import default_model_dir
        return default_model_dir()
    return resolve_model_dir(model)


class LLMEngine:
    """Engine core + tokenizer + output processing, stepped synchronously."""

    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        self.model_dir = model_directory(config.model.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.worker = Worker(config, self.model_dir, progress=progress)
        self.model_config = self.worker.model_config
        self.core = EngineCore(config, self.worker)
        self.eos_token_id = self.model_config.eos_token_id
        self.states: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, int]] = {}

    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A string or {"prompt_token_ids": [...]} (or {"prompt": "..."}) -> (text, ids)."""
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt).ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {vocab})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"]).ids
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams, cache_salt: str | None = None) -> RequestState:
        text, ids = self.encode_prompt(prompt)
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        state = RequestState(request_id, text, ids, params, self.tokenizer)
        added = []
        try:
            for seq in state.sequences:
                if self.eos_token_id is not None:
                    seq.params.add_eos_token_ids([self.eos_token_id])
                self.core.add_request(Request(seq.request_id, ids, seq.params, self.eos_token_id,
                                              arrival_time=time.time(), cache_salt=cache_salt))
                added.append(seq.request_id)
        except ValueError:
            self.core.abort_requests(added)
            raise
        self.states[request_id] = state
        for i, seq in enumerate(state.sequences):
            self._children[seq.request_id] = (state, i)
        return state

    def abort_request(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is None:
            return
        ids = [s.request_id for s in state.sequences]
        for i in ids:
            self._children.pop(i, None)
        self.core.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestState]:
        """Run one engine step; returns the requests that changed (finished ones are dropped)."""
        touched: dict[str, RequestState] = {}
        stopped = []
        for out in self.core.step():
            entry = self._children.get(out.request_id)
            if entry is None:
                continue
            state, i = entry
            seq = state.sequences[i]
            if seq.update(out):
                stopped.append(seq.request_id)
            touched[state.request_id] = state
        if stopped:
            self.core.abort_requests(stopped)
        for rid, state in touched.items():
            if state.finished:
                self.states.pop(rid, None)
                for seq in state.sequences:
                    self._children.pop(seq.request_id, None)
        return list(touched.values())


class LLM:
    """Offline batched generation. Every engine flag of the CLI is accepted as a keyword
    (`max_num_seqs=8`, `enable_prefix_caching=False`, `kv_cache_memory=1 << 28`, ...)."""

    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_flags):
        config = EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_flags)
        self.engine = LLMEngine(config)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = uuid.uuid4().hex
                self.engine.add_request(rid, prompt, p.clone())
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while len(done) < len(ids) and self.engine.has_unfinished_requests():
            for state in self.engine.step():
                if state.finished and state.request_id not in done:
                    done[state.request_id] = state.output()
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of messages) or several (a list of lists)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = load_chat_template(self.engine.model_dir)
        prompts = [render_chat(template, conv, tools=tools, add_generation_prompt=add_generation_prompt,
                               chat_template_kwargs=chat_template_kwargs) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
