"""The tiny vision checkpoint's greedy tokens on one device, for GPU == CPU checks:
`python scripts/vision_gpu_check.py cpu` writes mm_cpu_ref.json (one image, two images, a video,
chunked through the image spans); `python scripts/vision_gpu_check.py cuda mm_cpu_ref.json`
compares the GPU's tokens with them."""
import json, sys
import numpy as np
from m3serve.llm import LLM
from m3serve.model.tiny import make_tiny
from m3serve.sampling_params import SamplingParams
d = make_tiny("/tmp/tinyvis", vision=True)
def img(w, h, s): return np.random.default_rng(s).integers(0, 256, (h, w, 3), dtype=np.uint8)
reqs = [{"prompt": "look ]<]image[>[ and tell me", "multi_modal_data": {"image": img(150, 100, 1)}},
        {"prompt": "first ]<]image[>[ then ]<]image[>[", "multi_modal_data": {"image": [img(60, 90, 2), img(130, 70, 3)]}},
        {"prompt": "watch ]<]video[>[ now", "multi_modal_data": {"video": np.random.default_rng(4).integers(0, 256, (5, 56, 84, 3), dtype=np.uint8)}}]
llm = LLM(model=str(d), dtype="float32", device=sys.argv[1], max_num_batched_tokens=20)
out = [o.outputs[0].token_ids for o in llm.generate(reqs, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
if len(sys.argv) > 2:
    ref = json.load(open(sys.argv[2]))
    print("GPU tokens == CPU tokens:", out == ref, out)
else:
    json.dump(out, open("mm_cpu_ref.json", "w")); print(out)
