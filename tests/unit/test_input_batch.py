"""The worker's persistent input batch: a row refused on the way in leaves no trace."""
import pytest
import torch

from m3serve.sampling_params import SamplingParams
from m3serve.worker.input_batch import InputBatch


def test_a_refused_row_leaves_the_batch_consistent():
    batch = InputBatch(max_model_len=32, block_size=4, device=torch.device("cpu"), capacity=2)
    batch.add("a", [1, 2, 3], SamplingParams(max_tokens=2), [0], 0)
    with pytest.raises(RuntimeError, match="9 blocks exceed the 8"):
        batch.add("b", [4, 5], SamplingParams(max_tokens=2), list(range(1, 10)), 0)
    assert batch.req_ids == ["a"] and "b" not in batch.index
    batch.remove("a")                # the row of the refused request must not be half there
    assert batch.num_rows == 0
    batch.add("c", [6], SamplingParams(max_tokens=2), [3], 0)
    assert batch.index == {"c": 0}
