"""Conventions every command shares, through real subprocesses: shell completion, -v/-q after the command,
defaults and choices in --help, '-' for standard output, the timer diagnosis breakdown."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from lingctl.cli import run
from tests.commands.test_flood import greedy, write_batch
from tests.flood.conftest import tiny_ckpt  # noqa: F401  (the checkpoint fixture shared with flood tests)


def _complete(words: str, cword: int) -> list[str]:
    exe = Path(sys.executable).parent / "lingctl"
    env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(cword), "_LINGCTL_COMPLETE": "complete_bash"}
    import subprocess

    r = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_completion_offers_commands_options_and_choices() -> None:
    assert _complete("lingctl ba", 1) == ["babel"]
    assert set(_complete("lingctl babel ", 2)) >= {"ls", "copy", "sync", "verify"}
    assert "--retries" in _complete("lingctl babel ls --re", 3)
    assert _complete("lingctl babel verify a b --mode ", 6) == ["meta", "sampled", "full"]


def test_help_lists_the_completion_installer_and_bare_call_still_shows_help(lingctl) -> None:
    r = lingctl("--help")
    assert r.returncode == 0 and "--install-completion" in r.stdout
    r = lingctl()
    assert r.returncode == 0 and "Commands" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["version", "-v"],
        ["version", "-q", "--json"],
        ["-v", "version", "-vv"],
        ["version", "--verbose", "--quiet"],
    ],
)
def test_global_flags_after_the_command_are_accepted(lingctl, args) -> None:
    r = lingctl(*args)
    assert r.returncode == 0, r.stderr
    assert "lingctl" in r.stdout and r.stderr == ""


def test_global_flags_after_a_nested_command_with_values_around_them(lingctl, tmp_path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    r = lingctl("babel", "ls", str(tmp_path), "-q", "--jobs", "2", "-v", "--json")
    assert r.returncode == 0, r.stderr
    assert [e["key"] for e in json.loads(r.stdout)] == ["a.bin"]
    # -v is a flag, never the value of the option before it
    r = lingctl("babel", "ls", str(tmp_path), "--jobs", "-v")
    assert r.returncode == 2 and "--jobs" in r.stderr.splitlines()[0]


def test_flags_after_the_command_set_the_log_level(capsys, tmp_path) -> None:
    logger = logging.getLogger("lingctl")
    assert run(["version", "-vv"]) == 0
    assert logger.level == logging.DEBUG
    assert run(["-v", "version"]) == 0
    assert logger.level == logging.INFO
    assert run(["version", "-q"]) == 0
    assert logger.level == logging.ERROR
    assert run(["version"]) == 0
    assert logger.level == logging.WARNING


def test_timer_run_passes_flags_after_the_command_to_it(lingctl, tmp_path) -> None:
    # Everything from CMD's first word on is CMD's, also without `--`.
    r = lingctl(
        "timer",
        "run",
        "--out",
        str(tmp_path / "t"),
        sys.executable,
        "-c",
        "import sys; print(sys.argv[1:])",
        "-v",
        "-q",
    )
    assert r.returncode == 0, r.stderr
    assert "['-v', '-q']" in r.stdout
    r = lingctl("timer", "run", "-o", "-", "--", sys.executable, "-c", "pass")
    assert r.returncode == 2 and "standard output" in r.stderr


@pytest.mark.parametrize(
    "command,words",
    [
        (["babel", "sync"], ["[default: 5; x>=1]", "<none|sampled|full>", "[default: sampled]", "[default: 16"]),
        (["babel", "verify"], ["<meta|sampled|full>", "[default: 5; x>=1]"]),
        (["flood", "run"], ["<float32|bfloat16>", "[default: float32]", "<int8|w8a8>", "'-': standard"]),
        (["pcache", "upload"], ["<none|sampled|full>", "[default: full]", "[default: 5; x>=1]"]),
        (["pcache", "plan"], ["[pcache] table", "adamw|sgd|none"]),
        (["doctor"], ["[default: 8MiB]", "[default: 5; x>=1]", "-v, --verbose"]),
        (["timer", "export"], ["-o, --out FILE", "'-': standard output"]),
        (["timer", "attach"], ["-p, --pid PID", "--stacks / --no-stacks", "[default: no-stacks]"]),
        (["timer", "diagnose"], ["--stacks / --no-stacks", "[default: stacks]"]),
    ],
)
def test_help_shows_defaults_and_choices(lingctl, command, words) -> None:
    r = lingctl(*command, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # help wraps lines
    for word in words:
        assert word in text, (word, r.stdout)


def test_square_brackets_in_help_survive(lingctl) -> None:
    r = lingctl("train", "--help")
    assert r.returncode == 0 and "[train]" in r.stdout


def test_a_bad_choice_is_a_usage_error(lingctl, tmp_path) -> None:
    r = lingctl("babel", "verify", str(tmp_path), str(tmp_path / "b"), "--mode", "fast")
    assert r.returncode == 2
    assert r.stderr.startswith("lingctl: error: ") and "'fast'" in r.stderr and "Traceback" not in r.stderr


def test_flood_out_dash_streams_answers_to_stdout(capsys, lingctl, tiny_ckpt, tmp_path) -> None:  # noqa: F811
    batch = write_batch(tmp_path / "b.jsonl", [greedy("one", [5, 6], 3), greedy("two", [7], 2)])
    r = lingctl("flood", "run", str(batch), "--model", str(tiny_ckpt), "-o", "-", "--json")
    assert r.returncode == 0, r.stderr
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["one", "two"]
    assert all(a["response"]["status_code"] == 200 for a in answers)
    summary = json.loads(r.stderr.strip().splitlines()[-1])  # the summary moved to stderr
    assert summary["succeeded"] == 2 and summary["out"] == "stdout"
    assert not (tmp_path / "-").exists() and not (tmp_path / "b.output.jsonl").exists()
    assert (tmp_path / "b.errors.jsonl").read_text() == ""
    # Refused before any work: the CLI in this process.
    code = run(["flood", "run", str(batch), "--model", str(tiny_ckpt), "-o", "-", "--resume"])
    assert code == 2 and "--resume" in capsys.readouterr().err.splitlines()[0]


def _write_trace(root: Path) -> None:
    from tests.timer.test_diagnose import steps
    from tests.timer.test_export import write_run

    for rank, extra in ((0, {}), (1, {"data_ms": 20, "late_ms": 15})):
        write_run(root, rank=rank, pid=910_000 + rank, world=2, records=steps(6, jitter_ms=rank, **extra))


def test_timer_diagnose_human_output_shows_the_step_breakdown(lingctl, tmp_path) -> None:
    _write_trace(tmp_path)
    human = lingctl("timer", "diagnose", str(tmp_path), "--no-stacks")
    assert human.returncode == 0, human.stderr
    doc = json.loads(lingctl("timer", "diagnose", str(tmp_path), "--no-stacks", "--json").stdout)
    assert "step breakdown" in human.stdout
    lines = human.stdout.splitlines()
    header = next(line for line in lines if line.split()[:3] == ["rank", "steps", "step"])
    for name in doc["ranks"][0]["breakdown"]["parts_s"]:
        assert name in header.split()
    row1 = next(line for line in lines[lines.index(header) :] if line.split()[0] == "1")
    mean_ms = doc["ranks"][1]["breakdown"]["step_time_s"]["mean"] * 1e3
    assert row1.split()[2] == f"{mean_ms:.1f}"


def test_timer_export_out_dash_writes_the_trace_to_stdout(lingctl, tmp_path) -> None:
    _write_trace(tmp_path)
    r = lingctl("timer", "export", str(tmp_path), "-o", "-")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["traceEvents"] and "events to stdout" in r.stderr
    old = lingctl("timer", "export", str(tmp_path), "--output", str(tmp_path / "t.json"), "--json")
    assert old.returncode == 0 and json.loads(old.stdout)["events"] > 0  # the old spelling still works


def test_durations_take_units_and_a_bad_one_is_a_usage_error(lingctl, tmp_path) -> None:
    ok = lingctl("timer", "diagnose", str(tmp_path), "--hang-after", "1m")
    assert ok.returncode == 3 and "no traces" in ok.stderr  # parsed: the command ran and found nothing
    bad = lingctl("timer", "diagnose", str(tmp_path), "--hang-after", "soon")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    (error,) = [line for line in bad.stderr.splitlines() if line.startswith("lingctl: error:")]
    assert "--hang-after" in error and "'soon'" in error and "500ms" in error
