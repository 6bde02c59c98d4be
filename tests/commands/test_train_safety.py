"""`lingctl train` never touches what it did not write, refuses names that leave the run, stops a diverged run,
and answers bad numbers and damaged files with one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lingctl.cli import run as cli_run
from lingctl.core.storage import S3Options
from lingctl.core.storage.s3.store import make_client

TINY = ("train", "--preset", "tiny", "--eval-every", "0")


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip().startswith("{")]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert lines and lines[0].startswith("lingctl: error: "), stderr
    assert len(lines) <= 2 and "Traceback" not in stderr, stderr  # the error, and at most a hint
    return lines[0]


def manifest_entries(run: Path) -> set[str]:
    data = json.loads((run / "lingctl-run.json").read_text())
    assert data["format"] == "lingctl-run" and data["version"] == 1
    return set(data["entries"])


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The CLI in this process (for errors raised before any training): exit code and stderr."""
    code = cli_run(list(args))
    return code, capsys.readouterr().err


def test_out_on_a_users_directory_is_refused_and_every_file_stays_byte_identical(capsys, tmp_path, text_corpus):
    # The reported case: the user's own checkpoints/step-* folders and tokenizer.json.
    user = tmp_path / "userdir"
    for step in (2, 4):
        ckpt = user / "checkpoints" / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(os.urandom(4096))
        (ckpt / "config.json").write_text(json.dumps({"mine": step}))
    (user / "tokenizer.json").write_text('{"my": "tokenizer"}')
    before = snapshot(user)
    common = (*TINY, "--steps", "6", "--save-every", "2", "--data", str(text_corpus), "--out", str(user))

    # Refused before any data is read or anything written, so the CLI runs in this process.
    code, err = cli(capsys, *common)
    assert code == 2
    assert "not created by lingctl" in one_line_error(err) and "--adopt" in err
    assert snapshot(user) == before  # nothing changed, nothing added (not even the manifest)

    code, err = cli(capsys, *common, "--adopt")
    assert code == 2
    line = one_line_error(err)
    assert "tokenizer.json" in line and "did not write it" in line
    assert snapshot(user) == before


def test_adopted_directory_prunes_only_its_own_checkpoints_through_resume_and_a_legacy_resume(
    lingctl, tmp_path, text_corpus
):
    user = tmp_path / "userdir"
    (user / "checkpoints" / "step-00000100").mkdir(parents=True)
    (user / "checkpoints" / "step-00000100" / "model.safetensors").write_bytes(os.urandom(4096))
    (user / "checkpoints" / "README.md").write_text("downloaded from somewhere")
    (user / "notes.txt").write_text("mine")
    mine = snapshot(user)
    common = (
        *TINY,
        "--save-every",
        "2",
        "--set",
        "keep_checkpoints=1",
        "--data",
        str(text_corpus),
        "--out",
        str(user),
        "--json",
    )

    def checkpoints() -> set[str]:
        return {p.name for p in (user / "checkpoints").iterdir() if p.is_dir()}

    def user_files_unchanged() -> None:
        now = snapshot(user)
        assert {k: now.get(k) for k in mine} == mine

    first = lingctl(*common, "--steps", "4", "--adopt")
    assert first.returncode == 0, first.stderr
    user_files_unchanged()
    # step-2 was written and then pruned; the user's step-100 sorts last and was neither counted nor touched.
    assert checkpoints() == {"step-00000004", "step-00000100"}
    assert manifest_entries(user) == {
        "tokenizer.json",
        "metrics.jsonl",
        "latest.json",
        "loss.png",
        "checkpoints/step-00000004",
        "incidents.jsonl",  # listed before the watchdog would write them
        "incidents",
    }

    resumed = lingctl(*common, "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert records(resumed.stdout)[-1]["resumed_from"] == 4
    user_files_unchanged()
    assert checkpoints() == {"step-00000006", "step-00000100"}

    # A run of the previous lingctl version has no manifest: it still resumes, and only what this resume
    # writes is listed, so its earlier checkpoints are never pruned.
    (user / "lingctl-run.json").unlink()
    legacy = lingctl(*common, "--steps", "8", "--resume")
    assert legacy.returncode == 0, legacy.stderr
    assert records(legacy.stdout)[-1]["resumed_from"] == 6
    user_files_unchanged()
    assert checkpoints() == {"step-00000006", "step-00000008", "step-00000100"}
    # The loss.png the run drew before is unlisted now, so it is kept as it is and not drawn over.
    assert manifest_entries(user) == {
        "metrics.jsonl",
        "latest.json",
        "checkpoints/step-00000008",
        "incidents.jsonl",
        "incidents",
    }


def test_s3_prefix_holding_other_objects_is_refused_and_left_alone(
    capsys, monkeypatch, tmp_path, text_corpus, s3_bucket, s3_env
):
    client = make_client(S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
    client.put_object(Bucket=s3_bucket, Key="runs/x/checkpoints/step-00000002/model.safetensors", Body=b"mine")
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(tmp_path / "cache"))
    common = (
        *TINY,
        "--steps",
        "4",
        "--save-every",
        "2",
        "--data",
        str(text_corpus),
        "--out",
        f"s3://{s3_bucket}/runs/x",
    )

    code, err = cli(capsys, *common)
    assert code == 2 and "not created by lingctl" in one_line_error(err)
    code, err = cli(capsys, *common, "--adopt")
    assert code == 2 and "checkpoints/step-00000002" in one_line_error(err)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="runs/")["Contents"]]
    assert keys == ["runs/x/checkpoints/step-00000002/model.safetensors"]
    body = client.get_object(Bucket=s3_bucket, Key=keys[0])["Body"].read()
    assert body == b"mine"
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "path",
    [
        "../outside/checkpoints/step-00000002",
        "/tmp/checkpoints/step-00000002",
        "checkpoints/step-00000002/../../../outside",
    ],
)
def test_latest_json_naming_a_path_outside_the_run_is_refused(capsys, tmp_path, small_run, path):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.copytree(small_run / "checkpoints", tmp_path / "outside" / "checkpoints")
    (run / "latest.json").write_text(json.dumps({"step": 2, "path": path}))
    before = snapshot(tmp_path)
    code, err = cli(capsys, "train", "--out", str(run), "--resume")
    assert code == 4
    assert "latest.json" in one_line_error(err)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "file, content, code, words",
    [
        ("latest.json", b"{not json", 4, "latest.json is damaged"),
        ("latest.json", b'{"step": "two", "path": "checkpoints/step-00000002"}', 4, "not a step number"),
        ("latest.json", b'{"step": 2, "path": "checkpoints/elsewhere"}', 4, "checkpoints/step-NNNNNNNN"),
        ("checkpoints/step-00000002/train_config.json", b"\x00\xffgarbage", 4, "train_config.json is damaged"),
        ("checkpoints/step-00000002/train_config.json", b"[1, 2]", 4, "train_config.json is damaged"),
        ("checkpoints/step-00000002/state/pcache.json", b"garbage", 4, "pcache.json"),
        (
            "lingctl-run.json",
            b'{"format": "lingctl-run", "version": 1, "entries": ["../../etc"]}',
            4,
            "lingctl-run.json",
        ),
        ("lingctl-run.json", b'{"format": "lingctl-run", "version": 1, "entries": ["notes.txt"]}', 4, "never writes"),
    ],
)
def test_damaged_run_files_are_one_line_errors(capsys, tmp_path, small_run, file, content, code, words):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    (run / file).write_bytes(content)
    got, err = cli(capsys, "train", "--out", str(run), "--resume", "--steps", "4")
    assert got == code, err
    assert words in one_line_error(err)
    assert json.loads((small_run / "latest.json").read_text())["step"] == 2


