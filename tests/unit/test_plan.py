"""`m3serve plan` for the real 60-layer MiniMax-M3: weights and KV bytes per GPU at TP 4 and TP 8
against numbers computed by hand from the parameter table (docs/model.md §10.1) and KV table (§5), and
the planner's per-rank counts against the shards the engine really builds (meta device)."""
import json

import pytest
import torch

from m3serve.bench.realshape import realshape_config_dict
from m3serve.config import ParallelConfig
from m3serve.model.config import parse_config
from m3serve.plan import GIB, H200_MEMORY_GIB, capacity, check_layout, plan

# docs/model.md §10.1, per component (parameters)
EMBED = LM_HEAD = 1_229_193_216
Q = O = 64 * 128 * 6144                       # q_proj, o_proj of one layer
K = V = 4 * 128 * 6144                        # k_proj, v_proj (4 KV heads)
assert Q + K + V + O == 106_954_752           # the table's attention row
INDEX_Q, INDEX_K = 4 * 128 * 6144, 128 * 6144
assert INDEX_Q + INDEX_K == 3_932_160
DENSE_MLP = 226_492_416
EXPERT = SHARED = 56_623_104
ROUTER = 786_560                              # fp32
NORMS = 773_376
assert EMBED + LM_HEAD + 60 * (Q + K + V + O) + 57 * (INDEX_Q + INDEX_K) + 3 * DENSE_MLP \
    + 57 * (128 * EXPERT + SHARED + ROUTER) + NORMS == 426_174_572_928     # total text


@pytest.fixture(scope="module")
def real():
    return parse_config(realshape_config_dict(60, dense_layers=3))


def hand_bf16_bytes(tp: int) -> int:
    """One rank's bf16 bytes: q/o/MLPs/experts/vocab split by TP (experts over TP without EP or
    with it: 1/TP either way), KV and index-query heads split until TP = 4 heads and replicated
    beyond, index-key head, router and norms replicated."""
    kv_share = 4 // tp if tp <= 4 else 1       # KV heads per rank
    attention = (Q + O) // tp + (K + V) * kv_share // 4
    indexer = INDEX_Q * kv_share // 4 + INDEX_K
    params = (EMBED + LM_HEAD) // tp + 60 * attention + 57 * indexer + 3 * DENSE_MLP // tp \
        + 57 * (128 * EXPERT + SHARED) // tp + NORMS
    return 2 * params + 4 * 57 * ROUTER


@pytest.mark.parametrize("tp,ep", [(4, False), (8, False), (8, True)])
def test_weights_per_gpu_bf16(real, tp, ep):
    p = plan(real, ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep))
    assert p.total_weight_bytes == hand_bf16_bytes(tp)


