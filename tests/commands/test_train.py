"""`lingctl train` as a real subprocess: training, kill-and-resume, SIGTERM, an S3 run directory; errors raised
before any training (and one `pcache status`) run the CLI in this process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lingctl.cli import run as cli_run
from lingctl.core.storage import S3Options
from lingctl.core.storage.s3.store import make_client
from lingctl.model.checkpoint import load_checkpoint
from tests.commands.conftest import RUN20

TINY = ("train", "--preset", "tiny", "--eval-every", "0")


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def step_losses(path: Path) -> list[tuple[int, float]]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["event"] == "step":
            out.append((r["step"], r["loss"]))
    return out


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process (errors raised before any training, and reading a status): exit code, stdout and
    stderr."""
    code = cli_run(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tiny_preset_20_steps_lowers_the_loss_and_saves_a_loadable_checkpoint(run20):
    run, stdout = run20
    recs = records(stdout)
    losses = [r["loss"] for r in recs if r["event"] == "step"]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    done = recs[-1]
    assert done["event"] == "done" and done["steps"] == 20 and done["stopped"] == "completed"
    ckpt = run / done["checkpoint"]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "bailing_moe" and config["architectures"] == ["BailingMoeForCausalLM"]
    model = load_checkpoint(ckpt)
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, config["vocab_size"]) and torch.isfinite(logits).all()
    assert json.loads((run / "latest.json").read_text())["step"] == 20
    assert (run / "tokenizer.json").exists() and (ckpt / "tokenizer.json").exists()


def test_kill_and_resume_reproduces_the_uninterrupted_loss_sequence(lingctl, tmp_path, text_corpus, run20):
    a = run20[0]  # the same settings, never interrupted
    common = (*RUN20, "--data", str(text_corpus))
    b = tmp_path / "b"
    killed = lingctl(*common, "--out", str(b), "--set", "crash_at_step=14")
    assert killed.returncode == -signal.SIGKILL
    assert json.loads((b / "latest.json").read_text())["step"] == 12
    assert [s for s, _ in step_losses(b / "metrics.jsonl")] == list(range(1, 15))  # 13, 14 ran past the checkpoint
    resumed = lingctl(*common, "--out", str(b), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert records(resumed.stdout)[-1]["resumed_from"] == 12
    assert step_losses(b / "metrics.jsonl") == step_losses(a / "metrics.jsonl")
    assert len(step_losses(a / "metrics.jsonl")) == 20


def test_sigterm_finishes_the_step_saves_and_exits_130(tmp_path, text_corpus):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lingctl",
            *TINY,
            "--steps",
            "100000",
            "--save-every",
            "0",
            "--data",
            str(text_corpus),
            "--out",
            str(run),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and '"step": 3,' in metrics.read_text():
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "checkpoint saved" in err and "--resume" in err
    saved = json.loads((run / "latest.json").read_text())["step"]
    assert saved >= 3
    assert (run / f"checkpoints/step-{saved:08d}" / "model.safetensors").exists()
    # train status says the run was stopped, not that it went quiet (which reads like a hang)
    status = subprocess.run(
        [sys.executable, "-m", "lingctl", "train", "status", str(run)], capture_output=True, text=True, timeout=60
    )
    assert "stopped (interrupted)" in status.stdout and "--resume" in status.stdout, status.stdout


def test_an_existing_run_is_never_overwritten_and_resume_refuses_changed_settings(
    capsys, lingctl, tmp_path, text_corpus, small_run
):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)  # a finished 2-step run
    before = (run / "metrics.jsonl").read_bytes()
    code, _, err = cli(capsys, *TINY, "--steps", "2", "--data", str(text_corpus), "--out", str(run))
    assert code == 2
    assert err.startswith("lingctl: error:") and "--resume" in err and "Traceback" not in err
    assert (run / "metrics.jsonl").read_bytes() == before
    code, _, err = cli(capsys, *TINY, "--seq-len", "32", "--out", str(run), "--resume")
    assert code == 2 and "seq_len" in err
    more = lingctl("train", "--out", str(run), "--resume", "--steps", "4", "--json")
    assert more.returncode == 0, more.stderr
    assert records(more.stdout)[-1]["steps"] == 4


