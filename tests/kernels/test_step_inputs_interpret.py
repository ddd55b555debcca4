"""CPU interpreter tests of the per-step input kernels (decode positions and cache slots, rotary
cos/sin rows) against the PyTorch code they replace."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.step_inputs import decode_positions_slots, embedding_rows, rope_cos_sin  # noqa: E402
from m3serve.layers.dispatch import reference_ops  # noqa: E402
from m3serve.layers.rotary import RotaryEmbedding  # noqa: E402
from m3serve.layers.attention_metadata import positions_and_slots  # noqa: E402


def test_positions_and_slots_match_torch():
    g = torch.Generator().manual_seed(0)
    seq = torch.tensor([1, 16, 17, 300, 5], dtype=torch.int32)
    tables = torch.randperm(200, generator=g)[:5 * 20].view(5, 20).to(torch.int32)
    qsl = torch.arange(6, dtype=torch.int32)
    with reference_ops():
        ref_pos, ref_slots = positions_and_slots(qsl, seq, tables, 5, 16, True)
    pos, slots = decode_positions_slots(seq, tables[:, :], 16)
    assert pos.dtype == slots.dtype == torch.int64
    assert torch.equal(pos, ref_pos) and torch.equal(slots, ref_slots)
    assert slots[3].item() == tables[3, 299 // 16].item() * 16 + 299 % 16


@pytest.mark.parametrize("yarn_scale", [1.0, 1.25])
def test_cos_sin_match_torch(yarn_scale):
    rot = RotaryEmbedding(64, 5_000_000.0)
    rot.scale = yarn_scale
    positions = torch.tensor([0, 1, 7, 1023, 131071, 1048575])
    with reference_ops():
        ref = rot.cos_sin(positions, torch.float32)
    got = rope_cos_sin(positions, rot.inv_freq, yarn_scale, torch.float32)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    got16 = rope_cos_sin(positions, rot.inv_freq, yarn_scale, torch.bfloat16)
    assert got16[0].dtype == torch.bfloat16
    torch.testing.assert_close(got16[0].float(), ref[0], atol=2 ** -8 * yarn_scale, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_embedding_rows_equal_indexing(dtype, ids_dtype):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(50, 1300, generator=g).to(dtype)       # 1300: a masked second chunk
    ids = torch.tensor([0, 49, 7, 7, 23], dtype=ids_dtype)
    assert torch.equal(embedding_rows(ids, table), table[ids])
    assert embedding_rows(ids[:0], table).shape == (0, 1300)
    with pytest.raises(ValueError, match="embedding_rows needs"):
        embedding_rows(ids[None], table)
