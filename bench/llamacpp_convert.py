"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a checkpoint with a generated tokenizer.

    VENV/bin/python bench/llamacpp_convert.py LLAMA_CPP_DIR CHECKPOINT --outtype q8_0 --outfile OUT.gguf

Run with the converter's own environment (torch, transformers, numpy; ``make bench-llamacpp`` builds it), not
lingctl's. The converter names a BPE tokenizer's pre-tokenizer by hashing the token ids it gives for a fixed
text and comparing with known models; the byte-level tokenizer ``bench/ling_lite_checkpoint.py`` generates
has GPT-2's pre-tokenizer but its own merges, so no hash can match: this wrapper names it ``gpt-2`` and then
runs the converter unchanged. Every other step (tensor names, Q/K permutation, expert merging, q8_0) is the
converter's own.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    llama_cpp = Path(sys.argv[1]).resolve()
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = [str(llama_cpp / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