def test_bad_data_and_bad_preset_are_one_line_errors(capsys, tmp_path):
    code, _, err = cli(capsys, "train", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "r"))
    assert code == 3
    assert err.splitlines()[0] == f"lingctl: error: data path not found: {tmp_path / 'nope.txt'}"
    assert "Traceback" not in err
    code, _, err = cli(capsys, "train", "--preset", "huge", "--out", str(tmp_path / "r2"))
    assert code == 2
    assert err.splitlines()[0] == "lingctl: error: unknown model preset 'huge'"
    assert "tiny, small, ling-lite, ling-plus" in err
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--set", "model.num_heads=3", "--out", str(tmp_path / "r3"))
    assert code == 2 and "num_heads" in err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_bfloat16_autocast_with_grouped_dispatch_trains(lingctl, tmp_path, text_corpus):
    res = lingctl(
        *TINY,
        "--steps",
        "3",
        "--dtype",
        "bfloat16",
        "--dispatch",
        "grouped",
        "--data",
        str(text_corpus),
        "--out",
        str(tmp_path / "run"),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    losses = [r["loss"] for r in records(res.stdout) if r["event"] == "step"]
    assert len(losses) == 3 and all(5.0 < x < 9.0 for x in losses)


def test_run_directory_in_s3_trains_and_resumes(capsys, monkeypatch, lingctl, tmp_path, text_corpus, s3_bucket, s3_env):
    env = {**s3_env, "LINGCTL_CACHE_DIR": str(tmp_path / "cache")}
    url = f"s3://{s3_bucket}/runs/a"
    common = (*TINY, "--save-every", "4", "--data", str(text_corpus), "--out", url, "--json")
    first = lingctl(*common, "--steps", "8", "--cache-dir", str(tmp_path / "flash"), env=env)
    assert first.returncode == 0, first.stderr
    client = make_client(S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="runs/a/")["Contents"]}
    for name in (
        "latest.json",
        "metrics.jsonl",
        "tokenizer.json",
        "checkpoints/step-00000008/config.json",
        "checkpoints/step-00000008/model.safetensors",
        "checkpoints/step-00000008/train_config.json",
        "checkpoints/step-00000008/state/pcache.json",
        "checkpoints/step-00000008/state/.metadata",
        "checkpoints/step-00000008/state/__0_0.distcp",
    ):
        assert f"runs/a/{name}" in keys
    # The checkpoint was written to the flash tier first; the store's copy verifies against its marker.
    assert list((tmp_path / "flash").glob("*/checkpoints/step-00000008/state/pcache.json"))
    monkeypatch.setenv("LINGCTL_CACHE_DIR", env["LINGCTL_CACHE_DIR"])  # where the upload recorded its progress
    code, out, err = cli(capsys, "pcache", "status", str(next((tmp_path / "flash").iterdir())), "--json")
    assert code == 0, err
    states = {c["name"]: c["state"] for c in json.loads(out)["checkpoints"]}
    assert states["checkpoints/step-00000008/state"] == "durable", states
    latest = json.loads(client.get_object(Bucket=s3_bucket, Key="runs/a/latest.json")["Body"].read())
    assert latest == {"step": 8, "path": "checkpoints/step-00000008"}
    # A fresh staging directory: the resume must come from the store, not from local leftovers.
    env["LINGCTL_CACHE_DIR"] = str(tmp_path / "cache2")
    second = lingctl(*common, "--steps", "10", "--resume", env=env)
    assert second.returncode == 0, second.stderr
    done = records(second.stdout)[-1]
    assert done["resumed_from"] == 8 and done["steps"] == 10
    body = client.get_object(Bucket=s3_bucket, Key="runs/a/metrics.jsonl")["Body"].read().decode()
    assert [json.loads(x)["step"] for x in body.splitlines() if '"event": "step"' in x] == list(range(1, 11))
    # The store's manifest lists what the run wrote there; pruning (keep 2) removed step 4 through it.
    manifest = json.loads(client.get_object(Bucket=s3_bucket, Key="runs/a/lingctl-run.json")["Body"].read())
    assert set(manifest["entries"]) == {
        "latest.json",
        "metrics.jsonl",
        "tokenizer.json",
        "checkpoints/step-00000008",
        "checkpoints/step-00000010",
        "incidents.jsonl",  # listed as the run's before the watchdog would write it
        "incidents",
    }
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="runs/a/")["Contents"]}
    assert not any(k.startswith("runs/a/checkpoints/step-00000004/") for k in keys)
    assert any(k.startswith("runs/a/checkpoints/step-00000010/") for k in keys)
