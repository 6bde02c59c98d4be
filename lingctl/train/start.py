"""Where a run starts: its directory checked (a new run) or its last checkpoint fetched (a resume), and what
the run takes from where it starts: the model shape, the tokenizer with its tokenizer_config.json, the Hub
repository its checkpoints' config.json names for Ling's code; then the model it starts with and its AdamW.

All before the data is read: a directory that holds another run or files lingctl did not write is refused
first, so a bad ``--out`` costs nothing.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lingctl.core.errors import NotFoundError, UsageError
from lingctl.core.names import join_under
from lingctl.model.checkpoint import load_config, load_weights_into
from lingctl.model.checkpoint_files import TOKENIZER, TOKENIZER_CONFIG
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM
from lingctl.model.tokenizer import save_tokenizer
from lingctl.runs.train_config import OptimConfig, TrainConfig
from lingctl.train.dataset import PreparedData, prepare_data
from lingctl.train.post.dataset import PostData, prepare_post_data
from lingctl.train.report import report_dir_name
from lingctl.train.resolved import Resolved
from lingctl.train.rundir import RunDir
from lingctl.train.sources import InitSource, read_json_object, tokenizer_source
from lingctl.train.workers import Workers

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class RunStart:
    latest: dict[str, Any] | None  # the checkpoint a resume starts from (latest.json's record); None: a new run
    shape: LingConfig | None  # the model shape of a run started from a checkpoint; None: the preset's
    tokenizer: Path | None  # the tokenizer file; None: the one --tokenizer names, or train one on the data
    # The tokenizer_config.json the run's checkpoints carry (chat template, special tokens): the one that came
    # with the tokenizer or the starting checkpoint; None = lingctl's own.
    tokenizer_config: dict[str, Any] | None
    code_repo: str | None  # where the checkpoints' config.json auto_map sends transformers for Ling's code
    # The checkpoint whose chat template renders fine-tuning data: the starting one, or the run's own on resume.
    template_dir: Path | None = None


def open_run(
    config: TrainConfig, run: RunDir, workers: Workers, *, init: InitSource | None, resume: bool, restart: bool
) -> RunStart:
    """``resume``: continue from the run's committed checkpoint. ``restart``: the directory may hold a run
    that never reached a checkpoint; start it over (otherwise an existing run is refused). ``init``: the
    checkpoint a new run starts from (``--init-from``)."""
    latest = run.latest() if resume else None
    if latest is not None:
        if workers.local_rank == 0:  # one copy per node
            run.fetch_for_resume(latest, last_step=config.steps, main=workers.is_main)
        workers.barrier()
        return _resumed(config, run, latest)
    if run.has_content() and not restart:
        raise UsageError(
            f"{run.describe()} already holds a training run",
            hint="pass --resume to continue it, or choose another --out",
        )
    # A directory holding files lingctl did not write is refused (or, adopted, its names are kept out of the
    # run's way).
    run.check_fresh(restart=restart, last_step=config.steps)
    start = RunStart(
        latest=None,
        shape=init.config if init is not None else None,
        tokenizer=None,
        tokenizer_config=None,
        code_repo=config.hf_code_repo or None,
    )
    if config.data.tokenizer:
        start.tokenizer_config = tokenizer_source(config.data.tokenizer)[1]
    elif init is not None:
        start.tokenizer, start.tokenizer_config = _init_tokenizer(init), init.tokenizer_config
    if init is not None:
        start.template_dir = init.directory
    return start


def _resumed(config: TrainConfig, run: RunDir, latest: dict[str, Any]) -> RunStart:
    """A resume takes the shape and tokenizer files from the run's own last checkpoint (so the checkpoint it
    started from need not exist any more)."""
    ckpt = join_under(run.local, latest["path"], what="latest.json path")
    return RunStart(
        latest=latest,
        shape=load_config(ckpt) if config.init_from else None,
        tokenizer=run.local / TOKENIZER,
        tokenizer_config=read_json_object(ckpt / TOKENIZER_CONFIG),
        code_repo=config.hf_code_repo or None,
        template_dir=ckpt,
    )


def _init_tokenizer(init: InitSource) -> Path:
    path = init.tokenizer
    if path is None:
        raise NotFoundError(
            f"{init.directory} has no {TOKENIZER}",
            hint="pass --tokenizer with the tokenizer the checkpoint was trained with",
        )
    return path


def shared_data(
    start: RunStart, config: TrainConfig, res: Resolved, run: RunDir, workers: Workers
) -> PreparedData | PostData:
    """The run's data and tokenizer. A new run's tokenizer is rank 0's, sent to the other workers over the
    process group (no shared directory is needed); its directory is created only once the data is usable, so
    a bad --data leaves no empty run directory behind."""
    tokenizer = start.tokenizer
    if start.latest is None and not workers.is_main:
        tokenizer = _received_tokenizer(workers.broadcast(None))
    data: PreparedData | PostData
    if config.task == "pretrain":
        data = prepare_data(config, res, tokenizer_path=tokenizer, init=start.shape)
    else:
        if tokenizer is None or start.template_dir is None:
            raise UsageError(f"train {config.task} needs --init-from: the checkpoint to fine-tune")
        data = prepare_post_data(
            config, res, tokenizer_path=tokenizer, template_dir=start.template_dir, init=start.shape
        )
    if start.latest is None and workers.is_main:
        run.prepare_fresh()
        save_tokenizer(data.tokenizer, run.local / TOKENIZER)
        run.publish([TOKENIZER])
        workers.broadcast(data.tokenizer.to_str())
    if workers.is_main and config.report_to != "none":  # the manifest lists every name lingctl creates
        run.claim_report_dir(report_dir_name(config.report_to))
    workers.barrier()
    return data


def _received_tokenizer(text: str) -> Path:
    fd, name = tempfile.mkstemp(prefix="lingctl-tokenizer-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(name)


def initial_model(shape: LingConfig, config: TrainConfig, *, init: InitSource | None) -> LingForCausalLM:
    """The model a run starts with: the starting checkpoint's weights (``init``), or seeded ones (a new run,
    and a resume, whose checkpoint then replaces them)."""
    torch.manual_seed(config.seed)
    model = LingForCausalLM(shape, config.dispatch)
    if init is not None:
        read = load_weights_into(model, init.directory)
        log.info("started from %s (%.2f GB of weights)", init.spec, read / 1e9)
    else:
        model.init_weights(torch.Generator().manual_seed(config.seed))
    return model


def adamw(model: LingForCausalLM, optim: OptimConfig, lr: float) -> torch.optim.AdamW:
    """AdamW with no weight decay on norms and other vectors."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
    )


def data_parallel(model: LingForCausalLM, workers: Workers, sync: str) -> torch.nn.Module:
    """What the forward runs through: DistributedDataParallel with several synchronous workers."""
    if not workers.distributed or sync != "ddp":
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Experts no token was routed to in a step get no gradient: DDP must look for unused parameters.
    return DistributedDataParallel(model, find_unused_parameters=True)
