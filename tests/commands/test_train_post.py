"""`lingctl train sft` and `train dpo` as real subprocesses: fine-tuning a checkpoint, kill -9 and resume,
several workers, and the one-line refusals before anything is trained."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from lingctl.cli import run as cli_run
from lingctl.model.checkpoint import load_checkpoint
from tests.train.post.conftest import dpo_records, sft_records, write_lines

COMMON = ("--eval-every", "5", "--save-every", "4", "--batch-size", "4", "--seq-len", "96", "--json")


def steps(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "step"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("post-data")
    return {
        "sft": write_lines(d / "chat.jsonl", sft_records(48)),
        "dpo": write_lines(d / "pairs.jsonl", dpo_records(48)),
    }


def args(kind: str, chat_ckpt: Path, data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    lr = "3e-3" if kind == "dpo" else "1e-3"
    return [
        "train",
        kind,
        "--init-from",
        str(chat_ckpt),
        "--data",
        str(data[kind]),
        "--out",
        str(out),
        "--lr",
        lr,
        *COMMON,
        *extra,
    ]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory, chat_ckpt: Path, data: dict[str, Path]) -> Path:
    """An uninterrupted 12-step DPO run (NLL term on): the reference for the resume and several-worker tests."""
    from tests.conftest import run_lingctl

    run = tmp_path_factory.mktemp("dpo") / "run"
    res = run_lingctl(*args("dpo", chat_ckpt, data, run, "--steps", "12", "--nll-weight", "0.05"), timeout=300)
    assert res.returncode == 0, res.stderr
    return run


def test_dpo_raises_the_margin_between_chosen_and_rejected(dpo_run: Path) -> None:
    recs = steps(dpo_run)
    first, last = recs[0]["task"], recs[-1]["task"]
    assert abs(first["reward_margin"]) < 0.05  # the policy starts as the reference
    assert last["reward_margin"] > first["reward_margin"] + 0.5, (first, last)
    assert last["reward_accuracy"] >= 0.75
    model = load_checkpoint(dpo_run / "checkpoints" / "step-00000012")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_kill_and_resume_reproduce_the_uninterrupted_run(lingctl, tmp_path, chat_ckpt, data, dpo_run, kind) -> None:
    extra = ("--nll-weight", "0.05") if kind == "dpo" else ()
    if kind == "dpo":
        whole = dpo_run
    else:
        whole = tmp_path / "whole"
        assert lingctl(*args(kind, chat_ckpt, data, whole, "--steps", "12", *extra), timeout=300).returncode == 0
    cut = tmp_path / "cut"
    killed = lingctl(
        *args(kind, chat_ckpt, data, cut, "--steps", "12", "--set", "crash_at_step=7", *extra), timeout=300
    )
    assert killed.returncode == -signal.SIGKILL
    reference = cut / "reference_logps.json"
    if kind == "dpo":
        before = reference.stat().st_mtime_ns
    resumed = lingctl("train", kind, "--resume", "--out", str(cut), "--json", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [(r["step"], r["loss"]) for r in steps(cut)] == [(r["step"], r["loss"]) for r in steps(whole)]
    if kind == "dpo":
        assert reference.stat().st_mtime_ns == before  # read on resume, not computed again
        assert steps(cut)[-1]["task"] == steps(whole)[-1]["task"]
    else:
        assert not reference.exists()
        losses = [r["lm_loss"] for r in steps(whole)]
        assert sum(losses[-3:]) / 3 < losses[0]


def test_several_workers_share_the_reference_and_train(lingctl, tmp_path, chat_ckpt, data, dpo_run) -> None:
    run = tmp_path / "ddp"
    res = lingctl(
        *args("dpo", chat_ckpt, data, run, "--steps", "4", "--nproc", "2", "--nll-weight", "0.05"), timeout=300
    )
    assert res.returncode == 0, res.stderr
    ours = json.loads((run / "reference_logps.json").read_text())
    alone = json.loads((dpo_run / "reference_logps.json").read_text())
    assert ours["fingerprint"] == alone["fingerprint"]
    assert torch.allclose(torch.tensor(ours["train"]), torch.tensor(alone["train"]), rtol=1e-5, atol=1e-4)
    assert len(steps(run)) == 4 and all(r["task"]["reward_accuracy"] >= 0 for r in steps(run))


def test_a_bad_line_is_refused_with_file_and_line_before_anything_is_written(capsys, tmp_path, chat_ckpt) -> None:
    bad = tmp_path / "chat.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = tmp_path / "run"
    code = cli_run(["train", "sft", "--init-from", str(chat_ckpt), "--data", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and f"{bad}:2: no assistant message to train on" in err and "Traceback" not in err
    assert not out.exists()


def test_fine_tuning_without_a_checkpoint_is_refused(capsys, tmp_path, data) -> None:
    code = cli_run(["train", "dpo", "--data", str(data["dpo"]), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "train dpo needs --init-from" in err
