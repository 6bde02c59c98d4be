"""`lingctl train --nproc 2` as real processes: torch's elastic launcher, gloo, DDP and EDiT local SGD,
checkpoints through pcache, resume (also past damaged metrics lines), SIGINT to the launcher alone, a worker
killed mid-run (restarted and recorded), and the fault drills."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lingctl.runs.records import read_records

pytestmark = pytest.mark.slow

TINY = ("train", "--preset", "tiny", "--eval-every", "0", "--nproc", "2")


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip().startswith("{")]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ddp_on_two_workers_trains_checkpoints_across_both_resumes_past_damaged_metrics_and_stops_on_sigint(
    lingctl, tmp_path, text_corpus
):
    run = tmp_path / "run"
    common = (*TINY, "--sync", "ddp", "--data", str(text_corpus), "--out", str(run), "--save-every", "4", "--json")
    res = lingctl(*common, "--steps", "8", timeout=300)
    assert res.returncode == 0, res.stderr
    done = [r for r in records(res.stdout) if r.get("event") == "done"]
    assert len(done) == 1 and done[0]["steps"] == 8  # rank 0 alone speaks for the job
    steps = [r for r in metrics(run) if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert steps[-1]["loss"] < steps[0]["loss"]
    # Rank 0 logs for the job, with each worker's pace (from the previous step on).
    assert all(len(r["worker_tokens_per_s"]) == 2 and min(r["worker_tokens_per_s"]) > 0 for r in steps[1:]), steps
    state = run / "checkpoints" / "step-00000008" / "state"
    marker = json.loads((state / "pcache.json").read_text())
    assert marker["world_size"] == 2
    # The replicated model and optimizer were written by both workers, not by rank 0 alone.
    assert (state / "__0_0.distcp").exists() and (state / "__1_0.distcp").exists()
    # Damaged lines in metrics.jsonl, and a torn last one as a kill leaves it: status skips the damaged lines,
    # naming each, and the torn one silently.
    body = (run / "metrics.jsonl").read_text()
    first = len(body.splitlines()) + 1
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(line + "\n" for line in BAD_LINES) + '{"event": "step", "st')
    status = lingctl("train", "status", str(run), "--json", timeout=60)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert json.loads(status.stdout)["step"] == 8
    warned = [f"{run / 'metrics.jsonl'}:{n}: skipped: " for n in range(first, first + len(BAD_LINES))]
    assert all(w in status.stderr for w in warned) and status.stderr.count(": skipped: ") == len(BAD_LINES)
    # --resume goes on past them; then SIGINT to the launcher's pid alone (`kill -INT PID`, as a scheduler or a
    # user sends it, not Ctrl-C to the process group) stops the job as Ctrl-C does: the workers finish their
    # step, save a checkpoint and exit 130.
    proc = subprocess.Popen(
        [sys.executable, "-m", "lingctl", *common, "--steps", "100000", "--resume"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while '"event": "step", "step": 10,' not in (run / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # failed before the launcher ended: leave no process of the job behind
            with contextlib.suppress(psutil.Error):
                descendants = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
            for p in descendants:
                with contextlib.suppress(psutil.Error):
                    p.kill()
    assert proc.returncode == 130, err
    assert "checkpoint saved" in err and "--resume" in err and "Traceback" not in err
    assert len(descendants) >= 3  # torchrun and both workers
    gone = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in descendants):
        assert time.monotonic() < gone, "a worker outlived the launcher"
        time.sleep(0.05)
    last = [r for r in records(out) if r.get("event") == "done"][0]
    assert last["resumed_from"] == 8 and last["stopped"] == "interrupted" and last["steps"] >= 10
    latest = json.loads((run / "latest.json").read_text())
    assert latest["step"] == last["steps"]
    assert json.loads((run / latest["path"] / "state" / "pcache.json").read_text())["world_size"] == 2
    # The history: each step once up to the checkpoint, the damaged lines kept as they were, the torn one gone.
    text = (run / "metrics.jsonl").read_text()
    assert all(text.count(line + "\n") == 1 for line in BAD_LINES) and '"st\n' not in text
    steps = [r["step"] for r in read_records(run / "metrics.jsonl") if r["event"] == "step"]
    assert steps == list(range(1, last["steps"] + 1))
    one = lingctl("train", "--preset", "tiny", "--out", str(run), "--resume", "--steps", "12", timeout=120)
    assert one.returncode == 2 and "checkpointed by 2 worker(s)" in one.stderr


# Lines a reader must skip: a step that is not a number, a list, a loss as text, a step beyond any float, a count
# beyond int64.
BAD_LINES = [
    '{"event": "step", "step": "x", "loss": 1.0, "lr": 0.001, "tokens": 1, "tokens_per_s": 1.0}',
    "[1, 2, 3]",
    '{"event": "step", "step": 9, "loss": "NaN", "lr": 0.001, "tokens": 1, "tokens_per_s": 1.0}',
    '{"event": "eval", "step": 1e400, "eval_loss": 1.0}',
    '{"event": "step", "step": 99999999999999999999999, "loss": 1.0, "lr": 0.001, "tokens": 1, "tokens_per_s": 1.0}',
]


def test_a_killed_worker_restarts_the_job_from_the_last_checkpoint(lingctl, tmp_path, text_corpus):
    run = tmp_path / "run"
    res = lingctl(
        *TINY,
        "--sync",
        "ddp",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
        "--save-every",
        "4",
        "--steps",
        "10",
        "--max-restarts",
        "1",
        "--set",
        "crash_at_step=6",
        "--set",
        "crash_rank=1",
        "--json",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    done = [r for r in records(res.stdout) if r.get("event") == "done"]
    assert done[-1]["resumed_from"] == 4 and done[-1]["steps"] == 10
    steps = [r["step"] for r in metrics(run) if r["event"] == "step"]
    assert steps == list(range(1, 11))  # the records after the checkpoint were replaced, not duplicated
    # The launcher recorded the crash: the killed rank, its signal, the checkpoint restored, the steps lost.
    (crash,) = [json.loads(line) for line in (run / "incidents.jsonl").read_text().splitlines()]
    assert crash["kind"] == "crash" and crash["action"] == "restart" and crash["ranks"] == [1], crash
    assert crash["details"]["signal"] == "SIGKILL" and crash["attempt"] == 0
    assert crash["restored_step"] == 4 and crash["lost_steps"] == 2
    assert crash["recovery_s"] is not None and 0 < crash["recovery_s"] < 240
    # The steps done again are not duplicated in the history: their first records are kept beside the incident.
    abandoned = (run / crash["details"]["abandoned_records"]).read_text().splitlines()
    assert [json.loads(line)["step"] for line in abandoned] == [5, 6]


def test_edit_time_based_with_a_slow_and_a_corrupted_worker_checkpoints_at_syncs_and_resumes(
    lingctl, tmp_path, text_corpus
):
    run = tmp_path / "run"
    common = (
        *TINY,
        "--sync",
        "edit",
        "--sync-every-seconds",
        "0.6",
        "--simulate-slow-rank",
        "1",
        "--slowdown",
        "3",
        "--simulate-bad-rank",
        "1",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
        "--save-every",
        "12",
        "--json",
    )
    res = lingctl(*common, "--steps", "24", timeout=300)
    assert res.returncode == 0, res.stderr
    syncs = [r for r in metrics(run) if r["event"] == "sync"]
    assert len(syncs) >= 2
    # Time-based sync: the slow worker took fewer local steps instead of holding the fast one back.
    assert sum(r["local_steps"][1] for r in syncs) < sum(r["local_steps"][0] for r in syncs), syncs
    assert syncs[-1]["total_local_steps"] >= 48  # the budget: 24 synchronous steps of 2 workers
    # The corrupted worker's pseudo-gradient (x100) got the smaller weight at every sync, and a negligible one
    # once the deltas had grown over more than one local step (weights are softmax(-norm): on a busy machine a
    # sync may come after a single tiny step, where 100x a tiny norm is still small), and the loss did not spike.
    detail = [(r["local_steps"], r["weights"]) for r in syncs]
    assert all(r["weights"][1] < r["weights"][0] for r in syncs), detail
    assert all(r["weights"][1] < 1e-3 for r in syncs if min(r["local_steps"]) >= 2), detail
    assert any(min(r["local_steps"]) >= 2 for r in syncs), detail
    # Each worker's own throughput: the slowed one is the slower.
    rates = [r["worker_tokens_per_s"] for r in syncs]
    assert sum(x[1] for x in rates) < sum(x[0] for x in rates), rates
    losses = [r["loss"] for r in metrics(run) if r["event"] == "step"]
    assert max(losses[len(losses) // 2 :]) < losses[0]
    latest = json.loads((run / "latest.json").read_text())
    assert json.loads((run / latest["path"] / "state" / "pcache.json").read_text())["world_size"] == 2
    again = lingctl(*common, "--steps", "30", "--resume", timeout=300)
    assert again.returncode == 0, again.stderr
    done = [r for r in records(again.stdout) if r.get("event") == "done"][0]
    assert done["resumed_from"] == latest["step"] and done["steps"] >= 30


def test_bad_input_on_several_workers_is_one_line_per_worker_and_the_workers_exit_code(lingctl, tmp_path):
    res = lingctl(
        *TINY, "--steps", "3", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "missing"), timeout=120
    )
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr and "data path not found" in res.stderr
    assert all(line.startswith(("lingctl: error:", "hint:")) for line in res.stderr.strip().splitlines()), res.stderr
    # Not found is not restarted (the watchdog is on, with its default budget of 3): the same input would fail
    # the same way. Nor are bad settings (2) or a failed verification (4).
    assert "restart" not in res.stderr and not (tmp_path / "run" / "incidents.jsonl").exists()
