"""``flood eval``: score a model, or every checkpoint of a training run, on task files.

``--model`` is a checkpoint directory, a Hugging Face model id (from the cache), or a lingctl training run
directory. For a run every complete checkpoint is evaluated in step order (``--follow``: and the new ones as
training writes them, until the run reaches its target), each into ``OUT/step-NNNNNNNN.jsonl``; after each
one the table (``scores.csv``, ``scores.md``) and the figure (``scores.png``) of each task's score against
training tokens are rewritten, and a checkpoint whose score fell by more than ``--drop-k`` standard errors is
flagged with the training tokens consumed since the previous checkpoint (report §1.3: an abnormal result
points at a data segment).

An evaluation already written with the same settings is reused, so a rerun, or a run interrupted half-way,
continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import Interrupted, LingctlError, UsageError, os_error
from lingctl.flood.batch.jsonl_file import lstat_own
from lingctl.flood.cluster.options import ClusterOptions
from lingctl.flood.engine.loop import EngineStats
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.engine.session import Progress
from lingctl.flood.eval.model import ModelEvaluation, open_model, task_scores
from lingctl.flood.eval.output import ResultsFile, eval_manifest, order_records
from lingctl.flood.eval.report import CheckpointScores, Drop, TaskScore, find_drops, plot_scores, write_table
from lingctl.flood.eval.task_files import read_tasks
from lingctl.flood.eval.tasks import Task
from lingctl.flood.weights.model_dir import ModelDir
from lingctl.flood.weights.remote_model import flood_model_dir
from lingctl.runs.checkpoints import is_run_dir, list_checkpoints, run_finished

log = logging.getLogger(__name__)

DIR_MARKER = "lingctl-eval.json"  # in a run's output directory: lingctl made it, and may write its files
TABLE_CSV, TABLE_MD, PLOT = "scores.csv", "scores.md", "scores.png"
STDOUT = "-"


@dataclass(kw_only=True, slots=True)
class EvalOptions:
    tasks: list[Path]
    model: Path | str
    out: Path | None = None  # a model: the results JSONL ('-': standard output); a run: a directory
    num_fewshot: int | None = None  # None: each task file's own (an lm-eval task's num_fewshot), else 0
    regex: str | None = None
    engine: EngineOptions = field(default_factory=EngineOptions)
    follow: bool = False
    drop_k: float = 2.0
    poll_s: float = 5.0  # --follow: how often the run is looked at for a new checkpoint
    cluster: ClusterOptions | None = None  # --ray: each model's items spread over engines on a Ray cluster

    def validate(self) -> None:
        self.engine.validate()
        if self.cluster is not None:
            self.cluster.validate()
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UsageError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.drop_k < 0:
            raise UsageError(f"--drop-k must be >= 0, got {self.drop_k}")


@dataclass(kw_only=True, slots=True)
class ModelResult:
    model: str
    out: str
    step: int | None = None
    tokens: int | None = None
    items: int = 0
    errors: int = 0  # items that could not run (counted wrong)
    truncated: int = 0  # items whose context was cut on the left to fit
    reused: bool = False  # read from an earlier evaluation with the same settings
    seconds: float = 0.0
    load_seconds: float = 0.0
    tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    scored_tokens: int = 0
    tasks: dict[str, TaskScore] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)


@dataclass(kw_only=True, slots=True)
class EvalSummary:
    mode: str  # "model" or "run"
    model: str
    out: str
    num_fewshot: int | dict[str, int]  # one for every task, else per task
    results: list[ModelResult] = field(default_factory=list)  # one per model / checkpoint, in step order
    drops: list[Drop] = field(default_factory=list)
    table: str | None = None
    plot: str | None = None
    seconds: float = 0.0
    tokens_per_s: float = 0.0  # over the models evaluated in this invocation (reused ones excluded)

    @property
    def tasks(self) -> dict[str, TaskScore]:
        """The last model's scores."""
        return self.results[-1].tasks if self.results else {}


