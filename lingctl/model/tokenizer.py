"""Byte-level BPE tokenizers: train one on a corpus, save it beside a checkpoint, load it back.

Byte-level (GPT-2 style) so that every string round-trips: there is no unknown token, and text in any
script or encoding damage decodes back to exactly what was encoded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import LingctlError, NotFoundError, UsageError
from lingctl.model.checkpoint_files import TOKENIZER
from lingctl.model.hf_files import EOS_TOKEN, SPECIAL_TOKENS

SPECIAL_EOS = EOS_TOKEN
# Names other tokenizers use for the same role, tried in this order after ours.
EOS_ALIASES = (SPECIAL_EOS, "</s>", "<eos>")
# 256 byte tokens plus the special tokens leave room for a few dozen merges; fewer would not be BPE.
MIN_VOCAB_SIZE = 300


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with ``vocab_size`` entries, Ling's special tokens among them (end and
    start of text, chat role markers; the end of text is id 0).

    The same texts in the same order give the same tokenizer (``to_str()`` equal), so a run that retrains
    on resume ends up with the ids its checkpoint was trained on.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise UsageError(
            f"vocab size {vocab_size} is too small: the byte alphabet and special tokens alone need 260 entries",
            hint=f"use a vocab size of at least {MIN_VOCAB_SIZE}",
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # Every byte is in the vocabulary even if the corpus never shows it, so nothing maps to "unknown".
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved at ``path`` (a ``tokenizer.json`` file, as written by ``save_tokenizer`` or HF)."""
    path = Path(path)
    if not path.exists():
        raise NotFoundError(f"tokenizer not found: {path}")
    if path.is_dir():
        raise UsageError(f"tokenizer path is a directory: {path}", hint=f"pass the file, e.g. {path / TOKENIZER}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception with a multi-line serde message
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LingctlError(
            f"not a valid tokenizer file: {path}: {reason}",
            hint="expected a tokenizer.json as written by the tokenizers library",
        ) from exc


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write ``tok`` as JSON to ``path`` atomically, so a crash never leaves a truncated tokenizer."""
    with atomic_write(Path(path)) as (_, f):
        f.write(tok.to_str().encode("utf-8"))


def eos_id(tok: Tokenizer) -> int:
    """The id of the end-of-document token (also used for padding)."""
    for name in EOS_ALIASES:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise LingctlError(
        "the tokenizer has no end-of-text token (" + ", ".join(EOS_ALIASES) + ")",
        hint="train a tokenizer with lingctl or use one that defines an EOS token",
    )
