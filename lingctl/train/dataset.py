"""From the run's data settings to token rows, a tokenizer and the model shape that matches them."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from lingctl.core.errors import LingctlError
from lingctl.model.config import LingConfig
from lingctl.model.tokenizer import eos_id, load_tokenizer, train_tokenizer
from lingctl.runs.train_config import TrainConfig
from lingctl.train.data import (
    TokenData,
    build_token_data,
    corpus_fingerprint,
    default_corpus_files,
    iter_documents,
    resolve_sources,
)
from lingctl.train.resolved import Resolved, model_config
from lingctl.train.sources import tokenizer_source

log = logging.getLogger(__name__)

# The default corpus is capped so setup takes seconds: 4 MiB of source is ~1.2M tokens, hundreds of demo steps.
DEFAULT_CORPUS_BYTES = 4 * 2**20


@dataclass(kw_only=True, slots=True)
class PreparedData:
    tokenizer: Tokenizer
    tokens: TokenData
    fingerprint: str
    n_files: int
    model_config: LingConfig

    def check_unchanged(self, saved: str) -> None:
        check_fingerprint(saved, self.fingerprint)


def check_fingerprint(saved: str, current: str) -> None:
    """The data of a resumed run must be the data it was checkpointed with (``saved``: its fingerprint)."""
    if saved != current:
        raise LingctlError(
            f"the training data changed since this run was checkpointed (fingerprint {saved} -> {current})",
            hint="resume with the same --data, or start a new run with another --out",
        )


def default_files() -> list[Path]:
    # Spread the byte cap across the whole library rather than its alphabetically first packages.
    return sorted(
        default_corpus_files(), key=lambda p: hashlib.sha1(p.name.encode() + str(p.parent.name).encode()).digest()
    )


def prepare_data(
    config: TrainConfig, res: Resolved, *, tokenizer_path: Path | None = None, init: LingConfig | None = None
) -> PreparedData:
    """Documents -> tokenizer (the run's own on resume, a given one, or a new BPE) -> packed rows.
    ``init``: the shape of the checkpoint the run starts from."""
    d = config.data
    if d.paths:
        files = resolve_sources(d.paths)
        max_bytes = d.max_bytes
    else:
        files = default_files()
        max_bytes = d.max_bytes or DEFAULT_CORPUS_BYTES
    documents = list(iter_documents(files, text_field=d.text_field, max_bytes=max_bytes))
    if tokenizer_path is not None:
        tok = load_tokenizer(tokenizer_path)
    elif d.tokenizer:
        tok = load_tokenizer(tokenizer_source(d.tokenizer)[0])
    else:
        vocab = res.vocab_size or 32000
        log.info("training a %d-token byte-level BPE on %d documents", vocab, len(documents))
        tok = train_tokenizer((text for _, text in documents), vocab)
    eos = eos_id(tok)
    tokens = build_token_data(documents, tok, seq_len=res.seq_len, eval_fraction=d.eval_fraction, eos=eos)
    mcfg = model_config(config, vocab_size=tok.get_vocab_size(), eos_id=eos, seq_len=res.seq_len, init=init)
    fingerprint = corpus_fingerprint(files) + f"-{max_bytes}"
    return PreparedData(tokenizer=tok, tokens=tokens, fingerprint=fingerprint, n_files=len(files), model_config=mcfg)
