"""The transformers side of the checkpoint round trip (bench/hf_roundtrip.py, tests/model/test_hf_modeling.py).

Runs under any Python with torch and transformers (4.46 through 5.x) and no lingctl: it loads a checkpoint
directory through ``AutoModelForCausalLM`` with the code beside its weights, and prints one JSON line: greedy
``generate()`` answers with and without the key/value cache and on a left-padded batch, and per-token
log-probabilities of some sequences.

    python bench/hf_side_generate.py CKPT PROMPTS_JSON SEQUENCES_JSON NEW_TOKENS
"""

import json
import sys
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM


def main() -> None:
    path, prompts, sequences, new = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    # transformers 4.4x names the dtype argument torch_dtype; 5.x dtype.
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **{dtype_arg: torch.float32}).eval()
    out: dict[str, Any] = {
        "version": transformers.__version__,
        "class": type(model).__name__,
        "load_s": time.perf_counter() - started,
        "cached": [],
        "uncached": [],
    }
    common = {"max_new_tokens": new, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for key, cache in (("cached", True), ("uncached", False)):
                g = model.generate(ids, attention_mask=torch.ones_like(ids), use_cache=cache, **common)
                out[key].append(g[0, len(p) :].tolist())
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out["padded"] = model.generate(ids, attention_mask=mask, **common)[:, width:].tolist()
        out["logprobs"] = []
        for s in sequences:
            logp = model(torch.tensor([s])).logits[0].double().log_softmax(-1)
            out["logprobs"].append([logp[i, s[i + 1]].item() for i in range(len(s) - 1)])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
