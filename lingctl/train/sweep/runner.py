"""Running a sweep: every point an ordinary ``lingctl train`` run under ``SWEEP/runs/``, one tokenizer for all of
them, results appended to ``SWEEP/results.jsonl`` as points finish.

A sweep directory holds one spec (``sweep.json``; another spec there is refused). Running it again continues:
finished points (in results.jsonl) are never run again, and a point that was interrupted resumes from its own
last checkpoint (``lingctl train --resume``), or starts over when it had none. Points run one at a time, or
``parallel`` at once with the cores split between them; on a cluster, run the same sweep directory's points
through your scheduler (see docs/train.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import LingctlError, UsageError, VerificationError
from lingctl.train.sweep.spec import Point, SweepSpec, attention_share, points, shape_of

log = logging.getLogger(__name__)

SPEC_FILE = "sweep.json"
RESULTS = "results.jsonl"
TOKENIZER = "tokenizer.json"
RUNS = "runs"
LOGS = "logs"  # each point's command line, stdout (its --json records) and stderr, beside the runs


@dataclass(kw_only=True, slots=True)
class SweepResult:
    directory: str
    points: int
    finished_before: int
    ran: int
    failed: list[str]
    attention_share: float
    elapsed_s: float


def open_sweep(directory: Path, spec: SweepSpec) -> None:
    """Create the sweep directory (or check that it holds this spec); refuse a directory of other files."""
    spec_file = directory / SPEC_FILE
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--out {directory} is a file", hint="give a new or empty directory, or this spec's sweep")
    if spec_file.exists():
        try:
            saved = json.loads(spec_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            saved = None
        if not isinstance(saved, dict):
            raise VerificationError(
                f"{spec_file} is damaged: not the JSON lingctl writes", hint="restore it, or start another sweep"
            )
        if saved.get("digest") != spec.digest():
            raise UsageError(
                f"{directory} holds a sweep of another spec",
                hint="run the same spec to continue it, or choose another --out",
            )
        return
    if directory.exists() and any(directory.iterdir()):
        raise UsageError(f"{directory} is not empty and holds no sweep", hint="choose a new or empty --out")
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_write(spec_file) as (_, f):
        f.write(json.dumps({"digest": spec.digest(), "spec": dataclasses.asdict(spec)}, indent=1).encode())


_FIELDS = frozenset({"id", "family", "budget", "lr", "batch_size", "tokens", "active_parameters", "eval_loss"})


def read_results(directory: Path) -> list[dict[str, Any]]:
    """The finished points' records, from every shard's results file (a line cut short by a kill, or one
    without the fields a record has, is ignored: that point runs again)."""
    lines: list[str] = []
    for path in sorted(directory.glob("results*.jsonl")):
        lines += path.read_text().splitlines()
    out = []
    seen: set[str] = set()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and _FIELDS <= record.keys() and record["id"] not in seen:
            seen.add(record["id"])
            out.append(record)
    return out


def point_results(records: list[dict[str, Any]]) -> list[Any]:
    """The records as ``laws.PointResult``: at their budget (whole steps put a run's own compute within 5% of
    it, and sizes differ in that), an eval that never came as NaN, which the fit leaves out."""
    from lingctl.train.sweep.laws import PointResult

    return [
        PointResult(
            family=r["family"], compute=r["budget"], lr=r["lr"], batch_size=r["batch_size"], tokens=r["tokens"],
            active_parameters=r["active_parameters"], loss=r["eval_loss"] if r["eval_loss"] is not None else math.nan,
        )
        for r in records
    ]  # fmt: skip


def _tokenizer(directory: Path, spec: SweepSpec) -> Path:
    """One tokenizer for every point, trained once on the sweep's data (the same ids for all)."""
    path = directory / TOKENIZER
    if path.exists():
        return path
    from lingctl.model.tokenizer import save_tokenizer, train_tokenizer
    from lingctl.train.data import iter_documents, resolve_sources
    from lingctl.train.dataset import DEFAULT_CORPUS_BYTES, default_files

    files = resolve_sources(spec.data) if spec.data else default_files()
    limit = spec.max_bytes or (None if spec.data else DEFAULT_CORPUS_BYTES)
    tok = train_tokenizer((text for _, text in iter_documents(files, max_bytes=limit)), spec.vocab_size)
    save_tokenizer(tok, path)
    return path


