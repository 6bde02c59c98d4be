"""Write a checkpoint with Ling-lite's exact shapes, names and layout, filled with random bf16 values.

    python bench/ling_lite_checkpoint.py --out /work/scratch/ling-lite [--layers 28] [--shards 9]
    python bench/ling_lite_checkpoint.py --out DIR --tokenizer-only   # add the tokenizer to an existing one

config.json (every field explicit, as lingctl's checkpoints write it), ``model-0000k-of-0000n.safetensors``
shards of about equal size in name order and ``model.safetensors.index.json``, as on the Hub. Memory stays
flat: the values come from one seeded pool of random numbers (64 Mi values), each tensor read from it at its
own offset, and every tensor is written in 64 MiB pieces. 28 layers = 33.6 GB.

Ling's tokenizer cannot be downloaded here, so a byte-level BPE tokenizer with Ling-lite's vocabulary size is
generated (``tokenizer.json``, ``tokenizer_config.json``): the 256 byte tokens, synthetic merges up to the
vocabulary size, and ``<|endoftext|>`` at the config's eos id. Its merges mean nothing linguistically; they give
text prompts, ``flood eval`` tasks and converters that need a tokenizer (llama.cpp's GGUF writer) the right shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lingctl.model.checkpoint import model_state  # noqa: E402
from lingctl.model.checkpoint_files import CONFIG, TOKENIZER, TOKENIZER_CONFIG, WEIGHTS_INDEX  # noqa: E402
from lingctl.model.config import LingConfig  # noqa: E402
from lingctl.model.ling import LingForCausalLM  # noqa: E402
from lingctl.model.presets import preset  # noqa: E402
from lingctl.model.safetensors_io import DEFAULT_METADATA  # noqa: E402

POOL = 1 << 26
PIECE = 1 << 25  # values per write (64 MiB of bf16)


def shapes_of(layers: int) -> tuple[dict[str, tuple[int, ...]], LingConfig]:
    config = dataclasses.replace(preset("ling-lite"), num_hidden_layers=layers)
    with torch.device("meta"):
        state = model_state(LingForCausalLM(dataclasses.replace(config)))
    return {k: tuple(v.shape) for k, v in state.items()}, config


def write(out: Path, layers: int, shards: int, seed: int) -> int:
    shapes, config = shapes_of(layers)
    names = sorted(shapes)
    total = sum(math.prod(s) for s in shapes.values())
    groups: list[list[str]] = [[]]
    done = 0
    for name in names:
        if done >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(name)
        done += math.prod(shapes[name])
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=gen) * 0.02).to(torch.bfloat16)
    pool = torch.cat([pool, pool[:PIECE]])  # windows never wrap
    ones = torch.ones(PIECE, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    written = 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header: dict[str, object] = {"__metadata__": dict(DEFAULT_METADATA)}
        offset = 0
        for name in group:
            nbytes = math.prod(shapes[name]) * 2
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        tmp = out / (file + ".partial")
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in group:
                n = math.prod(shapes[name])
                start = int(torch.randint(0, POOL, (1,), generator=gen))
                for j in range(0, n, PIECE):
                    m = min(PIECE, n - j)
                    src = ones[:m] if name.endswith("norm.weight") else pool[start : start + m]
                    f.write(src.view(torch.uint8).numpy().data)  # the array's bytes, as a memoryview
                    start = (start + m) % POOL
                weight_map[name] = file
        tmp.rename(out / file)
        written += 8 + len(raw) + offset
    (out / WEIGHTS_INDEX).write_text(
        json.dumps({"metadata": {"total_size": written}, "weight_map": weight_map}, indent=2)
    )
    config.save(out / CONFIG)
    write_tokenizer(out, config.vocab_size, config.eos_token_id, seed)
    return written


EOS_TEXT = "<|endoftext|>"


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (``bytes_to_unicode``), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_tokenizer(out: Path, vocab_size: int, eos_id: int, seed: int = 0) -> int:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids: returns the number of merges."""
    rng = random.Random(seed)
    vocab: dict[str, int] = {}
    tokens = byte_alphabet()
    next_id = 0
    for t in tokens:
        if next_id == eos_id:
            next_id += 1
        vocab[t] = next_id
        next_id += 1
    vocab[EOS_TEXT] = eos_id  # in the model's vocabulary too: tokenizers gives an added token outside it a new id
    merges: list[list[str]] = []
    # Short tokens first (pairs of bytes, then longer), as trained merges grow: each merge joins two tokens
    # that already exist, so every merge is reachable from bytes.
    while next_id < vocab_size:
        if next_id == eos_id:
            next_id += 1
            continue
        left = tokens[rng.randrange(min(len(tokens), 4096))]
        right = tokens[rng.randrange(256)] if rng.random() < 0.7 else tokens[rng.randrange(len(tokens))]
        merged = left + right
        if merged in vocab or len(merged) > 16:
            continue
        vocab[merged] = next_id
        tokens.append(merged)
        merges.append([left, right])
        next_id += 1
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": eos_id,
                "content": EOS_TEXT,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    (out / TOKENIZER).write_text(json.dumps(tokenizer, ensure_ascii=False))
    (out / TOKENIZER_CONFIG).write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS_TEXT,
                "pad_token": EOS_TEXT,
                "model_max_length": 16384,
                "added_tokens_decoder": {
                    str(eos_id): {
                        "content": EOS_TEXT,
                        "special": True,
                        "normalized": False,
                        "lstrip": False,
                        "rstrip": False,
                        "single_word": False,
                    }
                },
            },
            indent=2,
        )
    )
    return len(merges)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--shards", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-only", action="store_true", help="only add the generated tokenizer to --out")
    args = ap.parse_args()
    t = time.monotonic()
    config = preset("ling-lite")
    if args.tokenizer_only:
        merges = write_tokenizer(args.out, config.vocab_size, config.eos_token_id, args.seed)
        print(f"wrote a byte-level BPE tokenizer ({config.vocab_size} ids, {merges} merges) to {args.out}")
        return
    n = write(args.out, args.layers, args.shards, args.seed)
    dt = time.monotonic() - t
    print(
        f"wrote {n / 1e9:.2f} GB ({args.layers} layers, {args.shards} shards) to {args.out} in {dt:.1f} s "
        f"({n / dt / 1e6:.0f} MB/s)"
    )


if __name__ == "__main__":
    main()
