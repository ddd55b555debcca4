"""The roofline's byte count and the prefill FLOP count against the parameter shapes of a real
model instance (the tiny checkpoint, whose dense/sparse and MLP/MoE layer kinds are mixed)."""
import pytest

from m3serve.bench.roofline import decode_step_bytes, prefill_flops
from m3serve.llm import LLM


@pytest.fixture(scope="module")
def model_and_cfg(tiny_dir):
    llm = LLM(model=str(tiny_dir))
    return llm.engine.worker.model, llm.engine.model_config


def _weights(model):
    """(bf16-read linear weights excluding experts and lm_head, expert weights, router, lm_head)"""
    linear = experts = router = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith("model.embed_tokens"):
            continue                                          # norms, biases, embeddings
        if name == "lm_head.weight":
            continue
        if name.endswith("mlp.gate.weight"):
            router += p.numel()
        elif ".experts." in name:
            experts += p.numel()
        else:
            linear += p.numel()
    return linear, experts, router, model.lm_head.weight.numel()


def test_decode_bytes_equal_the_model_weights(model_and_cfg):
    model, cfg = model_and_cfg
    linear, experts, router, lm_head = _weights(model)
    num_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    all_experts = [float(cfg.num_local_experts)] * num_moe
    assert decode_step_bytes(cfg, 1, 0, all_experts) == 2 * (linear + experts + lm_head) + 4 * router
    # fp8 weights: lm_head stays bf16, the router fp32
    assert decode_step_bytes(cfg, 1, 0, all_experts, weight_bytes=1.0) == (
        linear + experts + 2 * lm_head + 4 * router)
    # KV: a dense layer reads the whole context, a sparse one at most top-k blocks + index keys
    ctx = 5 * cfg.index_topk_blocks * cfg.index_block_size
    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    dense = sum(not cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    sparse = cfg.num_hidden_layers - dense
    want_kv = 3 * (dense * ctx * kv_token + sparse * (
        cfg.index_topk_blocks * cfg.index_block_size * kv_token + ctx * cfg.index_head_dim * 2))
    assert decode_step_bytes(cfg, 3, ctx, all_experts) - decode_step_bytes(cfg, 3, 0, all_experts) == want_kv


def test_prefill_flops_of_one_token(model_and_cfg):
    model, cfg = model_and_cfg
    linear, experts, router, lm_head = _weights(model)
    active_experts = experts * cfg.num_experts_per_tok // cfg.num_local_experts
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    attention = (cfg.num_hidden_layers * 4 * cfg.num_attention_heads * cfg.head_dim
                 + sparse * 2 * cfg.index_n_heads * cfg.index_head_dim)   # one (query, key) pair
    want = 2 * (linear + active_experts + router + lm_head) + attention
    assert prefill_flops(cfg, 1, 1) == want
    assert prefill_flops(cfg, 4, 1) == 4 * want
    # attention grows quadratically for dense layers, linearly past top-k blocks for sparse ones
    cap = cfg.index_topk_blocks * cfg.index_block_size
    growth = prefill_flops(cfg, 1, 2 * cap + 1) - prefill_flops(cfg, 1, 2 * cap)
    dense = cfg.num_hidden_layers - sparse
    assert growth == (2 * (linear + active_experts + router)
                      + dense * 4 * cfg.num_attention_heads * cfg.head_dim * (2 * cap + 1)
                      + sparse * (4 * cfg.num_attention_heads * cfg.head_dim * cap
                                  + 2 * cfg.index_n_heads * cfg.index_head_dim * (2 * cap + 1)))


def test_offline_points_that_did_not_run_as_asked_say_so():
    from m3serve.bench.offline import as_asked
    assert as_asked(64, 64, 90, 100) is None
    assert as_asked(64, None, 0, 0) is None                     # engine processes: unobserved
    assert "at most 9 of 64" in as_asked(64, 9, 0, 100)
    assert "only 10 of 100 steps" in as_asked(64, 64, 10, 100)


def test_expert_view_counts_its_share_of_the_routed_rows(tiny_dir):
    """One rank's view of EP over 4 ranks: the routed FLOPs are a quarter of the whole model's,
    everything else equal."""
    import dataclasses

    from m3serve.model.config import load_config
    cfg = load_config(tiny_dir)
    view = dataclasses.replace(cfg, expert_view=(0, 4))
    expert = 3 * cfg.hidden_size * cfg.intermediate_size
    num_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    routed = 2 * 10 * num_moe * cfg.num_experts_per_tok * expert      # 10 prompt tokens
    assert prefill_flops(cfg, 1, 10) - prefill_flops(view, 1, 10) == pytest.approx(routed * 3 / 4)
