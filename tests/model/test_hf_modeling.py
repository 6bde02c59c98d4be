"""A lingctl checkpoint run by transformers itself, offline, through the modeling code written beside its weights:
greedy ``generate()`` (with the key/value cache, without it, and on a left-padded batch) equals ``lingctl flood
run``'s answers, and the log-likelihoods equal lingctl's own model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lingctl.model.checkpoint import load_checkpoint, save_checkpoint
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset

pytest.importorskip("transformers")

NEW_TOKENS = 12
PROMPTS = [[5, 17, 42, 9, 3, 88, 21], [101, 7], [64, 33, 12, 90, 250, 14, 2, 8, 19, 77, 31]]
SEQUENCES = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [200, 100, 50, 25, 12, 6]]

REPO = Path(__file__).resolve().parents[2]
# Runs in a fresh interpreter with HF_HUB_OFFLINE=1 and an empty HF_HOME: everything comes from the directory.
HF_SIDE = REPO / "bench" / "hf_side_generate.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = preset("tiny")
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id = 320, 0, 0
    model = LingForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(3))
    path = tmp_path_factory.mktemp("hfmodel") / "ckpt"
    save_checkpoint(model, path)
    return path


@pytest.fixture(scope="module")
def transformers_run(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("hf_home")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_MODULES_CACHE", None)
    args = [str(checkpoint), json.dumps(PROMPTS), json.dumps(SEQUENCES), str(NEW_TOKENS)]
    res = subprocess.run(
        [sys.executable, str(HF_SIDE), *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_code_files_beside_the_weights_and_auto_map_names_them(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_bailing_moe.BailingMoeForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_bailing_moe.BailingMoeConfig"
    for name in ("modeling_bailing_moe.py", "configuration_bailing_moe.py"):
        source = (checkpoint / name).read_text()
        assert "import lingctl" not in source and "from lingctl" not in source  # runs where lingctl is absent


def test_generate_equals_flood_with_and_without_cache(
    checkpoint: Path, transformers_run: dict[str, Any], tmp_path: Path, lingctl
) -> None:
    assert transformers_run["class"] == "BailingMoeForCausalLM"
    batch = tmp_path / "batch.jsonl"
    lines = [
        {
            "custom_id": f"p{i}",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        for i, p in enumerate(PROMPTS)
    ]
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    res = lingctl("flood", "run", str(batch), "--model", str(checkpoint), "-o", str(out))
    assert res.returncode == 0, res.stderr
    answers = {}
    for line in out.read_text().splitlines():
        row = json.loads(line)
        answers[row["custom_id"]] = row["response"]["body"]["choices"][0]["token_ids"]
    flood = [answers[f"p{i}"] for i in range(len(PROMPTS))]
    assert all(len(ids) == NEW_TOKENS for ids in flood)
    assert transformers_run["cached"] == flood
    assert transformers_run["uncached"] == flood
    # Left padding: each sequence's first real token is position 0, so the batch answers as each alone.
    assert transformers_run["padded"] == flood


def test_log_likelihoods_equal_lingctls_model(checkpoint: Path, transformers_run: dict[str, Any]) -> None:
    model = load_checkpoint(checkpoint).eval()
    with torch.no_grad():
        for seq, theirs in zip(SEQUENCES, transformers_run["logprobs"]):
            logits = model(torch.tensor([seq])).logits[0].double().log_softmax(-1)
            ours = [logits[i, seq[i + 1]].item() for i in range(len(seq) - 1)]
            assert ours == pytest.approx(theirs, abs=1e-5)