def test_weights_per_gpu_fp8_tp8(real):
    """FP8: every linear element one byte plus one fp32 scale per output row of this rank."""
    rows_attn = (8 + 2) * 128 + 6144                     # qkv rows (1 KV head each), o rows
    rows_index = 2 * 128                                  # index_q (1 head) + index_k
    rows_dense = 2 * 12288 // 8 + 6144
    rows_expert = 2 * 3072 // 8 + 6144
    scales = 4 * (60 * rows_attn + 57 * rows_index + 3 * rows_dense + 57 * (129 * rows_expert))
    elements = 60 * ((Q + O) // 8 + (K + V) // 4) + 57 * (INDEX_Q // 4 + INDEX_K) \
        + 3 * DENSE_MLP // 8 + 57 * (128 * EXPERT + SHARED) // 8
    bf16_kept = 2 * ((EMBED + LM_HEAD) // 8 + NORMS) + 4 * 57 * ROUTER
    p = plan(real, ParallelConfig(tensor_parallel_size=8), quantization="fp8")
    assert p.total_weight_bytes == elements + scales + bf16_kept


def test_kv_bytes_per_token(real):
    # docs/model.md §5: 137,472 B per token at TP 1 (bf16), 76,032 with an fp8 main cache and bf16 index
    assert plan(real, ParallelConfig()).total_kv_bytes_per_token == 137_472
    assert plan(real, ParallelConfig(), kv_cache_dtype="fp8").total_kv_bytes_per_token == 76_032
    # TP 4 and TP 8: one KV head per rank (replicated at TP 8), the index key head on every rank
    for tp in (4, 8):
        p = plan(real, ParallelConfig(tensor_parallel_size=tp))
        assert p.kv_bytes_per_token == {"main": 60 * 2 * 1 * 128 * 2, "index": 57 * 128 * 2}
        assert p.total_kv_bytes_per_token == 45_312


def test_flash_kv_bytes_count_an_index_cache_in_every_layer():
    from m3serve.model.known_configs import known_config
    flash = parse_config(known_config("MiniMaxAI/MiniMax-M3.1-Flash").load())
    # 60 MSA layers x (K+V 2 x 4 heads x 128 x 2 B + index key 128 x 2 B); 69,120 with both in fp8
    assert plan(flash, ParallelConfig()).total_kv_bytes_per_token == 138_240
    assert plan(flash, ParallelConfig(), kv_cache_dtype="fp8",
                index_cache_dtype="fp8").total_kv_bytes_per_token == 69_120
    # three more index layers than M3: 3 x 256 B per token more at every TP size
    assert plan(flash, ParallelConfig(tensor_parallel_size=8)).total_kv_bytes_per_token == 45_312 + 3 * 256


def test_capacity_on_h200s(real):
    mem = int(H200_MEMORY_GIB * GIB)
    p = plan(real, ParallelConfig(tensor_parallel_size=8))
    fit = capacity(p, real, mem, 0.9, 8192 + 1024 + 256, 128)
    budget = int(mem * 0.9) - hand_bf16_bytes(8) - (2 << 30)
    assert fit["kv_tokens"] == (budget // (45_312 * 128) - 1) * 128
    assert fit["concurrent_requests"] == (budget // (45_312 * 128) - 1) // 74     # 9472 tokens = 74 blocks
    tp4_bf16 = capacity(plan(real, ParallelConfig(tensor_parallel_size=4)), real, mem, 0.9, 9472, 128)
    assert not tp4_bf16["fits"] and tp4_bf16["kv_budget_bytes"] == 0   # 199 GiB of weights per GPU


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=3),
                                    dict(tensor_parallel_size=2, data_parallel_size=128, enable_expert_parallel=True)])
def test_impossible_layouts_name_the_numbers(real, kwargs):
    with pytest.raises(ValueError) as e:
        check_layout(real, ParallelConfig(**kwargs))
    msg = str(e.value)
    assert ("num_attention_heads=64" in msg and "tensor_parallel_size=3" in msg) or \
           ("num_local_experts=128" in msg and "256 ranks" in msg)


def _meta_bytes(cfg, tp: int, dp: int, ep: bool, rank: int, dp_rank: int) -> int:
    from m3serve.distributed import GroupInfo, ParallelInfo
    from m3serve.model.minimax_m3 import MiniMaxM3ForCausalLM

    parallel = ParallelInfo(GroupInfo(rank, tp), GroupInfo(dp_rank, dp), ep)
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(cfg, parallel, torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("tp,dp,ep", [(1, 1, False), (2, 1, False), (8, 1, False), (8, 1, True),
                                      (2, 2, True), (4, 2, False)])
def test_plan_equals_the_shards_the_engine_builds(tp, dp, ep):
    cfg = parse_config(realshape_config_dict(4))
    p = plan(cfg, ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep))
    for rank in {0, tp - 1}:
        assert _meta_bytes(cfg, tp, dp, ep, rank, dp - 1) == p.total_weight_bytes


def test_plan_command(tmp_path, capsys):
    from m3serve.bench.realshape import write_realshape_dir
    from m3serve.cli import main

    d = write_realshape_dir(tmp_path / "m3", 60, dense_layers=3)
    assert main(["plan", str(d), "-tp", "8", "--max-model-len", "9472", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights_per_gpu_bytes"] == hand_bf16_bytes(8)
    assert out["kv_bytes_per_token_per_gpu"] == 45_312 and out["fits"]
    assert main(["plan", str(d), "-tp", "4"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", str(d), "-tp", "3"]) == 2
    assert "num_attention_heads=64" in capsys.readouterr().err


def test_draft_kv_counted(real, tmp_path):
    """EAGLE3's own KV per token and GPU: MHA 2 x 64 x 128 x 2 B = 32 KiB at TP 1, GQA 2 KiB (16x
    less); at TP 8 the MHA head's 64 KV heads split to 8 a rank (4 KiB), the GQA head's 4 are
    replicated to 1 (512 B). MTP: a module's K/V + index key per token per draft step."""
    from m3serve.bench.realshape import write_realshape_dir
    from m3serve.plan import draft_kv
    from m3serve.distill.tiny_drafts import make_draft

    target = write_realshape_dir(tmp_path / "rs", 60, dense_layers=3)
    for kind, tp, want in (("eagle3", 1, 32768), ("eagle3-gqa", 1, 2048), ("eagle3", 8, 4096),
                           ("eagle3-gqa", 8, 512)):
        d = make_draft(tmp_path / f"{kind}{tp}", kind, target, weights=False)
        parallel = ParallelConfig(tensor_parallel_size=tp)
        spec = '{"method": "eagle3", "model": "%s", "num_speculative_tokens": 3}' % d
        p = plan(real, parallel, draft=draft_kv(spec, real, parallel))
        assert p.kv_bytes_per_token["draft"] == want, (kind, tp)
    mtp = plan(real, ParallelConfig(tensor_parallel_size=8),
               draft=draft_kv('{"method": "mtp", "num_speculative_tokens": 3}', real, ParallelConfig()))
    assert mtp.kv_bytes_per_token["draft"] == 3 * (2 * 1 * 128 * 2 + 128 * 2)
    # DSpark (the released 5 layers, 4 KV heads of 128, bf16 whatever the KV dtype): 10,240 B
    # per token at TP 1; at TP 8 the 4 KV heads are replicated to one a rank: 2,560 B. None of
    # it per context token: its own pool holds a window per running request -- the 4096-token
    # window, k = 7 (the draft's block size), 4096 + 2 x 7 - 1 = 4109 tokens span at most 34
    # blocks of 128; 64 requests: 64 x 34 + 1 (null) blocks, whatever max_model_len
    make_draft(target, "dspark", target, weights=False)
    mem = 4096 * GIB                                   # room for the TP 1 weights as well
    for tp, want in ((1, 10240), (8, 2560)):
        parallel = ParallelConfig(tensor_parallel_size=tp)
        p = plan(real, parallel, kv_cache_dtype="fp8",
                 draft=draft_kv('{"method": "dspark"}', real, parallel, str(target)))
        assert "draft" not in p.kv_bytes_per_token and p.draft_window["bytes_per_token"] == want, tp
        bare = plan(real, parallel, kv_cache_dtype="fp8")
        for max_len in (8192, 1 << 20):
            fit = capacity(p, real, mem, 0.9, max_len, 128, max_num_seqs=64)
            base = capacity(bare, real, mem, 0.9, max_len, 128, max_num_seqs=64)
            assert fit["draft_window_bytes"] == (64 * 34 + 1) * 128 * want
            assert base["kv_budget_bytes"] - fit["kv_budget_bytes"] == fit["draft_window_bytes"]


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4-modelopt", "nvfp4-ct", "mxfp4-quark"])
@pytest.mark.parametrize("tp,ep", [(2, False), (8, True)])
def test_plan_of_a_quantised_checkpoint_equals_the_packed_shards(fmt, tp, ep):
    """Codes, block scales and NVFP4's per-row global scales, as the engine packs them."""
    from m3serve.distributed import GroupInfo, ParallelInfo
    from m3serve.layers.linear import deferred_weights
    from m3serve.model.formats import quantizable_modules
    from m3serve.model.formats.layouts import packed_format_of
    from m3serve.model.loader import pack_model_
    from m3serve.model.minimax_m3 import MiniMaxM3ForCausalLM
    from m3serve.model.tiny import quantization_config
    from m3serve.plan import stored_formats

    raw = realshape_config_dict(4)
    raw["quantization_config"] = quantization_config(fmt, quantizable_modules(parse_config(raw)))
    cfg = parse_config(raw)
    format_of, note = stored_formats(raw)
    p = plan(cfg, ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep), format_of=format_of)
    from m3serve.model.formats import detect_scheme
    scheme = detect_scheme(raw)
    with torch.device("meta"), deferred_weights():
        model = MiniMaxM3ForCausalLM(cfg, ParallelInfo(GroupInfo(tp - 1, tp), enable_expert_parallel=ep), torch.bfloat16)
    pack_model_(model, cfg, lambda m: packed_format_of(scheme, m))
    built = sum(t.numel() * t.element_size() for t in model.parameters())
    assert built == p.total_weight_bytes
    assert built < 0.6 * plan(cfg, ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep)).total_weight_bytes


def test_layouts_that_cut_scale_blocks_are_refused_before_start(tiny_dir):
    """Online 4-bit experts of the tiny model (experts 32 wide) at TP 2: 16 per rank; the real
    MXFP8 release at TP 8 is fine (every split width a multiple of 32 per rank)."""
    from m3serve.llm import LLM
    from m3serve.model.formats import LAYOUT_FORMATS, detect_scheme
    from m3serve.model.known_configs import known_config

    with pytest.raises(ValueError, match=r"intermediate_size \(routed experts\)=32 split over 2 ranks is 16 per "
                                         r"rank, not a multiple of the mxfp4 scale block 32"):
        LLM(model=str(tiny_dir), tensor_parallel_size=2, quantization="mxfp4")
    raw = known_config("MiniMaxAI/MiniMax-M3-MXFP8").load()
    scheme = detect_scheme(raw)
    check_layout(parse_config(raw), ParallelConfig(tensor_parallel_size=8),
                 lambda m: LAYOUT_FORMATS[scheme.layout_of(m)] if scheme.layout_of(m) else None)
    with pytest.raises(ValueError, match=r"dense_intermediate_size=96 split over 2 ranks is 48 per rank, not a "
                                         r"multiple of the mxfp8 scale block 32"):
        check_layout(parse_config(json.loads((tiny_dir / "config.json").read_text())),
                     ParallelConfig(tensor_parallel_size=2), lambda m: "mxfp8")


@pytest.mark.parametrize("tp,ep", [(2, False), (8, True)])
def test_online_mxfp8_plan_equals_the_mxfp8_release(tp, ep):
    """`--quantization mxfp8` quantises the modules the MXFP8 release does (every linear layer
    and the experts), so its plan equals that checkpoint layout's, which the test above holds
    to the engine's packed shards."""
    from m3serve.plan import stored_formats

    raw = realshape_config_dict(4)
    cfg = parse_config(raw)
    par = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep)
    raw["quantization_config"] = {"quant_method": "mxfp8",     # the release's exclusions
                                  "ignored_layers": ["lm_head", "*block_sparse_moe.gate"]}
    format_of, _ = stored_formats(raw)
    online = plan(cfg, par, quantization="mxfp8")
    assert online.weight_bytes == plan(cfg, par, format_of=format_of).weight_bytes
    assert online.weight_bytes["lm_head"] == plan(cfg, par).weight_bytes["lm_head"]   # stays bf16
