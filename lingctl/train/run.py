"""Start or resume a training run: settings from flags/TOML, or from the run's own checkpoint on resume."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from lingctl.core.config import build, from_mapping, load_toml, to_dict
from lingctl.core.errors import LingctlError, UsageError
from lingctl.core.storage import S3Options
from lingctl.model.checkpoint_files import TRAIN_CONFIG
from lingctl.model.config import LingConfig
from lingctl.model.presets import preset
from lingctl.runs.layout import METRICS, PLOT, default_run_dir
from lingctl.runs.records import Record, read_records
from lingctl.runs.settings import reset, top_level
from lingctl.runs.train_config import TrainConfig, parse_saved
from lingctl.train import report
from lingctl.train.data import resolve_sources
from lingctl.train.local_sgd import LocalSgdTrainer
from lingctl.train.memory_plan import TrainMemoryPlan, plan_training
from lingctl.train.plot import plot_metrics
from lingctl.train.resolved import check_model_changes, check_preset_shape, model_config, resolve
from lingctl.train.rundir import RunDir
from lingctl.train.sources import InitSource, open_init_source
from lingctl.train.trainer import Trainer, TrainResult
from lingctl.train.workers import Workers
from lingctl.train.workers import start as start_workers
from lingctl.train.workers import stop as stop_workers

log = logging.getLogger(__name__)

# Settings a resumed run may change; everything else must match the run's saved config, or the resumed
# run would silently be a different experiment (the loss sequence would no longer continue).
RESUMABLE_CHANGES = top_level(TrainConfig, lambda s: s.resumable)


def _saved_config(run: RunDir, latest: dict[str, Any]) -> dict[str, Any]:
    key = f"{latest['path']}/{TRAIN_CONFIG}"
    return parse_saved(run.read(key), f"{run.describe()}/{key}")


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and key != "model":
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def resume_config(saved: dict[str, Any], requested: TrainConfig, explicit: Mapping[str, Any]) -> TrainConfig:
    """The saved config, with the explicitly given settings that a resume may change applied; an explicit
    setting that would change the experiment is refused with both values named."""
    config = from_mapping(TrainConfig, saved, where="the run's saved config")
    _no_drills(config)  # the drills of the interrupted run, not of the experiment
    saved_flat = _flatten(dataclasses.asdict(config))
    requested_flat = _flatten(dataclasses.asdict(requested))
    for key in explicit:
        top = key.split(".")[0]
        if key in RESUMABLE_CHANGES or top in RESUMABLE_CHANGES:
            continue
        if key in saved_flat and saved_flat[key] != requested_flat.get(key):
            raise UsageError(
                f"cannot resume with {key}={requested_flat.get(key)!r}: the run was started with {saved_flat[key]!r}",
                hint="drop the option, or start a new run with another --out",
            )
    for key in explicit:
        top = key.split(".")[0]
        if top in RESUMABLE_CHANGES:
            setattr(config, top, getattr(requested, top))
    config.validate()
    return config


def _no_drills(config: TrainConfig) -> None:
    """Fault drills fire in the first attempt only, or a restart or resume would repeat them."""
    reset(config, lambda s: s.once)


def train(
    *,
    out: str | None,
    resume: bool,
    overrides: Mapping[str, Any],
    config_file: Path | None = None,
    s3: S3Options | None = None,
    on_record: Callable[[Record], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    cache_dir: Path | None = None,
    adopt: bool = False,
) -> TrainResult:
    """Run ``lingctl train``. ``overrides`` are dotted settings given on the command line (None = unset).
    ``on_record`` gets every record the run emits (``preparing`` and ``start`` included, before the first
    step); ``should_stop`` is polled before each step: once it is true the run checkpoints and stops.
    ``adopt``: ``out`` may hold other files; the run adds its own beside them and never touches those."""
    started = time.monotonic()
    explicit = {k: v for k, v in overrides.items() if v is not None}
    requested = build(TrainConfig, file=config_file, section="train" if config_file else None, overrides=explicit)
    if config_file is not None:
        # Settings from the file were asked for as much as flags were.
        explicit = {**_flatten(load_toml(config_file, "train")), **explicit}
    workers = start_workers()
    # A worker the elastic launcher restarted after a failure continues the run from its last checkpoint.
    resume = resume or workers.restarts > 0
    run = _run_dir(out, resume, requested.preset, workers, s3=s3, cache_dir=cache_dir, adopt=adopt)
    latest = run.latest() if resume else None
    if resume and latest is None:
        log.warning("no checkpoint in %s yet; starting from step 0", run.describe())
    config = resume_config(_saved_config(run, latest), requested, explicit) if latest is not None else requested
    if workers.restarts > 0:
        _no_drills(config)
    init = _init_source(config, explicit) if latest is None else None
    if latest is None and config.auto_hparams:
        _auto_hparams(config, init, explicit)
    # Refused before the run writes anything (the reporter below makes files): a run that cannot fit dies late
    # otherwise, with the allocator's error and a run directory behind it.
    # (A resumed run that started from a checkpoint has that checkpoint's shape, known once its own is read.)
    if latest is None or not config.init_from:
        plan = _memory_plan(config, init, workers=int(os.environ.get("LOCAL_WORLD_SIZE", workers.world)))
        if not plan.fits:
            raise plan.refusal()
    if config.data.paths:
        resolve_sources(config.data.paths)  # a missing data path is refused now, not after the start-up line
    # Rank 0 reports for the job (its records are the run's); the other workers never open a writer.
    reporter = _reporter(config, run) if workers.is_main else None
    kind = LocalSgdTrainer if workers.distributed and config.sync == "edit" else Trainer
    trainer = kind(
        config,
        run,
        resume=latest is not None,
        restart=resume,
        on_record=_records_to(reporter, on_record),
        should_stop=should_stop,
        workers=workers,
        init=init,
        announce_setup=True,
    )
    try:
        return _train(trainer, started)
    finally:
        if reporter is not None:
            reporter.close()
        stop_workers(workers)


def plan_run(*, overrides: Mapping[str, Any], config_file: Path | None = None, workers: int = 1) -> TrainMemoryPlan:
    """``train --dry-run``: the memory plan of the run these settings describe, from the preset (or the
    ``--init-from`` checkpoint's config) alone: no data is read, nothing is written, no worker starts."""
    explicit = {k: v for k, v in overrides.items() if v is not None}
    config = build(TrainConfig, file=config_file, section="train" if config_file else None, overrides=explicit)
    init = _init_source(config, explicit)
    if config.auto_hparams:
        _auto_hparams(config, init, explicit)
    return _memory_plan(config, init, workers=workers)


def _shape(config: TrainConfig, init: InitSource | None) -> LingConfig:
    """The model shape a new run will have, before its data is read: the checkpoint's, or the preset's."""
    r = resolve(config)
    if init is not None:  # the checkpoint's shape (its own tokenizer; the run checks the rest itself later)
        return init.config
    return model_config(
        config, vocab_size=r.vocab_size or preset(config.preset).vocab_size, eos_id=0, seq_len=r.seq_len
    )


def _memory_plan(config: TrainConfig, init: InitSource | None, *, workers: int) -> TrainMemoryPlan:
    r = resolve(config)
    shape = _shape(config, init)
    return plan_training(shape, batch_size=r.batch_size, seq_len=r.seq_len, dtype=config.dtype, workers=workers)


def _run_dir(
    out: str | None,
    resume: bool,
    preset: str,
    workers: Workers,
    *,
    s3: S3Options | None,
    cache_dir: Path | None,
    adopt: bool,
) -> RunDir:
    if resume and out is None:
        raise UsageError("--resume needs --out: the run directory to continue")
    if workers.distributed and out is None:
        out = workers.broadcast(default_run_dir(preset))  # one directory for all workers
    return RunDir(out or default_run_dir(preset), s3, cache_dir=cache_dir, adopt=adopt)


def _init_source(config: TrainConfig, explicit: Mapping[str, Any]) -> InitSource | None:
    """The checkpoint a new run starts from (``--init-from``), checked against the settings before any data is
    read."""
    if not config.init_from:
        if config.task != "pretrain":
            raise UsageError(
                f"train {config.task} needs --init-from: the checkpoint to fine-tune (a run directory's "
                "checkpoints/step-N, or a Hub id)"
            )
        return None
    init = open_init_source(config.init_from)
    source = f"the checkpoint ({config.init_from})"
    if "preset" in explicit:
        check_preset_shape(config.preset, init.config, source)
    check_model_changes(config.model, init.config, source)
    if "moe.routing_warmup_steps" not in explicit:
        # Its routing is already trained: random routing at the start would only disturb it.
        config.moe.routing_warmup_steps = 0
    return init


def _auto_hparams(config: TrainConfig, init: InitSource | None, explicit: Mapping[str, Any]) -> None:
    """Learning rate, batch size and steps from a sweep's fit (a new run only: a resume keeps what it saved)."""
    from lingctl.train.sweep.auto import pick

    for name in ("optim.lr", "batch_size"):
        if name in explicit:
            raise UsageError(f"--auto-hparams sets {name}; drop it, or drop --auto-hparams")
    shape = _shape(config, init)
    steps = config.steps if "steps" in explicit and config.budget is None else None
    p = pick(
        Path(str(config.auto_hparams)),
        shape,
        resolve(config).seq_len,
        budget=config.budget,
        steps=steps,
        force=config.force_extrapolation,
    )
    for line in p.lines:
        log.warning("%s", line)
    config.optim.lr, config.batch_size, config.steps = p.lr, p.batch_size, p.steps


def _reporter(config: TrainConfig, run: RunDir) -> report.Reporter | None:
    if config.report_to == "none":
        return None
    report.require(config.report_to)  # before the slow part: a missing package is one line, now
    return report.open_reporter(
        config.report_to, run.local, name=PurePosixPath(run.describe()).name, config=to_dict(config)
    )


def _train(trainer: Trainer, started: float) -> TrainResult:
    """Set up and train; the result with this process's wall time and throughput, and the run's curves."""
    workers = trainer.workers
    try:
        trainer.setup()
        tokens_before, loop_start = trainer.tokens, time.monotonic()
        result = trainer.train()
    except MemoryError:
        raise LingctlError(
            "out of memory",
            hint="lower --batch-size or --seq-len, or choose a smaller preset; checkpoints already written are kept",
        ) from None
    except RuntimeError as exc:
        text = str(exc).lower()
        if "can't allocate memory" in text or "out of memory" in text:  # torch's allocator, not Python's
            raise LingctlError(
                "out of memory: " + str(exc).splitlines()[0][:200],
                hint="lower --batch-size or --seq-len, or choose a smaller preset (lingctl train --dry-run shows the "
                "plan); checkpoints already written are kept",
            ) from None
        if workers.distributed and ("closed by peer" in text or "connection reset" in text):
            raise LingctlError(
                f"worker {workers.rank}: another worker stopped during a collective",
                hint="its own error is above; with --max-restarts the job restarts from the last checkpoint",
            ) from None
        raise
    loop_s = time.monotonic() - loop_start
    result.wall_s = round(time.monotonic() - started, 3)
    result.tokens_per_s = round((result.tokens - tokens_before) / loop_s, 1) if loop_s > 0 else None
    if workers.is_main and not trainer.run.remote_run:
        _write_plot(trainer.run)
    return result


def _records_to(
    reporter: report.Reporter | None, on_record: Callable[[Record], None] | None
) -> Callable[[Record], None]:
    """The trainer's records to the reporter, then to the caller's ``on_record``; the start-up record says
    where the reporter writes (TensorBoard: for s3:// runs the local staging directory, not the store)."""

    def emit(record: Record) -> None:
        if reporter is not None:
            if record.get("event") == "preparing":
                record["report_to"] = reporter.kind
                if reporter.directory is not None:
                    record["report_dir"] = str(reporter.directory)
            reporter.record(record)
        if on_record is not None:
            on_record(record)

    return emit


def _write_plot(run: RunDir) -> None:
    """RUN/loss.png from the run's metrics; a plotting problem is a warning, never a failed run. The name is
    listed in the run's manifest first: a loss.png lingctl did not write (an adopted directory's) is kept."""
    try:
        run.place.claim([PLOT])
    except LingctlError as exc:
        log.warning("the run's curves are not plotted: %s (use 'lingctl train plot RUN -o FILE')", exc)
        return
    try:
        plot_metrics(read_records(run.local / METRICS), run.local / PLOT, title=run.describe())
    except ImportError as exc:
        log.warning("%s not written: matplotlib is not available (%s)", PLOT, exc)
    except Exception as exc:  # a plot is a convenience: the run itself succeeded
        log.warning("%s not written: %s", PLOT, exc)
