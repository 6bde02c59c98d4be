"""The watchdog inside the workers, as real `lingctl train` processes: a drilled NaN and drilled persistent spikes
are rolled back to the last checkpoint with a lower learning rate and the data window skipped; a routing
collapse is warned about; the history keeps one record per step; a resume after a rollback continues as the
run that was not interrupted; a divergence that cannot be rolled back ends the job, which the launcher does not
restart as if it had crashed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = ("train", "--preset", "tiny", "--eval-every", "0")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps(run: Path) -> list[dict]:
    return [r for r in lines(run / "metrics.jsonl") if r["event"] == "step"]


def test_two_workers_roll_back_a_nan_and_persistent_spikes_and_warn_of_routing_collapse_and_a_straggler(
    lingctl, tmp_path, text_corpus
):
    run = tmp_path / "run"
    res = lingctl(
        *TINY,
        "--nproc",
        "2",
        "--steps",
        "14",
        "--save-every",
        "4",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
        "--set",
        "simulate_nan=6",
        "--set",
        "simulate_spikes=10:6",
        "--set",
        "simulate_routing_collapse=1",
        "--set",
        "watchdog_config.routing_window=4",
        "--set",
        "watchdog_config.straggler_window=4",
        "--simulate-slow-rank",
        "1",
        "--slowdown",
        "3",
        "--json",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    incidents = lines(run / "incidents.jsonl")
    rollbacks = [r for r in incidents if r["kind"] == "divergence"]
    assert [r["action"] for r in rollbacks] == ["rollback", "rollback"], incidents
    nan, spikes = rollbacks
    # The NaN of step 6: back to the checkpoint of step 4, learning rate halved, its data skipped.
    assert nan["ranks"] == [0, 1] and nan["restored_step"] == 4 and nan["lost_steps"] == 1
    assert "nan" in nan["details"]["reason"] and nan["details"]["lr_scale"] == 0.5
    low, high = nan["details"]["skipped_window"]
    assert high > low >= 0
    assert [r["step"] for r in nan["details"]["abandoned_records"]] == [5]
    # Six spikes in a row from step 10: a divergence, back to step 8, the learning rate halved again.
    assert spikes["restored_step"] == 8 and "spikes within" in spikes["details"]["reason"]
    assert spikes["details"]["lr_scale"] == 0.25
    for r in rollbacks:
        assert 0 <= r["detected_after_s"] < 60 and r["recovery_s"] is not None and r["attempt"] == 0
    # The collapsed router of layer 1: every token to the same experts.
    routing = [r for r in incidents if r["kind"] == "routing"]
    assert routing and routing[0]["action"] == "warn" and routing[0]["details"]["layer"] == 1
    assert routing[0]["details"]["dead_experts"] and routing[0]["details"]["max_over_mean"] >= 4.0
    # The slowed worker (it sleeps twice its step time after each step): a straggler, in its own host work.
    (slow,) = [r for r in incidents if r["kind"] == "straggler"]
    assert slow["ranks"] == [1] and slow["details"]["category"] == "other", slow
    assert slow["details"]["busy_s"] > 1.5 * slow["details"]["others_busy_s"]
    # One history: each step once, the surviving trajectory's learning rates halved after each rollback.
    history = steps(run)
    assert [r["step"] for r in history] == list(range(1, 15))
    lr = {r["step"]: r["lr"] for r in history}
    out = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    seen = {r["step"]: r["lr"] for r in out if r.get("event") == "step" and r["step"] == 5}
    assert lr[5] == pytest.approx(seen[5], rel=1e-9)  # the record kept is the one after the rollback
    done = [r for r in out if r.get("event") == "done"]
    assert done[-1]["steps"] == 14 and done[-1]["stopped"] == "completed"
    # `train status` summarises it from the files.
    status = lingctl("train", "status", str(run), "--json", timeout=60)
    assert status.returncode == 0, status.stderr
    summary = json.loads(status.stdout)
    assert summary["step"] == 14 and summary["target_steps"] == 14 and summary["finished"] is True
    assert summary["incidents"]["divergence"] == 2 and summary["incidents"]["routing"] >= 1
    assert summary["checkpoint"].endswith("step-00000014") and summary["tokens_per_s"] > 0
    human = lingctl("train", "status", str(run), timeout=60)
    assert "2 divergence" in human.stdout and "rollback to step 4" in human.stdout
    missing = lingctl("train", "status", str(tmp_path / "nothing"), timeout=60)
    assert (
        missing.returncode == 3 and missing.stderr.startswith("lingctl: error:") and "Traceback" not in missing.stderr
    )


def test_a_resume_after_a_rollback_applies_it_again_and_matches_the_uninterrupted_run(lingctl, tmp_path, text_corpus):
    common = (*TINY, "--steps", "9", "--save-every", "4", "--data", str(text_corpus), "--set", "watchdog=true")
    whole = tmp_path / "whole"
    res = lingctl(*common, "--out", str(whole), "--set", "simulate_nan=6", timeout=300)
    assert res.returncode == 0, res.stderr
    cut = tmp_path / "cut"
    # Rolled back at step 6, then killed at step 7, before the next checkpoint.
    res = lingctl(*common, "--out", str(cut), "--set", "simulate_nan=6", "--set", "crash_at_step=7", timeout=300)
    assert res.returncode != 0
    assert [r["action"] for r in lines(cut / "incidents.jsonl")] == ["rollback"]
    res = lingctl(*common, "--out", str(cut), "--resume", timeout=300)
    assert res.returncode == 0, res.stderr
    a, b = steps(whole), steps(cut)
    assert [r["step"] for r in b] == list(range(1, 10))
    assert [(r["step"], r["loss"], r["lr"]) for r in a] == [(r["step"], r["loss"], r["lr"]) for r in b]


def test_two_workers_without_a_checkpoint_give_up_a_divergence_and_the_launcher_does_not_restart_them(
    lingctl, tmp_path, text_corpus
):
    run = tmp_path / "run"
    res = lingctl(
        *TINY,
        "--nproc",
        "2",
        "--steps",
        "6",
        "--save-every",
        "0",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
        "--simulate-nan",
        "3",
        timeout=300,
    )
    assert res.returncode == 1, res.stderr
    assert "no checkpoint to go back to" in res.stderr and "Traceback" not in res.stderr
    # Divergence is not a crash: the workers recorded that they gave up, and the launcher, which reads that,
    # stopped the job instead of restarting it (a restart would train the same data at the same rate).
    (incident,) = lines(run / "incidents.jsonl")
    assert incident["kind"] == "divergence" and incident["action"] == "give_up" and incident["ranks"] == [0, 1]
    assert "training stopped: it diverged" in res.stderr and "not restarted" in res.stderr
    assert "restarting" not in res.stderr and "a worker failed" not in res.stderr, res.stderr
    assert not (run / "latest.json").exists()


def test_local_sgd_a_diverged_worker_restarts_the_job_with_a_lower_learning_rate(lingctl, tmp_path, text_corpus):
    run = tmp_path / "run"
    res = lingctl(
        *TINY,
        "--nproc",
        "2",
        "--sync",
        "edit",
        "--sync-every",
        "2",
        "--steps",
        "10",
        "--save-every",
        "4",
        "--simulate-nan",
        "7",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
        "--json",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    incidents = lines(run / "incidents.jsonl")
    (diverged,) = [r for r in incidents if r["kind"] == "divergence"]
    # Worker 0 alone diverged (its own local step 7): the others cannot roll back with it, so the job restarts
    # from the last checkpoint, where the lower learning rate is applied.
    assert diverged["action"] == "restart" and diverged["ranks"] == [0] and diverged["restored_step"] == 4
    assert "nan" in diverged["details"]["reason"]
    # Recorded as what it was, not as a crash as well.
    assert not [r for r in incidents if r["kind"] == "crash"], incidents
    assert "worker 0 diverged (" in res.stderr and "a worker failed" not in res.stderr, res.stderr
    history = steps(run)
    assert history and max(r["step"] for r in history) >= 5
    # The learning rate still rises in its warm-up here: after the restart it is lower than before, by the factor.
    before = [r["lr"] for r in history if r["time"] < diverged["time"]]
    later = [r["lr"] for r in history if r["time"] > diverged["time"]]
    assert before and later and later[0] < before[-1], (before, later)
    after = [r for r in lines(run / "metrics.jsonl") if r["event"] == "sync" and r["step"] > 4]
    assert after, "the restarted job went on syncing"
    done = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r for r in done if r.get("event") == "done"][-1]["steps"] >= 10