def command(point: Point, spec: SweepSpec, directory: Path, tokenizer: Path) -> list[str]:
    """The ``lingctl train`` command line of a point."""
    run = directory / RUNS / point.id
    args = [
        sys.executable, "-m", "lingctl", "train", "--preset", spec.preset, "--out", str(run),
        "--steps", str(point.steps), "--batch-size", str(point.batch_size), "--seq-len", str(spec.seq_len),
        "--lr", repr(point.lr), "--seed", str(spec.seed), "--tokenizer", str(tokenizer), "--json",
        "--eval-every", "0", "--save-every", str(max(1, point.steps // 4)),
        "--set", f"optim.warmup_steps={point.warmup_steps}",
        "--set", f"eval_batches={math.ceil(spec.eval_rows / point.batch_size)}",
    ]  # fmt: skip
    for path in spec.data:
        args += ["--data", path]
    if spec.max_bytes:
        args += ["--set", f"data.max_bytes={spec.max_bytes}"]
    for name, value in point.model.items():
        args += ["--set", f"model.{name}={json.dumps(value)}"]
    if run.exists():
        args.append("--resume")  # from its last checkpoint, or from the start when it had none
    return args


def _done_record(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "done":
            return record
    return None


def _last_eval(run: Path) -> float | None:
    from lingctl.runs.layout import METRICS
    from lingctl.runs.records import read_records

    evals = [r["eval_loss"] for r in read_records(run / METRICS) if r.get("event") == "eval"]
    return evals[-1] if evals else None


def results_file(shard: tuple[int, int] | None) -> str:
    """Each shard appends to its own file, so machines sharing the directory never write the same file."""
    return RESULTS if shard is None else f"results-{shard[0]}-of-{shard[1]}.jsonl"


def _append(directory: Path, name: str, record: dict[str, Any]) -> None:
    with open(directory / name, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_sweep(
    directory: Path,
    spec: SweepSpec,
    *,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    shard: tuple[int, int] | None = None,
) -> SweepResult:
    """Run the points not finished yet, ``spec.parallel`` at once; each finished one is appended to the results
    (and given to ``on_point``). A failed point is reported and left for the next run of the sweep. ``shard``
    ``(i, n)``: only every n-th point from the i-th (several machines sharing the sweep directory)."""
    began = time.monotonic()
    open_sweep(directory, spec)
    todo_all = points(spec)
    if shard is not None:
        todo_all = todo_all[shard[0] :: shard[1]]
    finished = {r["id"] for r in read_results(directory)}
    todo = [p for p in todo_all if p.id not in finished]
    tokenizer = _tokenizer(directory, spec)
    threads = max(1, (os.cpu_count() or 1) // spec.parallel)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    running: dict[str, tuple[Point, subprocess.Popen[bytes]]] = {}
    failed: list[str] = []
    ran = 0
    (directory / LOGS).mkdir(exist_ok=True)
    while todo or running:
        while todo and len(running) < spec.parallel and not (should_stop and should_stop()):
            p = todo.pop(0)
            out, err = directory / LOGS / f"{p.id}.jsonl", directory / LOGS / f"{p.id}.err"
            args = command(p, spec, directory, tokenizer)
            (directory / LOGS / f"{p.id}.cmd").write_text(shlex.join(args) + "\n")
            with open(out, "wb") as fo, open(err, "wb") as fe:  # files, not pipes: a long point writes a lot
                running[p.id] = (
                    p,
                    subprocess.Popen(args, stdout=fo, stderr=fe, env=env),
                )
        if not running:
            break
        pid, (p, proc) = _wait_any(running)
        del running[pid]
        done = _done_record((directory / LOGS / f"{p.id}.jsonl").read_text(errors="replace"))
        if proc.returncode != 0 or done is None:
            failed.append(p.id)
            lines = (directory / LOGS / f"{p.id}.err").read_text(errors="replace").strip().splitlines()
            log.warning("point %s failed (exit %s): %s", p.id, proc.returncode, (lines or ["no output"])[-1])
            continue
        if done["eval_loss"] is None:  # a point that had finished before the sweep was stopped: its own record
            done["eval_loss"] = _last_eval(directory / RUNS / p.id)
        record = {
            "id": p.id, "family": p.family, "budget": p.budget, "lr": p.lr, "batch_size": p.batch_size,
            "steps": done["steps"], "tokens": done["tokens"], "active_parameters": p.active_parameters,
            "compute": 6.0 * p.active_parameters * done["tokens"], "eval_loss": done["eval_loss"],
            "train_loss": done["last_loss"], "run": str(Path(RUNS) / p.id),
        }  # fmt: skip
        _append(directory, results_file(shard), record)
        ran += 1
        if on_point is not None:
            on_point(record)
    return SweepResult(
        directory=str(directory),
        points=len(todo_all),
        finished_before=len(finished),
        ran=ran,
        failed=failed,
        attention_share=round(attention_share(shape_of(spec, spec.model), spec.seq_len), 4),
        elapsed_s=round(time.monotonic() - began, 1),
    )


def _wait_any(
    running: dict[str, tuple[Point, subprocess.Popen[bytes]]],
) -> tuple[str, tuple[Point, subprocess.Popen[bytes]]]:
    """The first point whose process has ended."""
    while True:
        for pid, entry in running.items():
            if entry[1].poll() is not None:
                return pid, entry
        if len(running) == 1:
            pid, entry = next(iter(running.items()))
            entry[1].wait()
            return pid, entry
        time.sleep(0.2)


def load_spec_file(path: Path | None) -> SweepSpec:
    """The ``[sweep]`` table of a TOML file, or the built-in spec (``None``)."""
    from lingctl.core.config import load_toml
    from lingctl.train.sweep.spec import BUILTIN, read_spec

    if path is None:
        return read_spec(dict(BUILTIN), "the built-in sweep")
    table = load_toml(path, "sweep")
    if not table:
        raise LingctlError(f"{path}: no [sweep] table")
    return read_spec(table, str(path))
