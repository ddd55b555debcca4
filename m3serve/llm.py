"""The offline API, shaped like vLLM's: `LLM(model=..., **engine_flags).generate(prompts, params)`
and `.chat(messages, params)`.

A one-rank engine runs in this process (engine core + uni-process executor). A multi-rank
engine (`tensor_parallel_size`, `data_parallel_size` > 1, or `distributed_executor_backend="mp"`)
runs as engine processes, one per DP replica, reached through `SyncEngineClient`; this process
then holds no model and no process group.
"""
from __future__ import annotations

import logging
import uuid

from tokenizers import Tokenizer
from tqdm import tqdm

from m3serve.config import EngineConfig
from m3serve.engine_args import build_engine_config
from m3serve.model.config import load_config
from m3serve.model.files import load_tokenizer, model_directory
from m3serve.outputs import RequestOutput
from m3serve.plan import check_checkpoint_layout
from m3serve.protocol import EngineState
from m3serve.sampling_defaults import describe, load_sampling_defaults
from m3serve.sampling_params import SamplingParams
from m3serve.serving.chat_template import load_chat_template, render_chat
from m3serve.serving.output_processor import RequestState

logger = logging.getLogger(__name__)


class LLMEngine:
    """Engine (in-process core, or engine processes) + tokenizer + output processing, stepped
    synchronously."""

    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        self.model_dir = model_directory(config.model.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        check_checkpoint_layout(self.model_dir, config.model, config.parallel)
        self.core = self.worker = self.client = None
        self._stopped = False
        if config.parallel.uses_processes:
            from m3serve.engine.core_client import engine_config_for_process
            from m3serve.engine.sync_client import SyncEngineClient
            self.client = SyncEngineClient(engine_config_for_process(config, self.model_dir))
            self.model_config = load_config(self.model_dir, config.model.hf_overrides)
            self.front = self.client
        else:
            from m3serve.engine.engine_core import EngineCore
            from m3serve.executor.uniproc import UniProcExecutor
            executor = UniProcExecutor(config, self.model_dir, progress=progress)
            self.core = self.front = EngineCore(config, executor)
            self.worker, self.model_config = executor.worker, self.core.geometry.model_config
        self.eos_token_id = self.model_config.eos_token_id
        from m3serve.multimodal.processor import ProcessorOptions
        from m3serve.multimodal.processor_config import load_processor_settings
        # the checkpoint's processor configuration, --mm-processor-kwargs on top
        self.mm_options = ProcessorOptions.from_kwargs(
            config.model.mm_processor_kwargs, ProcessorOptions(**load_processor_settings(self.model_dir)))
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

    def encode_media(self, prompt, ids: list[int]) -> tuple[list[int], list | None]:
        """A dict prompt's `multi_modal_data` (and `mm_processor_kwargs`): the prompt ids with
        each marker expanded to its placeholder span, and the engine inputs (None: no media)."""
        if not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
            return ids, None
        from m3serve.multimodal.inputs import (expand_prompt, media_token_ids, process_multi_modal_data,
                                               to_engine_input)
        from m3serve.multimodal.processor import ProcessorOptions
        options = ProcessorOptions.from_kwargs(prompt.get("mm_processor_kwargs"), self.mm_options)
        items = process_multi_modal_data(prompt["multi_modal_data"], options,
                                         self.config.model.limit_mm_per_prompt)
        marker_ids = media_token_ids(self.tokenizer.token_to_id)
        expanded = expand_prompt(ids, items, marker_ids, self.tokenizer)
        if len(expanded) > (self.config.model.max_model_len or self.model_config.max_position_embeddings):
            raise ValueError(f"the prompt with its images and videos is {len(expanded)} tokens, longer "
                             f"than the model's context")
        return expanded, [to_engine_input(x) for x in items]

    def add_request(self, request_id: str, prompt, params: SamplingParams, cache_salt: str | None = None,
                    defer_admission: bool = False) -> RequestState:
        """Submit one request; ValueError if it is refused. With engine processes,
        `defer_admission` leaves the verdict to `settle()` (one round trip for a batch)."""
        text, ids = self.encode_prompt(prompt)
        ids, mm_inputs = self.encode_media(prompt, ids)
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        state = RequestState(request_id, text, ids, params, self.tokenizer)
        self.front.add_requests(state.engine_requests(self.eos_token_id, cache_salt, mm_inputs=mm_inputs))
        if self.client is not None and not defer_admission:
            self.client.settle()
        self.states[request_id] = state
        for i, seq in enumerate(state.sequences):
            self._children[seq.request_id] = (state, i)
        return state

    def settle(self) -> None:
        """Verdicts of deferred admissions: ValueError for the first refused one."""
        if self.client is not None:
            self.client.settle()

    def abort_request(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is None:
            return
        ids = [s.request_id for s in state.sequences]
        for i in ids:
            self._children.pop(i, None)
        self.front.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.front.has_unfinished_requests()

    def step(self) -> list[RequestState]:
        """Run one engine step (in-process) or take the outputs that arrived (engine processes);
        returns the requests that changed (finished ones are dropped)."""
        touched: dict[str, RequestState] = {}
        stopped = []
        for out in self.front.step():
            if getattr(out, "finish_reason", None) == "error":
                if getattr(out, "error_is_client", False):      # e.g. its grammar did not compile
                    raise ValueError(f"request {out.request_id}: {out.error}")
                raise RuntimeError(f"the engine failed request {out.request_id}: {out.error}")
            entry = self._children.get(out.request_id)
            if entry is None:
                continue
            state, i = entry
            seq = state.sequences[i]
            if seq.update(out):
                stopped.append(seq.request_id)
            touched[state.request_id] = state
        if stopped:
            self.front.abort_requests(stopped)
        for rid, state in touched.items():
            if state.finished:
                self.states.pop(rid, None)
                for seq in state.sequences:
                    self._children.pop(seq.request_id, None)
        return list(touched.values())

    def engine_states(self) -> list[EngineState]:
        """Each DP replica's books and rank reports (what the engine processes answer to a
        `StateQuery`; built directly for the in-process engine)."""
        if self.client is not None:
            return self.client.states()
        core = self.core
        while ((core.scheduler.has_finished_requests() or core.scheduler.kv_transfer_is_urgent)
               and not core.scheduler.has_unfinished_requests()):
            core.step()                  # report finished requests to the worker (and finish the
                                         # copies to the CPU tier), as the next steps would
        return [core.state()]

    def shutdown(self) -> None:
        """Stop the engine processes, or the in-process engine's helpers (grammar compiles, the
        KV connector's transfer agent and its progress thread, the CPU tier's copies): a
        transfer agent left to interpreter exit can abort the process. Idempotent."""
        if self.client is not None:
            self.client.shutdown()
        elif self.core is not None and not self._stopped:
            self._stopped = True
            self.core.shutdown()
            self.core.executor.shutdown()


class LLM:
    """Offline batched generation. Every engine flag of the CLI is accepted as a keyword
    (`max_num_seqs=8`, `enable_prefix_caching=False`, `tensor_parallel_size=2`, ...)."""

    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_flags):
        config = build_engine_config(model=model, dtype=dtype, **engine_flags)
        self.engine = LLMEngine(config)
        self._sampling_defaults = load_sampling_defaults(config.generation, self.engine.model_dir)
        if self._sampling_defaults:
            logger.info(describe(self._sampling_defaults))

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` uses without params: the generation config's sampling values
        (`generation_config` / `override_generation_config`), else SamplingParams()."""
        return SamplingParams(**self._sampling_defaults)

    def shutdown(self) -> None:
        """Stop the engine processes of a multi-rank engine (nothing to do for one rank)."""
        self.engine.shutdown()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
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
                self.engine.add_request(rid, prompt, p.clone(), defer_admission=True)
                ids.append(rid)
            self.engine.settle()
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
             add_generation_prompt: bool = True, media_policy=None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several (a list of lists). Messages may hold
        `image_url` / `video_url` / `image_pil` parts; `media_policy` (`multimodal.media.
        MediaPolicy`) bounds fetching and decoding them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = load_chat_template(self.engine.model_dir)
        prompts = []
        for conv in conversations:
            text = render_chat(template, conv, tools=tools, add_generation_prompt=add_generation_prompt,
                               chat_template_kwargs=chat_template_kwargs)
            data = self._chat_media(conv, media_policy)
            prompts.append({"prompt": text, "multi_modal_data": data} if data else text)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_media(self, conversation, policy) -> dict:
        """`multi_modal_data` of a conversation's image / video parts, decoded (data: and
        http(s) URLs; file:// only under `policy.allowed_local_media_path`)."""
        from m3serve.multimodal.media import MediaPolicy, decode_image, decode_video, load_bytes
        from m3serve.multimodal.parts import collect_media_parts
        policy = policy or MediaPolicy()
        data: dict[str, list] = {}
        for part in collect_media_parts(conversation):
            try:
                if part.modality == "image":
                    value = part.source if not isinstance(part.source, str) else \
                        decode_image(load_bytes(part.source, "image", policy), policy)
                else:
                    frames, fps = decode_video(load_bytes(part.source, "video", policy), policy)
                    value = {"frames": frames, "fps": fps}
            except ValueError as e:
                raise ValueError(f"{part.where}: {e}") from None
            data.setdefault(part.modality, []).append(value)
        return data
