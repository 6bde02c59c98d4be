"""The run manifest and the ownership rules, on real directories: what lingctl may write and delete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingctl.core.errors import UsageError, VerificationError
from lingctl.core.names import UnsafeNameError
from lingctl.runs.layout import MANIFEST, Manifest, parse_latest
from lingctl.runs.owned import LocalPlace


def place(root: Path) -> LocalPlace:
    return LocalPlace(root, hint="choose another --out")


def test_a_new_place_writes_its_manifest_first_and_deletes_only_what_it_lists(tmp_path: Path) -> None:
    root = tmp_path / "run"
    p = place(root)
    p.open(adopt=False, resume=False)
    assert not root.exists()  # opening writes nothing
    root.mkdir()
    p.claim(["tokenizer.json", "checkpoints/step-00000002"])
    assert sorted(x.name for x in root.iterdir()) == [MANIFEST]  # listed before created
    (root / "checkpoints" / "step-00000002").mkdir(parents=True)
    (root / "checkpoints" / "step-00000002" / "w").write_bytes(b"w")
    (root / "checkpoints" / "step-00000004").mkdir()  # someone else's
    p.release(["checkpoints/step-00000002", "checkpoints/step-00000004"])
    assert [x.name for x in (root / "checkpoints").iterdir()] == ["step-00000004"]
    assert json.loads((root / MANIFEST).read_text())["entries"] == ["tokenizer.json"]
    with pytest.raises(UsageError, match="did not write it"):
        p.claim(["checkpoints/step-00000004"])


def test_a_foreign_directory_is_refused_unless_adopted_and_then_its_names_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "user"
    (root / "checkpoints" / "step-00000003").mkdir(parents=True)
    (root / "tokenizer.json").write_text("{}")
    with pytest.raises(UsageError, match="not created by lingctl"):
        place(root).open(adopt=False, resume=False)
    with pytest.raises(UsageError, match="not created by lingctl"):  # resume needs a run's own files
        place(root).open(adopt=False, resume=True)
    p = place(root)
    p.open(adopt=True, resume=False)
    with pytest.raises(UsageError, match="tokenizer.json exists"):
        p.check(["tokenizer.json"], steps=(0, 10))
    with pytest.raises(UsageError, match="step-00000003 exists"):  # a stop at step 3 would write it
        p.check([], steps=(0, 10))
    p.check(["metrics.jsonl"], steps=(3, 10))  # resuming after step 3: that name is never written
    assert not (root / MANIFEST).exists()


def test_a_run_without_manifest_resumes_owning_only_its_own_two_files(tmp_path: Path) -> None:
    root = tmp_path / "old"
    (root / "checkpoints" / "step-00000002").mkdir(parents=True)
    (root / "latest.json").write_text('{"step": 2, "path": "checkpoints/step-00000002"}')
    (root / "metrics.jsonl").write_text("")
    p = place(root)
    p.open(adopt=False, resume=True)
    assert p.manifest is not None and p.manifest.entries == {"latest.json", "metrics.jsonl"}
    p.release(["checkpoints/step-00000002"])
    assert (root / "checkpoints" / "step-00000002").is_dir()


@pytest.mark.parametrize(
    "raw, error",
    [
        (b"[]", VerificationError),
        (b'{"format": "lingctl-run", "version": 1, "entries": ["/etc/passwd"]}', UnsafeNameError),
        (b'{"format": "lingctl-run", "version": 1, "entries": ["checkpoints/step-00000002/../../x"]}', UnsafeNameError),
        (b'{"format": "lingctl-run", "version": 1, "entries": ["checkpoints"]}', VerificationError),
        (b'{"format": "lingctl-run", "version": 1, "entries": "latest.json"}', VerificationError),
        (b'{"format": "lingctl-run", "version": true, "entries": []}', VerificationError),
        (b'{"format": "lingctl-run", "version": 9, "entries": []}', UsageError),
    ],
)
def test_manifest_accepts_only_what_lingctl_writes(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        Manifest.parse(raw, "run/lingctl-run.json")
    ok = Manifest.parse(Manifest(entries={"latest.json", "checkpoints/step-00000002"}).to_bytes(), "x")
    assert ok.entries == {"latest.json", "checkpoints/step-00000002"}


@pytest.mark.parametrize(
    "raw, error",
    [
        (b'{"step": 2, "path": "../x/checkpoints/step-00000002"}', UnsafeNameError),
        (b'{"step": 2, "path": "/abs/checkpoints/step-00000002"}', UnsafeNameError),
        (b'{"step": 2, "path": "checkpoints/step-2"}', VerificationError),
        (b'{"step": 2, "path": "checkpoints/step-00000002/"}', UnsafeNameError),
        (b'{"step": -1, "path": "checkpoints/step-00000002"}', VerificationError),
        (b'{"path": "checkpoints/step-00000002"}', VerificationError),
        (b"\xff", VerificationError),
    ],
)
def test_latest_pointer_must_name_a_checkpoint_of_the_run(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_latest(raw, "run/latest.json")
    assert parse_latest(b'{"step": 2, "path": "checkpoints/step-00000002"}', "x")["path"] == "checkpoints/step-00000002"


def test_s3_run_starting_over_cleans_only_what_its_staging_manifest_lists(tmp_path: Path, s3_bucket: str) -> None:
    from lingctl.core.storage import S3Options
    from lingctl.train.rundir import RunDir

    url = f"s3://{s3_bucket}/runs/a"
    run = RunDir(url, S3Options(), cache_dir=tmp_path / "cache")
    staging = run.local
    (staging / "checkpoints" / "step-00000002").mkdir(parents=True)
    (staging / "checkpoints" / "step-00000002" / "w").write_bytes(b"lingctl's")
    (staging / "checkpoints" / "keep.txt").write_text("someone's")
    (staging / MANIFEST).write_bytes(Manifest(entries={"checkpoints/step-00000002"}).to_bytes())
    run.check_fresh(restart=False, last_step=4)
    run.prepare_fresh()
    assert not (staging / "checkpoints" / "step-00000002").exists()
    assert (staging / "checkpoints" / "keep.txt").read_text() == "someone's"
    listed = {"tokenizer.json", "metrics.jsonl", "latest.json"}
    assert set(json.loads((staging / MANIFEST).read_text())["entries"]) == listed
    assert set(json.loads(run.store.read(MANIFEST))["entries"]) == listed