def test_a_diverging_run_ends_with_exit_1_and_says_why(lingctl, tmp_path, text_corpus):
    run = tmp_path / "run"
    res = lingctl(
        *TINY,
        "--steps",
        "200",
        "--lr",
        "1e4",
        "--save-every",
        "0",
        "--max-consecutive-skips",
        "5",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
        "--json",
    )
    assert res.returncode == 1, res.stderr
    line = one_line_error(res.stderr)
    assert line.startswith("lingctl: error: training diverged after step ")
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if r["event"] == "step"]
    spikes = [r for r in metrics if r["event"] == "spike"]
    assert metrics[-1]["event"] == "diverged" and metrics[-1]["reason"] in line
    assert len(spikes) <= 5 and len(steps) < 50  # bounded: it stopped instead of skipping for ever
    assert not (run / "latest.json").exists() and not (run / "checkpoints").exists()  # nothing saved


@pytest.mark.parametrize(
    "args, words",
    [
        (("--lr", "nan"), "optim.lr (--lr) must be a finite number > 0, got nan"),
        (("--lr", "-1"), "optim.lr (--lr) must be a finite number > 0, got -1.0"),
        (("--lr", "inf"), "optim.lr (--lr) must be a finite number > 0, got inf"),
        (("--steps", "0"), "steps (--steps)"),
        (("--batch-size", "0"), "batch_size"),
        (("--seq-len", "1"), "seq_len"),
        (("--save-every", "-1"), "save_every"),
        (("--eval-every", "-2"), "eval_every"),
        (("--max-seconds", "nan"), "'--max-seconds': invalid duration 'nan'"),
        (("--max-seconds", "-5"), "'--max-seconds': invalid duration '-5'"),
        (("--seed", "-1"), "seed"),
        (("--slowdown", "inf"), "slowdown"),
        (("--sync-every", "0"), "sync_every"),
        (("--sync-every-seconds", "inf"), "'--sync-every-seconds': invalid duration 'inf'"),
        (("--max-consecutive-skips", "0"), "max_consecutive_skips"),
        (("--set", "optim.beta2=1.0"), "optim.beta2"),
        (("--set", "optim.grad_clip=nan"), "optim.grad_clip"),
        (("--set", "spike.ema_beta=nan"), "spike.ema_beta"),
    ],
)
def test_bad_numbers_are_one_line_usage_errors(capsys, tmp_path, args, words):
    code, err = cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "run"), *args)
    assert code == 2
    assert words in one_line_error(err)
    assert not (tmp_path / "run").exists()


def test_toml_config_gets_the_same_checks(capsys, tmp_path):
    config = tmp_path / "train.toml"
    config.write_text("[train]\npreset = 'tiny'\n[train.optim]\nlr = nan\n")
    code, err = cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "run"))
    assert code == 2 and "optim.lr" in one_line_error(err)


def test_out_naming_a_file_is_one_line(capsys, tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("mine")
    code, err = cli(capsys, "train", "--preset", "tiny", "--out", str(target))
    assert code == 2 and "is a file, not a directory" in one_line_error(err)
    assert target.read_text() == "mine"
