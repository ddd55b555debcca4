"""`kv_transfer_params` on the OpenAI endpoints (prefill/decode disaggregation).

A prefill leg (`do_remote_decode`) needs a KV producer; a decode leg (`do_remote_prefill`) a
KV consumer, the same prompt as the prefill leg (its `prompt_hash`), and KV the producer still
holds: the decode leg claims it over the producer's side channel before it is admitted, so
stale or foreign params are a 400 here rather than a wrong answer later. A producer that
cannot be reached is not the client's fault: the prompt is then computed here.
"""
from __future__ import annotations

import logging

from m3serve.disagg.messages import Claim
from m3serve.kv_transfer_params import KVTransferParams, parse_kv_transfer_params, prompt_hash
from m3serve.disagg.side_channel import SideChannelError, call_async

logger = logging.getLogger(__name__)


async def resolve_kv_transfer(ctx, raw, prompts: list[list[int]], n: int) -> KVTransferParams | None:
    """The request's params, checked (ValueError = a 400 naming the problem); None when the
    request asks for no transfer, or its producer is unreachable (computed here instead)."""
    params = parse_kv_transfer_params(raw)
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return None
    config = ctx.kv_transfer
    role = config.kv_role if config is not None else "none"
    if len(prompts) != 1:
        raise ValueError(f"kv_transfer_params needs exactly one prompt, got {len(prompts)}")
    if n != 1:
        raise ValueError(f"kv_transfer_params needs n = 1, got {n}")
    if params.do_remote_decode:
        if config is None or not config.is_producer:
            raise ValueError(f"kv_transfer_params.do_remote_decode: this server is not a KV producer "
                             f"(--kv-transfer-config kv_role: {role})")
        return params
    if config is None or not config.is_consumer:
        raise ValueError(f"kv_transfer_params.do_remote_prefill: this server is not a KV consumer "
                         f"(--kv-transfer-config kv_role: {role})")
    mine = prompt_hash(prompts[0])
    if params.prompt_hash is not None and params.prompt_hash != mine:
        raise ValueError("kv_transfer_params belong to another prompt (prompt_hash differs): the prefill "
                         "and decode legs must carry the same request, rendered and tokenized alike")
    claim = Claim(params.remote_engine_id, params.remote_request_id, params.remote_block_ids, mine)
    try:
        reply = await call_async(params.remote_address, claim, config.handshake_timeout)
    except SideChannelError as e:
        logger.warning("decode leg: %s; computing the prompt here", e)
        ctx.engine.metrics.kv_unreachable.inc()
        return None
    if not reply.ok:
        raise ValueError(f"kv_transfer_params are stale: {reply.error}")
    return params
