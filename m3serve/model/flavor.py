"""The model flavors m3serve serves and which one a config is.

- "m3": MiniMax-M3. Dense GQA attention in the leading layers (0-2 in the release), MSA (indexer +
  block-sparse attention) after; an index cache only for the MSA layers.
- "m3.1-flash": MiniMax-M3.1-Flash. MSA in every layer, so index projections and an index cache
  in the dense-MLP layers too; otherwise the M3 architecture.

The flavor follows from the layer schedule alone (every layer sparse: M3.1-Flash). Some M3.1 facts
were never read from a released config.json (the sparse init block: 0 in M3, 1 in a third-party
fixture; the experts per token: 4 in a preview config, 8 in a fixture). For that flavor
`check_m31_flash` wants each of them written in the config, not defaulted, and with one of the
reported values, and says which key holds what otherwise; the engine then runs whatever the
config says.
"""
from __future__ import annotations

M3 = "m3"
M31_FLASH = "m3.1-flash"
FLAVORS = (M3, M31_FLASH)

# legacy key in sparse_attention_config -> transformers' flat key
_INDEX_KEYS = {"sparse_init_block": "index_init_blocks", "sparse_topk_blocks": "index_topk_blocks",
               "sparse_block_size": "index_block_size", "sparse_num_index_heads": "index_n_heads",
               "sparse_index_dim": "index_head_dim", "sparse_local_block": "index_local_blocks"}

# values reported for M3.1-Flash that no released config.json confirmed: key -> accepted values
_REPORTED = {"sparse_init_block": (0, 1)}
# the same at the released size (hidden 6144, 60 layers, 128 experts), where the fixtures and the
# preview config describe the real model; a tiny test model may pick any width
_REPORTED_FULL_SIZE = {"num_experts_per_tok": (4, 8), "sparse_topk_blocks": (16,), "sparse_block_size": (128,),
                       "sparse_num_index_heads": (4,), "sparse_index_dim": (128,), "sparse_local_block": (1,)}


def flavor_of(sparse_layers: list[bool]) -> str:
    """"m3.1-flash" when every layer is an MSA layer, else "m3"."""
    return M31_FLASH if sparse_layers and all(sparse_layers) else M3


def _given(text: dict, sparse_cfg: dict, key: str):
    """(where the config gives `key`, its value) or (None, None)."""
    if key in sparse_cfg:
        return f"sparse_attention_config.{key}", sparse_cfg[key]
    flat = _INDEX_KEYS.get(key)
    if flat is not None and flat in text:
        return flat, text[flat]
    if key in text:
        return key, text[key]
    return None, None


def is_full_size(text: dict) -> bool:
    return (text.get("hidden_size"), text.get("num_hidden_layers"),
            text.get("num_local_experts", text.get("num_experts"))) == (6144, 60, 128)


def check_m31_flash(text: dict, sparse_cfg: dict) -> None:
    """ValueError naming the key and value when an M3.1-Flash config leaves out, or sets to a
    value nobody reported, a fact that is not confirmed against the released config.json."""
    checks = dict(_REPORTED)
    if is_full_size(text):
        checks.update(_REPORTED_FULL_SIZE)
    for key in ("sparse_init_block", "sparse_topk_blocks", "num_experts_per_tok", *checks):
        where, value = _given(text, sparse_cfg, key)
        if where is None:
            flat = f" (or {_INDEX_KEYS[key]})" if key in _INDEX_KEYS else ""
            place = "sparse_attention_config." if key.startswith("sparse_") else ""
            raise ValueError(f"MiniMax-M3.1-Flash config (MSA in every layer): {place}{key}{flat} is missing; "
                             f"its value is not confirmed for this model, so m3serve reads it from the "
                             f"checkpoint's config.json instead of assuming one")
        accepted = checks.get(key)
        if accepted is not None and (isinstance(value, bool) or value not in accepted):
            raise ValueError(f"MiniMax-M3.1-Flash config: {where}={value!r} is not a known layout "
                             f"(reported values: {', '.join(map(str, accepted))}); m3serve does not "
                             f"guess what another value means for this model")
