"""From ``train sft``/``train dpo`` settings to packed rows: the lines read and checked (all of them, before
anything is trained), split into train and eval by line, packed by the length curriculum."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from lingctl.core.errors import UsageError
from lingctl.model.config import LingConfig
from lingctl.model.tokenizer import eos_id, load_tokenizer
from lingctl.runs.train_config import Stage, TrainConfig, parse_schedule
from lingctl.train.data import corpus_fingerprint, is_eval_doc, resolve_sources
from lingctl.train.dataset import check_fingerprint
from lingctl.train.post.examples import ChatText, read_lines
from lingctl.train.post.packing import PackedRows, pack
from lingctl.train.resolved import Resolved, model_config

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class PostData:
    tokenizer: Tokenizer
    train: PackedRows
    eval: PackedRows | None
    fingerprint: str
    n_files: int
    model_config: LingConfig

    def check_unchanged(self, saved: str) -> None:
        check_fingerprint(saved, self.fingerprint)


def prepare_post_data(
    config: TrainConfig, res: Resolved, *, tokenizer_path: Path, template_dir: Path, init: LingConfig | None
) -> PostData:
    """Read, check, split and pack the run's lines. ``template_dir``: the checkpoint whose chat template and
    special tokens render message lists; ``init``: the shape the run starts from."""
    if not config.data.paths:
        raise UsageError(f"train {config.task} needs --data: JSONL files of {_FORMATS[config.task]}")
    files = resolve_sources(config.data.paths)
    tok = load_tokenizer(tokenizer_path)
    eos = eos_id(tok)
    text = ChatText(tok, template_dir, eos)
    try:
        items = read_lines(files, text, kind=config.task, loss_on=config.post.loss_on)  # type: ignore[arg-type]
    finally:
        text.close()
    fraction = config.data.eval_fraction
    held = [is_eval_doc(item.where, fraction) for item in items]
    train_items = [item for item, h in zip(items, held) if not h]
    eval_items = [item for item, h in zip(items, held) if h]
    if not train_items:
        raise UsageError(f"all {len(items)} lines went to the eval split", hint="lower data.eval_fraction")
    stages = parse_schedule(config.post.seq_len_schedule, config.seq_len or res.seq_len)
    what = "pairs" if config.task == "dpo" else "examples"
    train = pack(train_items, stages, seed=config.seed, what=what)
    evals = pack(eval_items, [Stage(stages[-1].seq_len, None)], what=what) if eval_items else None
    log.info(
        "%d %s in %d rows (%.0f%% of their tokens real), %d held out",
        len(train_items), what, len(train), 100 * train.n_tokens / max(1, _capacity(train, stages)), len(eval_items),
    )  # fmt: skip
    mcfg = model_config(config, vocab_size=tok.get_vocab_size(), eos_id=eos, seq_len=stages[-1].seq_len, init=init)
    settings = f"{config.task}|{config.post.loss_on}|{config.post.seq_len_schedule}|{res.seq_len}|{fraction}"
    fingerprint = corpus_fingerprint(files) + "-" + hashlib.sha256(settings.encode()).hexdigest()[:8]
    return PostData(
        tokenizer=tok, train=train, eval=evals, fingerprint=fingerprint, n_files=len(files), model_config=mcfg
    )


_FORMATS = {
    "sft": '{"messages": [...]} or {"prompt", "completion"} lines',
    "dpo": '{"prompt" or "messages", "chosen", "rejected"} lines',
}


def _capacity(rows: PackedRows, stages: list[Stage]) -> int:
    return sum(n * s.seq_len for n, s in zip(rows.stage_rows, stages))
