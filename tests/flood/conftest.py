"""Flood fixtures: one compute thread, tiny checkpoints on disk (random weights, with and without a tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lingctl.model.checkpoint import save_checkpoint
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset

FIXTURES = Path(__file__).parent.parent / "fixtures" / "flood"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads; on a busy 2-core machine their spinning barriers
    make each small op much slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_config(layers: int = 2, vocab: int = 1024):
    cfg = preset("tiny")
    cfg.num_hidden_layers = layers
    cfg.vocab_size = vocab
    cfg.norm_head = True
    # Large enough that greedy outputs are varied rather than one repeated token.
    cfg.initializer_range = 0.2
    cfg.eos_token_id = 1
    return cfg


def tiny_model(layers: int = 2, vocab: int = 1024, seed: int = 0) -> LingForCausalLM:
    model = LingForCausalLM(tiny_config(layers, vocab))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer MoE checkpoint without a tokenizer: prompts are token ids."""
    path = tmp_path_factory.mktemp("flood") / "tiny"
    save_checkpoint(tiny_model(), path)
    return path


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint with a trained byte-level BPE tokenizer and a chat template."""
    from lingctl.model.tokenizer import train_tokenizer

    text = [("the quick brown fox jumps over the lazy dog. " * 3 + f"line {i} of a tiny corpus.\n") for i in range(200)]
    tok = train_tokenizer(text, 320)
    vocab = tok.get_vocab_size()
    path = tmp_path_factory.mktemp("flood") / "text"
    model = tiny_model(vocab=vocab, seed=1)
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None
    model.config.eos_token_id = eos
    save_checkpoint(model, path, tokenizer_json=tok.to_str())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return path
