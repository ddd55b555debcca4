"""The drafts shipped with the trained tiny model (`scripts/train_tiny.py`) accept for real, on
prompts from the held-out text: EAGLE3 and MTP at least 1.8 tokens per verify step at k = 3,
DSpark at least 2.0 at its block size; and the output stays the target's own greedy output."""
import pytest

from m3serve.llm import LLM
from m3serve.model.files import default_model_dir, load_tokenizer
from m3serve.sampling_params import SamplingParams
from m3serve.distill.draft_data import acceptance

PROMPT_LEN, NEW_TOKENS, NUM_PROMPTS = 32, 48, 12


@pytest.fixture(scope="module")
def prompts_and_greedy():
    text = (default_model_dir() / "heldout.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(default_model_dir()).encode(text, add_special_tokens=False).ids
    # prompts spread over the whole held-out text (code files, then docs sections)
    step = (len(ids) - PROMPT_LEN) // NUM_PROMPTS
    prompts = [ids[i * step:i * step + PROMPT_LEN] for i in range(NUM_PROMPTS)]
    llm = LLM(model=str(default_model_dir()), dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec,floor", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, 1.8),       # the target's eagle3/ folder
    ({"method": "mtp", "num_speculative_tokens": 3}, 1.8),          # bundled mtp.safetensors
    ({"method": "dspark"}, 2.0),                                    # dspark/, k = its block size (7)
], ids=["eagle3", "mtp", "dspark"])
def test_shipped_draft_accepts_above_the_floor(prompts_and_greedy, spec, floor):
    prompts, greedy = prompts_and_greedy
    result = acceptance(default_model_dir(), spec, prompts, NEW_TOKENS)
    print(f"{spec['method']}: mean acceptance length {result['mean_acceptance_length']:.3f}, "
          f"accepted per position {result['accepted_per_position']}")
    assert result["outputs"] == greedy
    assert result["mean_acceptance_length"] >= floor


def test_eagle3_without_a_model_reads_the_targets_eagle3_folder(tmp_path):
    from m3serve.model.draft_files import eagle3_draft_dir

    assert eagle3_draft_dir(None, None) == default_model_dir() / "eagle3"
    assert eagle3_draft_dir(None, str(default_model_dir())) == default_model_dir() / "eagle3"
    with pytest.raises(ValueError, match=r"speculative_config.model .* is required with method 'eagle3': the "
                                         r"target has no eagle3/ folder"):
        eagle3_draft_dir(None, str(tmp_path))