def run_eval(
    opts: EvalOptions,
    *,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> EvalSummary:
    opts.validate()
    tasks = read_tasks(opts.tasks, regex=opts.regex, num_fewshot=opts.num_fewshot)
    started = time.monotonic()
    spec = opts.model
    if Path(spec).is_dir() and is_run_dir(Path(spec)):
        summary = _run_mode(Path(spec), tasks, opts, should_stop, on_progress)
    else:
        if opts.follow:
            raise UsageError(f"--follow needs a training run directory; {spec} is not one")
        model_dir = flood_model_dir(spec, option="--model")
        out = opts.out if opts.out is not None else default_out(opts.tasks[0])
        summary = EvalSummary(mode="model", model=str(spec), out=str(out), num_fewshot=fewshot_setting(tasks))
        summary.results.append(
            evaluate_one(
                model_dir,
                tasks,
                opts,
                out,
                label=str(spec),
                spec=str(spec),
                should_stop=should_stop,
                on_progress=on_progress,
            )
        )
    summary.seconds = round(time.monotonic() - started, 3)
    fresh = [r for r in summary.results if not r.reused]
    busy = sum(r.seconds for r in fresh)
    work = sum(r.prompt_tokens - r.cached_prompt_tokens + r.scored_tokens for r in fresh)
    summary.tokens_per_s = round(work / busy, 1) if busy > 0 else 0.0
    return summary


def default_out(first_task: Path) -> Path:
    """``tasks/mc.jsonl`` -> ``tasks/mc.eval.jsonl``."""
    first_task = Path(first_task)
    return first_task.with_name(first_task.name.removesuffix(".jsonl") + ".eval.jsonl")


def evaluate_one(
    model_dir: Path,
    tasks: list[Task],
    opts: EvalOptions,
    out: Path | str,
    *,
    label: str,
    spec: str | None = None,
    step: int | None = None,
    tokens: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> ModelResult:
    """One model's evaluation into ``out`` (reused when already there with the same settings)."""
    md, codec, engine = open_model(model_dir, opts.engine)
    opts = dataclasses.replace(opts, engine=engine)
    to_stdout = str(out) == STDOUT
    result = ModelResult(model=label, out="stdout" if to_stdout else str(out), step=step, tokens=tokens)
    files = None if to_stdout else _results_file(md, tasks, opts, Path(out))
    if files is not None and files.complete:
        result.reused = True
        return _finish_result(result, tasks, files.done)
    records: list[dict[str, Any]] = list(files.done) if files is not None else []
    try:  # a continued journal is open from here on
        evaluation = ModelEvaluation(
            md,
            codec,
            tasks,
            engine=opts.engine,
            skip=files.done_keys if files is not None else None,
            cluster=opts.cluster,
            spec=spec,
        )
        total = len(records) + evaluation.items

        def step_cb(stats: EngineStats) -> None:
            if on_progress is not None:
                on_progress(Progress(label=label, unit="items", done=len(records), total=total, stats=stats))

        for record in evaluation.records(should_stop=should_stop, on_step=step_cb):
            records.append(record)
            if files is not None:
                files.append(record)
    finally:
        if files is not None:
            files.close()
    run = evaluation.run
    result.seconds, result.load_seconds, result.tokens_per_s = round(run.seconds, 3), run.load_seconds, run.tokens_per_s
    result.prompt_tokens, result.cached_prompt_tokens = run.prompt_tokens, run.cached_prompt_tokens
    result.scored_tokens = run.scored_tokens
    # '-o -': the records in task order, for the command to write to standard output
    records = files.finish(tasks) if files is not None else order_records(tasks, records)
    return _finish_result(result, tasks, records)


def _results_file(md: ModelDir, tasks: list[Task], opts: EvalOptions, out: Path) -> ResultsFile:
    """The results file of this model at ``out``: one to reuse or continue when its manifest matches."""
    manifest = eval_manifest(
        model=str(md.path),
        fingerprint=md.fingerprint(),
        tasks=tasks,
        num_fewshot=fewshot_setting(tasks),
        engine=opts.engine,
    )
    return ResultsFile(out, manifest)


def fewshot_setting(tasks: list[Task]) -> int | dict[str, int]:
    """The shots before each item: one number when every task has the same, else task → number."""
    ks = {t.num_fewshot for t in tasks}
    return ks.pop() if len(ks) == 1 else {t.name: t.num_fewshot for t in tasks}


def _finish_result(result: ModelResult, tasks: list[Task], records: list[dict[str, Any]]) -> ModelResult:
    result.records = records
    result.items = len(records)
    result.errors = sum(1 for r in records if "error" in r)
    result.truncated = sum(1 for r in records if r.get("truncated"))
    result.tasks = task_scores(tasks, records)
    if result.errors:
        log.warning(
            "%s: %d items could not be evaluated (counted wrong); see 'error' in %s",
            result.model,
            result.errors,
            result.out,
        )
    return result


# -- a training run ------------------------------------------------------------------------------------
def _run_mode(
    run: Path,
    tasks: list[Task],
    opts: EvalOptions,
    should_stop: Callable[[], bool] | None,
    on_progress: Callable[[Progress], None] | None,
) -> EvalSummary:
    out = Path(opts.out) if opts.out is not None else run.parent / f"{run.name}.eval"
    if str(out) == STDOUT:
        raise UsageError("a run's evaluation writes a directory of files; '-o -' is for one model", hint="pass -o DIR")
    _own_dir(out, run)
    summary = EvalSummary(mode="run", model=str(run), out=str(out), num_fewshot=fewshot_setting(tasks))
    done: set[int] = set()
    while True:
        # Asked before listing: once the run is finished, this listing holds its last checkpoint.
        finished = not opts.follow or run_finished(run)
        new = [cp for cp in list_checkpoints(run) if cp.step not in done]
        for cp in new:
            if should_stop is not None and should_stop():
                raise Interrupted(
                    "interrupted; the checkpoints evaluated so far are kept", hint="run it again to continue"
                )
            try:
                result = evaluate_one(
                    cp.path,
                    tasks,
                    opts,
                    out / f"step-{cp.step:08d}.jsonl",
                    label=f"step {cp.step}",
                    step=cp.step,
                    tokens=cp.tokens,
                    should_stop=should_stop,
                    on_progress=on_progress,
                )
            except LingctlError:
                if cp.path.exists():
                    raise
                # Training pruned it (keep_checkpoints) between the listing and the load.
                log.warning("checkpoint step %d was removed before it could be evaluated; skipped", cp.step)
                done.add(cp.step)
                continue
            result.records = []  # the files hold them; a long run's records need not stay in memory
            summary.results.append(result)
            done.add(cp.step)
            _report(summary, out, opts.drop_k)
        if finished:
            break
        if not new:
            _wait(opts.poll_s, should_stop)
    if not summary.results:
        raise UsageError(
            f"{run} has no complete checkpoint yet", hint="wait for its first checkpoint, or pass --follow"
        )
    return summary


def _wait(seconds: float, should_stop: Callable[[], bool] | None) -> None:
    """Sleep until the next look at the run, waking early for a stop request."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if should_stop is not None and should_stop():
            raise Interrupted("stopped following the run; the checkpoints evaluated so far are kept")
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _report(summary: EvalSummary, out: Path, k: float) -> None:
    points = [CheckpointScores(step=r.step, tokens=r.tokens, model=r.model, scores=r.tasks) for r in summary.results]
    summary.drops = [d for metric in ("acc", "acc_norm") for d in find_drops(points, k, metric=metric)]
    write_table(points, summary.drops, out / TABLE_CSV, out / TABLE_MD)
    summary.table = str(out / TABLE_MD)
    summary.plot = str(plot_scores(points, summary.drops, out / PLOT))


def _own_dir(out: Path, run: Path) -> None:
    """A new (or empty) directory gets lingctl's marker; one with the marker is ours to write into; any other
    directory with files in it is refused, as is a link, or a directory or marker of another user."""
    marker = out / DIR_MARKER
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise os_error(exc, str(out)) from exc
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(
                f"{out} is a symbolic link; lingctl writes a run's evaluation only into a directory it made",
                hint="pass -o DIR",
            )
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{out} is a file; a run's evaluation needs a directory", hint="pass -o DIR")
        if st.st_uid != os.geteuid():
            raise UsageError(
                f"{out} belongs to uid {st.st_uid}, not to uid {os.geteuid()}, so lingctl did not make it",
                hint="choose another -o",
            )
        if lstat_own(marker) is not None:
            return
    try:
        if st is not None and any(out.iterdir()):
            raise UsageError(
                f"{out} already has files that lingctl flood eval did not write",
                hint="choose another -o (lingctl never writes into a directory it did not make)",
            )
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, str(out)) from exc
    with atomic_write(marker) as (_, f):
        f.write(json.dumps({"format": "lingctl-eval-dir", "run": str(run.resolve())}, indent=2).encode() + b"\n")
