"""Start or resume a training run: settings from flags/TOML, or from the run's own checkpoint on resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from lingctl.core.config import build, from_mapping, load_toml, to_dict
from lingctl.core.errors import LingctlError, UsageError, VerificationError
from lingctl.core.storage import S3Options
from lingctl.model.checkpoint_files import TRAIN_CONFIG
from lingctl.runs.records import read_records
from lingctl.train import report
from lingctl.train.config import TrainConfig, check_model_changes, check_preset_shape
from lingctl.train.data import resolve_sources
from lingctl.train.local_sgd import LocalSgdTrainer
from lingctl.train.plot import PLOT_FILE, plot_metrics
from lingctl.train.rundir import METRICS, RunDir
from lingctl.train.sources import open_init_source
from lingctl.train.trainer import Record, Trainer, TrainResult
from lingctl.train.workers import start as start_workers
from lingctl.train.workers import stop as stop_workers

log = logging.getLogger(__name__)

# Settings a resumed run may change; everything else must match the run's saved config, or the resumed
# run would silently be a different experiment (the loss sequence would no longer continue).
RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        "max_seconds",
        "eval_every",
        "eval_batches",
        "save_every",
        "keep_checkpoints",
        "inject_spikes",
        "inject_spike_factor",
        "crash_at_step",
        "crash_rank",
        "simulate_slow_rank",
        "slowdown",
        "simulate_bad_rank",
        "max_consecutive_skips",
        "max_shard_size",
        "hf_code_repo",
        "report_to",
        "watchdog",
        "watchdog_config",
        "simulate_hang",
        "simulate_nan",
        "simulate_spikes",
        "simulate_routing_collapse",
    }
)


def default_out(preset: str) -> str:
    return str(Path("runs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")


def _saved_config(run: RunDir, latest: dict[str, Any]) -> dict[str, Any]:
    key = f"{latest['path']}/{TRAIN_CONFIG}"
    raw = run.read(key)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise VerificationError(
            f"{run.describe()}/{key} is damaged: not a JSON object",
            hint="resume needs the settings the run was started with; restore the file",
        )
    return data


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
    config.crash_at_step = None
    config.simulate_hang = config.simulate_spikes = None
    config.simulate_nan = config.simulate_routing_collapse = None


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
    if resume and out is None:
        raise UsageError("--resume needs --out: the run directory to continue")
    if workers.distributed and out is None:
        out = workers.broadcast(default_out(requested.preset))  # one directory for all workers
    run = RunDir(out or default_out(requested.preset), s3, cache_dir=cache_dir, adopt=adopt)
    config = requested
    latest = run.latest() if resume else None
    if resume and latest is None:
        log.warning("no checkpoint in %s yet; starting from step 0", run.describe())
    if latest is not None:
        config = resume_config(_saved_config(run, latest), requested, explicit)
    if workers.restarts > 0:
        _no_drills(config)
    init = None
    if config.init_from and latest is None:
        init = open_init_source(config.init_from)
        source = f"the checkpoint ({config.init_from})"
        if "preset" in explicit:  # refused before any data is read
            check_preset_shape(config.preset, init.config, source)
        check_model_changes(config.model, init.config, source)
        if "moe.routing_warmup_steps" not in explicit:
            # Its routing is already trained: random routing at the start would only disturb it.
            config.moe.routing_warmup_steps = 0
    if config.data.paths:
        resolve_sources(config.data.paths)  # a missing data path is refused now, not after the start-up line
    # Rank 0 reports for the job (its records are the run's); the other workers never open a writer.
    reporter = None
    if workers.is_main and config.report_to != "none":
        report.require(config.report_to)  # before the slow part: a missing package is one line, now
        reporter = report.open_reporter(
            config.report_to, run.local, name=PurePosixPath(run.describe()).name, config=to_dict(config)
        )
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
        trainer.setup()
        tokens_before, loop_start = trainer.tokens, time.monotonic()
        result = trainer.train()
        loop_s = time.monotonic() - loop_start
        result.wall_s = round(time.monotonic() - started, 3)
        result.tokens_per_s = round((result.tokens - tokens_before) / loop_s, 1) if loop_s > 0 else None
        if workers.is_main and not run.remote_run:
            _write_plot(run)
        return result
    except MemoryError:
        raise LingctlError(
            "out of memory",
            hint="lower --batch-size or --seq-len, or choose a smaller preset; checkpoints already written are kept",
        ) from None
    except RuntimeError as exc:
        text = str(exc).lower()
        if workers.distributed and ("closed by peer" in text or "connection reset" in text):
            raise LingctlError(
                f"worker {workers.rank}: another worker stopped during a collective",
                hint="its own error is above; with --max-restarts the job restarts from the last checkpoint",
            ) from None
        raise
    finally:
        if reporter is not None:
            reporter.close()
        stop_workers(workers)


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
        run.place.claim([PLOT_FILE])
    except LingctlError as exc:
        log.warning("the run's curves are not plotted: %s (use 'lingctl train plot RUN -o FILE')", exc)
        return
    try:
        plot_metrics(read_records(run.local / METRICS), run.local / PLOT_FILE, title=run.describe())
    except ImportError as exc:
        log.warning("%s not written: matplotlib is not available (%s)", PLOT_FILE, exc)
    except Exception as exc:  # a plot is a convenience: the run itself succeeded
        log.warning("%s not written: %s", PLOT_FILE, exc)
