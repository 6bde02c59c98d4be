"""`lingctl flood eval` over every checkpoint of a real training run (and one still training, with --follow),
plus the command's output modes and refusals (in this process)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lingctl.cli import run as cli_run
from tests.flood.test_eval import gen_rows, mc_rows, write_jsonl

PNG = b"\x89PNG\r\n\x1a\n"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_run(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("eval-tasks")
    # The run's tokenizer is trained on Python source: words it has seen make multi-token choices.
    return write_jsonl(d / "mc.jsonl", mc_rows(8)), write_jsonl(d / "gen.jsonl", gen_rows(3))


def test_every_checkpoint_of_a_run_is_scored_tabled_and_plotted(lingctl, run20, tasks, tmp_path, capsys):
    run, _ = run20
    out = tmp_path / "ev"
    res = lingctl(
        "flood", "eval", *map(str, tasks), "-m", str(run), "-o", str(out), "--threads", "1", "--json", timeout=600
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["mode"] == "run"
    steps = [r["step"] for r in summary["results"]]
    assert steps == [16, 20]  # the checkpoints the run kept, in step order
    tokens = [r["tokens"] for r in summary["results"]]
    assert 0 < tokens[0] < tokens[1]
    for r in summary["results"]:
        assert set(r["tasks"]) == {"mc", "gen"} and r["tasks"]["mc"]["items"] == 8
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0
        assert len((out / f"step-{r['step']:08d}.jsonl").read_text().splitlines()) == 11
    assert (out / "scores.png").read_bytes()[:8] == PNG
    csv_rows = (out / "scores.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + 2 * 2  # header, then (checkpoint, task) rows
    assert "16" in (out / "scores.md").read_text()
    # A rerun reuses every checkpoint's results; another batch size into another directory gives the same bytes.
    code, stdout, _ = cli(capsys, "flood", "eval", *map(str, tasks), "-m", str(run), "-o", str(out))
    assert code == 0 and "step 20" in stdout and "reused" in stdout and "plot:" in stdout
    other = tmp_path / "ev2"
    args = ("flood", "eval", *map(str, tasks), "-m", str(run), "-o", str(other), "--threads", "1", "--json")
    code, stdout, _ = cli(capsys, *args, "--max-batch-tokens", "32", "--drop-k", "0")
    assert code == 0
    again = json.loads(stdout)
    assert [r["tasks"] for r in again["results"]] == [r["tasks"] for r in summary["results"]]
    # With k = 0 every fall is flagged, and only a fall.
    for task in ("mc", "gen"):
        acc = [r["tasks"][task]["acc"] for r in again["results"]]
        flagged = [d for d in again["drops"] if d["task"] == task and d["metric"] == "acc"]
        assert len(flagged) == (acc[1] < acc[0])
        if flagged:
            assert (flagged[0]["tokens_from"], flagged[0]["tokens_to"]) == tuple(tokens)
    for step in (16, 20):
        name = f"step-{step:08d}.jsonl"
        assert (other / name).read_bytes() == (out / name).read_bytes()


def test_follow_evaluates_checkpoints_as_a_live_run_writes_them(lingctl, text_corpus, tasks, tmp_path):
    run = tmp_path / "run"
    train = subprocess.Popen(
        [sys.executable, "-m", "lingctl", "train", "--preset", "tiny", "--eval-every", "0", "--steps", "6"]
        + ["--save-every", "2", "--set", "keep_checkpoints=10", "--data", str(text_corpus), "--out", str(run)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "lingctl-run.json").exists():  # the run directory exists once training starts
            assert train.poll() is None, train.stderr.read() if train.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        res = lingctl(
            "flood",
            "eval",
            str(tasks[0]),
            "-m",
            str(run),
            "--follow",
            "--poll",
            "200ms",
            "--threads",
            "1",
            "--json",
            timeout=600,
        )
        assert train.wait(timeout=600) == 0
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert [r["step"] for r in summary["results"]] == [2, 4, 6]  # it ended when the run reached its target
    assert summary["out"] == str(tmp_path / "run.eval")


def test_dash_writes_the_records_to_stdout_and_the_summary_to_stderr(text_ckpt, tasks, capsys):
    code, stdout, stderr = cli(
        capsys, "flood", "eval", str(tasks[1]), "-m", str(text_ckpt), "-o", "-", "--threads", "1"
    )
    assert code == 0, stderr
    records = [json.loads(line) for line in stdout.splitlines()]
    assert [r["id"] for r in records] == ["g0", "g1", "g2"]
    assert "gen (generate, 3): acc" in stderr


def test_refusals_are_one_line(text_ckpt, tiny_ckpt, tasks, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n')
    code, _, err = cli(capsys, "flood", "eval", str(bad), "-m", str(text_ckpt))
    assert code == 2 and f"{bad}:1: 'answer' must be a string" in err and "Traceback" not in err
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"id": "a\\ud800", "context": "x", "choices": [" y", " z"], "answer": 0}\n')
    code, _, err = cli(capsys, "flood", "eval", str(surrogate), "-m", str(text_ckpt))
    assert code == 2 and f"{surrogate}:1: 'id' is not valid Unicode: a lone surrogate \\ud800" in err
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err
    code, _, err = cli(capsys, "flood", "eval", str(tmp_path / "none.jsonl"), "-m", str(text_ckpt))
    assert code == 3 and "none.jsonl" in err
    code, _, err = cli(capsys, "flood", "eval", str(tasks[0]), "-m", str(tiny_ckpt), "-o", str(tmp_path / "o.jsonl"))
    assert code == 2 and "no tokenizer.json" in err
    code, _, err = cli(capsys, "flood", "eval", str(tasks[0]), "-m", str(text_ckpt), "--follow")
    assert code == 2 and "--follow needs a training run directory" in err
    assert not (tmp_path / "o.jsonl").exists()
