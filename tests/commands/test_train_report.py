"""`lingctl train --report-to`, the status lines off a terminal, timestamps, loss.png and `lingctl train plot`."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.commands.test_train import TINY
from tests.conftest import run_lingctl

pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tb_run(
    tmp_path_factory: pytest.TempPathFactory, text_corpus: Path
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One 3-step tiny run reporting to TensorBoard, shared by the tests below (they only read it)."""
    run = tmp_path_factory.mktemp("report") / "run"
    res = run_lingctl(
        *TINY, "--steps", "3", "--data", str(text_corpus), "--out", str(run), "--report-to", "tensorboard"
    )
    assert res.returncode == 0, res.stderr
    return run, res


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_files_hold_the_runs_losses_and_expert_load(tb_run):
    run, res = tb_run
    # the manifest lists every name lingctl created in the run directory, the reporter's directory too
    assert "tensorboard" in json.loads((run / "lingctl-run.json").read_text())["entries"]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    losses = [r["loss"] for r in _metrics(run) if r["event"] == "step"]
    logged = acc.Scalars("train/loss")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [e.value for e in logged] == pytest.approx(losses, rel=1e-6)
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/spikes_skipped",
        "eval/loss",
        "experts/layer_0/cv",
        "experts/layer_0/max_over_mean",
    } <= tags
    # The start-up line comes before the slow part and says where the event files go.
    assert (
        f"preparing run {run}: tokenizing data, building the model; tensorboard files in {run / 'tensorboard'}"
        in res.stderr
    )


def test_every_record_has_a_wall_clock_time_that_never_goes_back(tb_run):
    run, _ = tb_run
    times = [r["time"] for r in _metrics(run)]
    assert len(times) >= 5 and all(isinstance(t, float) for t in times)
    assert times == sorted(times) and times[0] > 1.7e9


def test_status_lines_off_a_terminal_show_the_target_and_an_eta_and_the_summary_the_speed(tb_run):
    _, res = tb_run
    assert re.search(r"^step 1/3 loss \d+\.\d{3} lr \S+ [\d,]+ tok/s expert cv \d\.\d\d$", res.stderr, re.M), res.stderr
    assert re.search(r"^step \d+/3 .* ETA \d+s$", res.stderr, re.M), res.stderr
    assert re.search(r"^completed: 3/3 steps, .* [\d,]+ tok/s, wall time \d+s$", res.stdout, re.M), res.stdout


def test_the_run_writes_loss_png_and_train_plot_draws_another(tb_run, tmp_path):
    run, _ = tb_run
    assert (run / "loss.png").read_bytes().startswith(PNG)
    res = run_lingctl("train", "plot", str(run), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "x.png").read_bytes().startswith(PNG)
    # The run listed its loss.png in its manifest; a loss.png lingctl did not write is never overwritten.
    assert "loss.png" in json.loads((run / "lingctl-run.json").read_text())["entries"]
    again = run_lingctl("train", "plot", str(run))
    assert again.returncode == 0, again.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes())
    (foreign / "loss.png").write_bytes(b"mine")
    refused = run_lingctl("train", "plot", str(foreign))
    assert refused.returncode == 2 and (foreign / "loss.png").read_bytes() == b"mine", refused.stderr
    missing = run_lingctl("train", "plot", str(tmp_path / "nothing"))
    assert missing.returncode == 3 and missing.stderr.startswith("lingctl: error:")
    assert "Traceback" not in missing.stderr


def test_json_result_carries_wall_time_and_tokens_per_second(lingctl, tmp_path, text_corpus):
    res = lingctl(*TINY, "--steps", "1", "--data", str(text_corpus), "--out", str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    assert recs[0]["event"] == "preparing" and isinstance(recs[0]["time"], float)
    done = recs[-1]
    assert done["event"] == "done" and done["wall_s"] > 0 and done["tokens_per_s"] > 0
    assert not (tmp_path / "run" / "tensorboard").exists()  # --report-to defaults to none


def test_wandb_without_the_package_and_a_bogus_backend_are_one_line_errors(lingctl, tmp_path, text_corpus):
    try:
        import wandb  # noqa: F401
    except ImportError:
        res = lingctl(
            *TINY, "--steps", "1", "--data", str(text_corpus), "--out", str(tmp_path / "w"), "--report-to", "wandb"
        )
        assert res.returncode != 0
        assert res.stderr.count("\n") == 1 and "lingctl[wandb]" in res.stderr and "Traceback" not in res.stderr
        assert not (tmp_path / "w").exists()  # refused before the run started
    bogus = lingctl(*TINY, "--report-to", "bogus", "--out", str(tmp_path / "b"))
    assert bogus.returncode == 2 and "Traceback" not in bogus.stderr


def test_the_summary_of_a_resumed_run_keeps_all_sessions_time_apart_from_this_sessions() -> None:
    from io import StringIO

    from rich.console import Console

    from lingctl.commands.train_render import render_result
    from lingctl.train.trainer import TrainResult

    common: dict[str, Any] = dict(
        run_dir="r", steps=20, target_steps=20, tokens=4096, parameters=1, active_parameters=1, first_loss=5.0,
        last_loss=4.0, eval_loss=None, spikes_skipped=0, lr_drops=0, checkpoint="checkpoints/step-00000020",
        elapsed_s=420.0, stopped="completed", wall_s=65.0, tokens_per_s=1234.0,
    )  # fmt: skip
    text = {}
    for name, resumed in (("fresh", None), ("resumed", 10)):
        buf = StringIO()
        render_result(TrainResult(**common, resumed_from=resumed), Console(file=buf, width=200))
        text[name] = buf.getvalue()
    assert "420 s of training over all sessions; this session wall time 1m5s, 1,234 tok/s" in text["resumed"]
    assert "over all sessions" not in text["fresh"] and "420 s, 1,234 tok/s" in text["fresh"]
