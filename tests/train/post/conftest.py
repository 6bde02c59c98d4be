"""Fine-tuning fixtures: a tiny checkpoint with a tokenizer and Ling's chat template, and chat and preference
lines in the formats users bring."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lingctl.model.checkpoint import save_checkpoint
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in tall green trees".split()


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer MoE checkpoint with a byte-level BPE tokenizer; save_checkpoint writes Ling's chat template."""
    from lingctl.model.tokenizer import train_tokenizer

    rng = random.Random(0)
    tok = train_tokenizer([words(rng, 20, 40) for _ in range(300)], 400)
    cfg = preset("tiny")
    cfg.vocab_size = tok.get_vocab_size()
    cfg.initializer_range = 0.1
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None
    cfg.eos_token_id = cfg.pad_token_id = eos
    model = LingForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("post") / "base"
    save_checkpoint(model, path, tokenizer_json=tok.to_str())
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    return path


def write_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft_records(n: int, seed: int = 0) -> list[dict]:
    """Conversations (some multi-turn, some with a system message) and prompt/completion lines, mixed."""
    rng = random.Random(seed)
    out: list[dict] = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"prompt": words(rng, 2, 12), "completion": " " + words(rng, 2, 20)})
        else:
            turns = [{"role": "system", "content": "answer briefly"}] if i % 2 else []
            for _ in range(1 + i % 2):
                turns += [
                    {"role": "user", "content": words(rng, 2, 10)},
                    {"role": "assistant", "content": words(rng, 2, 16)},
                ]
            out.append({"messages": turns})
    return out


def dpo_records(n: int, seed: int = 0) -> list[dict]:
    """Pairs whose chosen answer starts with "yes" and rejected with "no": a preference a tiny model can learn."""
    rng = random.Random(seed)
    out: list[dict] = []
    for i in range(n):
        prompt: object = words(rng, 2, 10)
        if i % 2:
            prompt = [{"role": "user", "content": prompt}]
        out.append({"prompt": prompt, "chosen": "yes " + words(rng, 2, 12), "rejected": "no " + words(rng, 2, 12)})
    return out
