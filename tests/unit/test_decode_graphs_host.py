"""The host side of the decode CUDA graphs on CPU: pinned-staging layout, padding rows, the
block-table rows left over from earlier (longer) requests, and the in-graph argmax. The graph is
replaced by an eager forward over the same static buffers, so every input the model sees comes
through the staging path; greedy outputs must equal the plain eager engine's."""
from types import SimpleNamespace

import pytest
import torch

from m3serve.layers.attention_metadata import AttentionMetadata
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from m3serve.worker.cuda_graphs import DecodeGraphs


class EagerReplayGraphs(DecodeGraphs):
    """DecodeGraphs whose 'graphs' run the model eagerly on the static device buffers."""

    def capture(self) -> None:
        for b in self.sizes:
            logits = torch.zeros(b, self.model.cfg.vocab_size)
            greedy = torch.zeros(b, dtype=torch.int64)

            def replay(b=b, logits=logits, greedy=greedy):
                seq = self.seq_lens[:b].tolist()
                meta = AttentionMetadata(
                    query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
                    block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
                    query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=seq, block_size=self.block_size)
                out = self.model.compute_logits(self.model(self.input_ids[:b], self.positions[:b], meta))
                logits.copy_(out)
                greedy.copy_(out.argmax(dim=-1))

            self.graphs[b] = (SimpleNamespace(replay=replay), logits, greedy)
            self.expert_ids[b] = []


@pytest.fixture(scope="module")
def engines(tiny_dir):
    plain = LLM(model=str(tiny_dir), max_num_seqs=8)
    graphed = LLM(model=str(tiny_dir), max_num_seqs=8)
    runner = graphed.engine.worker.runner
    runner.graphs = EagerReplayGraphs(runner.model, [1, 2, 4, 8], runner.block_size,
                                      graphed.engine.worker.max_model_len, torch.device("cpu"))
    runner.graphs.capture()
    return plain, graphed


def test_staged_decode_equals_eager(engines):
    plain, graphed = engines
    # ragged lengths across several blocks, 3 and 5 requests (padded to 4 and 8); the short batch
    # runs after the long one so stale block-table rows are present
    long = [[(7 * i + 3 * j) % 500 + 10 for j in range(20 + 23 * i)] for i in range(5)]
    short = [[(11 * i + j) % 300 + 20 for j in range(3 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for batch in (long, short):
        prompts = [{"prompt_token_ids": p} for p in batch]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
        assert got == want
    runner = graphed.engine.worker.runner
    assert runner.num_graph_steps >= 2 * 11 and runner.num_eager_steps >= 2


def test_staged_decode_sampled_path_uses_logits(engines):
    """Non-greedy requests read the graph's logits (not its argmax): seeded sampling agrees."""
    plain, graphed = engines
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [40, 41, 42]}]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == want
