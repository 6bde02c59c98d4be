"""A lingctl checkpoint run by transformers, offline, on each transformers line users have, against flood.

Writes a checkpoint of a built-in preset with seeded random weights (its modeling code beside the weights, as
every lingctl checkpoint), then for each ``--python`` interpreter (each a virtual environment with torch and one
transformers release, and no lingctl) runs ``bench/hf_side_generate.py`` with ``HF_HUB_OFFLINE=1`` and an empty
``HF_HOME``. It compares that side's greedy ``generate()`` answers (key/value cache on and off, and a
left-padded batch) with ``lingctl flood run``'s, and its log-probabilities with lingctl's own model's.

    .venv/bin/python bench/hf_roundtrip.py --python .venv/bin/python --python /path/to/venv-4.57/bin/python \
        [--preset tiny] [--json]

An environment for another release: ``python -m venv V && V/bin/pip install torch==2.13.0 transformers==4.57.6``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lingctl.model.checkpoint import load_checkpoint, save_checkpoint
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset

HERE = Path(__file__).resolve().parent


def build(path: Path, name: str, vocab: int) -> None:
    cfg = preset(name)
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id = vocab, 0, 0
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, 512)
    model = LingForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(7))
    save_checkpoint(model, path)


def flood_answers(ckpt: Path, prompts: list[list[int]], new: int, work: Path) -> list[list[int]]:
    batch, out = work / "batch.jsonl", work / "out.jsonl"
    with batch.open("w") as f:
        for i, p in enumerate(prompts):
            body = {"prompt": p, "max_tokens": new, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": str(i), "url": "/v1/completions", "body": body}) + "\n")
    cmd = [sys.executable, "-m", "lingctl", "flood", "run", str(batch), "--model", str(ckpt), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"] for r in rows}
    return [by_id[str(i)] for i in range(len(prompts))]


def lingctl_logprobs(ckpt: Path, sequences: list[list[int]]) -> list[list[float]]:
    model = load_checkpoint(ckpt).eval()
    out = []
    with torch.no_grad():
        for s in sequences:
            logp = model(torch.tensor([s])).logits[0].double().log_softmax(-1)
            out.append([logp[i, s[i + 1]].item() for i in range(len(s) - 1)])
    return out


def hf_side(python: str, ckpt: Path, prompts: list, sequences: list, new: int, home: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_HUB_CACHE", None)
    args = [str(ckpt), json.dumps(prompts), json.dumps(sequences), str(new)]
    res = subprocess.run(
        [python, str(HERE / "hf_side_generate.py"), *args], capture_output=True, text=True, env=env, check=False
    )
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
    return json.loads(res.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", help="an interpreter with transformers (repeatable)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = 320
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 40))] for _ in range(args.requests)]
    sequences = [[rng.randrange(1, vocab) for _ in range(64)] for _ in range(8)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = work / "ckpt"
        build(ckpt, args.preset, vocab)
        flood = flood_answers(ckpt, prompts, args.new_tokens, work)
        ours = lingctl_logprobs(ckpt, sequences)
        for i, python in enumerate(args.python or [sys.executable]):
            theirs = hf_side(python, ckpt, prompts, sequences, args.new_tokens, work / f"hf{i}")
            row: dict[str, Any] = {"python": python, **{k: theirs.get(k) for k in ("version", "error")}}
            if "error" not in theirs:
                for key in ("cached", "uncached", "padded"):
                    row[f"greedy_equal_{key}"] = sum(a == b for a, b in zip(theirs[key], flood))
                row["requests"] = len(prompts)
                diffs = [abs(a - b) for xs, ys in zip(ours, theirs["logprobs"]) for a, b in zip(xs, ys)]
                row["max_logprob_diff"] = max(diffs)
            results.append(row)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        if r.get("error"):
            print(f"{r['python']}: failed: {r['error']}")
            continue
        n = r["requests"]
        print(
            f"transformers {r['version']}: greedy equal to flood {r['greedy_equal_cached']}/{n} (cache), "
            f"{r['greedy_equal_uncached']}/{n} (no cache), {r['greedy_equal_padded']}/{n} (left-padded batch); "
            f"max |log-prob difference| vs lingctl {r['max_logprob_diff']:.2e}"
        )


if __name__ == "__main__":
    main()
