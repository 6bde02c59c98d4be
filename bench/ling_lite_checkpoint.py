"""Write a checkpoint with Ling-lite's exact shapes, names and layout, filled with random bf16 values.

    python bench/ling_lite_checkpoint.py --out /work/scratch/ling-lite [--layers 28] [--shards 9]

config.json (every field explicit, as lingctl's checkpoints write it), ``model-0000k-of-0000n.safetensors``
shards of about equal size in name order and ``model.safetensors.index.json``, as on the Hub. Memory stays
flat: the values come from one seeded pool of random numbers (64 Mi values), each tensor read from it at its
own offset, and every tensor is written in 64 MiB pieces. 28 layers = 33.6 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lingctl.model.checkpoint import model_state  # noqa: E402
from lingctl.model.checkpoint_files import CONFIG, WEIGHTS_INDEX  # noqa: E402
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
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--shards", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t = time.monotonic()
    n = write(args.out, args.layers, args.shards, args.seed)
    dt = time.monotonic() - t
    print(
        f"wrote {n / 1e9:.2f} GB ({args.layers} layers, {args.shards} shards) to {args.out} in {dt:.1f} s "
        f"({n / dt / 1e6:.0f} MB/s)"
    )


if __name__ == "__main__":
    main()
