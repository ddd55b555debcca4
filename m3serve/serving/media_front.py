"""The API process's side of images and video: a request's media parts fetched, decoded and
preprocessed on a small thread pool of their own (never on the event loop, never on the
tokenizer thread), the prompt's markers expanded, and the engine inputs built.

Bad media is a ValueError naming the part (`messages[0].content[2]: corrupt or truncated
image ...`), which the server answers with a 400.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from m3serve.multimodal.markers import MARKERS
from m3serve.multimodal.media import MediaPolicy
from m3serve.multimodal.parts import MediaPart, collect_media_parts


class MediaFront:
    def __init__(self, tokenizer, policy: MediaPolicy, limits: dict[str, int],
                 processor_kwargs: dict | None = None, max_workers: int = 4, refusal: str = "",
                 base_settings: dict | None = None):
        self.tokenizer, self.policy, self.limits = tokenizer, policy, limits
        self.refusal = refusal          # the engine's reason to refuse media ("": accepted)
        self.processor_kwargs = processor_kwargs
        self.base_settings = base_settings  # the checkpoint's processor configuration (None: defaults)
        self._options = None
        self._markers = tuple(i for i in (tokenizer.token_to_id(m) for m in MARKERS.values()) if i is not None)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="m3serve-media")

    def options(self, request_kwargs: dict | None):
        from m3serve.multimodal.processor import ProcessorOptions
        if self._options is None:
            base = ProcessorOptions(**self.base_settings) if self.base_settings else None
            self._options = ProcessorOptions.from_kwargs(self.processor_kwargs, base)
        return ProcessorOptions.from_kwargs(request_kwargs, self._options)

    def _prepare(self, parts: list[MediaPart], ids: list[int], request_kwargs: dict | None):
        from m3serve.multimodal.inputs import expand_prompt, media_token_ids, to_engine_input
        from m3serve.multimodal.parts import resolve_parts
        items = resolve_parts(parts, self.policy, self.options(request_kwargs), self.limits)
        marker_ids = media_token_ids(self.tokenizer.token_to_id)
        expanded = expand_prompt(ids, items, marker_ids, self.tokenizer)
        return expanded, [to_engine_input(x) for x in items]

    async def prepare(self, messages, ids: list[int], request_kwargs: dict | None = None):
        """(prompt ids with placeholder spans, engine inputs or None) for a rendered chat."""
        parts = collect_media_parts(messages)
        if parts and self.refusal:      # refused before fetching, and by count_tokens as by create
            raise ValueError(f"{parts[0].where}: {self.refusal}")
        if not parts:
            if self._markers:           # a scan of the whole prompt: off the event loop too
                await asyncio.get_running_loop().run_in_executor(self._pool, self._check_no_markers, ids)
            return ids, None
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(self._prepare, parts, ids, request_kwargs))

    def _check_no_markers(self, ids: list[int]) -> None:
        if any(t in ids for t in self._markers):
            raise ValueError(f"the prompt holds a {MARKERS['image']} or {MARKERS['video']} marker "
                             f"but no image or video part")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
