"""The per-step input kernels on a GPU give exactly what the PyTorch code gives: positions and
slots of decode steps, and rotary cos/sin rows (bf16, the real rotary width) up to 1M positions."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_positions_and_slots_exact():
    from m3serve.kernels.step_inputs import decode_positions_slots
    from m3serve.layers.dispatch import reference_ops
    from m3serve.layers.attention_metadata import positions_and_slots
    R = 300
    seq = torch.randint(1, 9000, (R,), device="cuda", dtype=torch.int32)
    tables = torch.randint(0, 60000, (R, 80), device="cuda", dtype=torch.int32)
    qsl = torch.arange(R + 1, device="cuda", dtype=torch.int32)
    with reference_ops():
        ref = positions_and_slots(qsl, seq, tables, R, 128, True)
    got = decode_positions_slots(seq, tables, 128)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_cos_sin_exact(scale):
    from m3serve.layers.dispatch import reference_ops
    from m3serve.layers.rotary import RotaryEmbedding
    rot = RotaryEmbedding(64, 5_000_000.0).cuda()
    rot.scale = scale
    positions = torch.cat([torch.arange(4096, device="cuda"),
                           torch.randint(0, 1 << 20, (4096,), device="cuda")])
    with reference_ops():
        ref = rot.cos_sin(positions, torch.bfloat16)
    got = rot.cos_sin(positions, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [1, 8, 4096])
def test_embedding_rows_exact(ids_dtype, num_tokens):
    from m3serve.kernels.step_inputs import embedding_rows
    table = torch.randn(200064, 6144, device="cuda").bfloat16()
    ids = torch.randint(0, 200064, (num_tokens,), device="cuda", dtype=ids_dtype)
    ids[0] = 200063
    assert torch.equal(embedding_rows(ids, table), table[ids])
