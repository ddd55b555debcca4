"""Quantised checkpoints over several gloo CPU ranks: packed weights and scales sharded by TP
(rows, and K columns of row-parallel layers and expert w2) and whole experts under EP give
the dense reference's greedy tokens on the dequantised weights, like one rank does
(tests/model/test_quant_e2e.py)."""
import pytest

from m3serve.llm import LLM
from m3serve.model.formats.layouts import dequantized_checkpoint
from test_quant_e2e import assert_reference_greedy, serve


@pytest.mark.parametrize("fmt,flags", [("nvfp4-modelopt", dict(tensor_parallel_size=2)),
                                       ("mxfp4-quark", dict(tensor_parallel_size=2, enable_expert_parallel=True))],
                         ids=["tp2-nvfp4-modelopt", "ep2-mxfp4-quark"])
def test_parallel_greedy_equals_reference(quant_dir, fmt, flags):
    path = quant_dir(fmt)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, **flags)
    try:
        assert llm.engine.core is None              # the ranks run in their own processes
        served = serve(llm)
        cfg = llm.engine.model_config
    finally:
        llm.shutdown()
    assert_reference_greedy(dequantized_checkpoint(path), cfg, served)
