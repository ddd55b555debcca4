"""The worker's persistent input batch: a row refused on the way in leaves no trace; a window
draft's table rows follow their diffs."""
import numpy as np
import pytest
import torch

from m3serve.core.scheduler_output import DraftBlocks
from m3serve.sampling_params import SamplingParams
from m3serve.worker.attn_metadata import StepBuffers
from m3serve.worker.input_batch import InputBatch, ScheduledBatch


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


def test_window_draft_tables_follow_their_diffs():
    """A window draft's table rows: a diff releases the entries below its first block and
    appends after the last one held (jumping to the first block when nothing is held); rows
    move on remove with their tables, a preempted row holds nothing, and the step buffers stage
    the rows' tables and valid-from, padding rows on the null block."""
    batch = InputBatch(max_model_len=64, block_size=4, device=torch.device("cpu"), capacity=1, draft_tables=True)
    params = SamplingParams(max_tokens=2)
    batch.add("a", [1] * 9, params, [1, 2, 3], 0, DraftBlocks(0, [5, 6, 7], 0))
    batch.add("b", [2] * 20, params, [4] * 6, 16, DraftBlocks(3, [8, 9], 12))    # a hit run from block 3
    assert batch.draft_block_table[1, :6].tolist() == [0, 0, 0, 8, 9, 0] and batch.draft_valid_from[1] == 12
    batch._set_draft(0, DraftBlocks(2, [10], 0))                                   # 0, 1 released, 3 appended
    assert batch.draft_block_table[0, :5].tolist() == [0, 0, 7, 10, 0]
    batch._set_draft(0, DraftBlocks(6, [11, 12], 0))                               # everything left: jump to 6
    assert batch.draft_block_table[0, :9].tolist() == [0] * 6 + [11, 12, 0]
    assert (batch.draft_first[0], batch.draft_end[0]) == (6, 8)
    buffers = StepBuffers(4, 64, batch.max_blocks, 4, torch.device("cpu"), draft_tables=True)
    sched = ScheduledBatch(["b", "a"], np.array([1, 0]), np.array([1, 1], dtype=np.int32),
                           np.array([21, 10], dtype=np.int32), np.array([0, 1, 2], dtype=np.int32),
                           np.array([20, 9]), np.array([2, 1], dtype=np.int32), True)
    buffers.stage(sched, batch, pad_to=3)
    assert buffers.draft_valid_from[:3].tolist() == [12, 0, 0]
    assert buffers.draft_block_tables[:3, :8].tolist() == [[0, 0, 0, 8, 9, 0, 0, 0], [0] * 6 + [11, 12], [0] * 8]
    batch.remove("a")                                                              # b moves to row 0
    assert batch.index == {"b": 0} and batch.draft_block_table[0, :6].tolist() == [0, 0, 0, 8, 9, 0]
    assert not batch.draft_block_table[1].any() and batch.draft_valid_from[0] == 12
    batch._clear_draft(0)                                                          # as on preemption
    assert not batch.draft_block_table.any() and batch.draft_end[0] == 0
