"""Markers, sidecars and remote listings are data: hostile or garbage ones are refused before any file is
deleted, written or waited for, and one bad checkpoint does not stop ``status`` over the others."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lingctl.core.errors import EXIT_VERIFY, UsageError, VerificationError
from lingctl.core.names import UnsafeNameError
from lingctl.core.storage import open_store
from lingctl.pcache.checkpoint import load
from lingctl.pcache.local_copy import fetch
from lingctl.pcache.marker import MARKER, parse_marker
from lingctl.pcache.tier import upload
from lingctl.pcache.tier_status import status
from tests.pcache.test_tier import cli_app
from tests.pcache.tier_fixtures import make_checkpoint

CANARY = b"the user's own file"


def _marker(files: object) -> bytes:
    return json.dumps({"format": "lingctl-pcache", "version": 1, "files": files}).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"[" * 100_000,
        b"[]",
        b'{"format": "lingctl-pcache"}',
        _marker([]),
        _marker({"a": []}),
        _marker({"a": {"size": "12"}}),
        _marker({"a": {"size": -1}}),
        _marker({"a": {"size": True}}),
        _marker({"a": {"size": 1, "crc64nvme": 5}}),
    ],
)
def test_parse_marker_checks_every_entry(data: bytes) -> None:
    with pytest.raises(VerificationError, match="m/pcache.json") as exc:
        parse_marker(data, "m/pcache.json")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "a\x1b[2Jb", "sub/x", ".", "", "a\nb"])
def test_parse_marker_refuses_unsafe_names(name: str) -> None:
    with pytest.raises(UnsafeNameError) as exc:
        parse_marker(_marker({name: {"size": 1}}), "m/pcache.json")
    assert exc.value.exit_code == EXIT_VERIFY and "\n" not in str(exc.value) and "\x1b" not in str(exc.value)


def test_a_sidecar_with_an_unsafe_name_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    d = tmp_path / "step-1"
    make_checkpoint(d)
    (d / "__0.pcache.json").write_text(json.dumps({"rank": 0, "files": {"../../etc": {"size": 1}}}))
    with pytest.raises(UnsafeNameError, match="etc"):
        upload(d, str(tmp_path / "shared"), rank=0, finalize=False)
    assert not (tmp_path / "shared").exists()


@pytest.mark.slow
@pytest.mark.parametrize("hostile", ["dotdot", "absolute", "control"])
def test_a_hostile_remote_marker_deletes_nothing(tmp_path: Path, s3_bucket: str, hostile: str) -> None:
    cache = tmp_path / "cache"
    url = f"s3://{s3_bucket}/run/step-1"
    local = cache / s3_bucket / "run" / "step-1"
    make_checkpoint(local)  # a cached copy, so that the remote's names are "stale" files to refresh
    canary = tmp_path / "canary"
    canary.write_bytes(CANARY)
    name = {"dotdot": "../../../../canary", "absolute": str(canary), "control": "x\x1b]0;owned\x07"}[hostile]
    store = open_store(url)
    store.write(
        MARKER,
        _marker(
            {
                name: {"size": 1, "crc64nvme": "crc64nvme:AAAAAAAAAAA="},
                ".metadata": {"size": 3, "crc64nvme": "crc64nvme:AAAAAAAAAAA="},
            }
        ),
    )
    (local / MARKER).unlink()  # the cached copy is stale: the read goes to the remote marker
    before = sorted(p.name for p in local.iterdir())
    with pytest.raises(UnsafeNameError) as exc:
        load({}, url, cache_dir=cache)
    assert exc.value.exit_code == EXIT_VERIFY
    with pytest.raises(UnsafeNameError):
        fetch(url, tmp_path / "elsewhere")
    assert canary.read_bytes() == CANARY
    assert sorted(p.name for p in local.iterdir()) == before  # nothing deleted inside the cache either
    assert not (tmp_path / "elsewhere").exists()
    # status calls the remote copy bad (the upload did not leave a good one), with the reason.
    [row] = status(local, url)
    assert row.state == "upload-failed" and any("pcache.json: file" in p for p in row.problems), row


@pytest.mark.slow
def test_upload_with_a_hostile_marker_fails_at_once_with_exit_4(
    tmp_path: Path, s3_bucket: str, s3_env: dict[str, str], lingctl
) -> None:
    d = tmp_path / "step-1"
    make_checkpoint(d)
    marker = json.loads((d / MARKER).read_text())
    marker["files"]["../../../outside"] = {"size": 5, "crc64nvme": "crc64nvme:AAAAAAAAAAA="}
    (d / MARKER).write_text(json.dumps(marker))
    url = f"s3://{s3_bucket}/step-1"
    started = time.monotonic()
    res = lingctl("pcache", "upload", str(d), "--to", url, env=s3_env)
    assert res.returncode == EXIT_VERIFY, res.stderr
    assert time.monotonic() - started < 30  # not the 60 s wait for files that can never arrive
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("lingctl: error: ") and "../../../outside" in lines[0] and "Traceback" not in res.stderr
    assert list(open_store(url).list()) == []  # nothing was sent
    # Garbage instead of a marker: one line too, exit 4.
    (d / MARKER).write_bytes(b"\x00{not json")
    res = lingctl("pcache", "upload", str(d), "--to", url, env=s3_env)
    assert res.returncode == EXIT_VERIFY and "not a valid lingctl-pcache marker" in res.stderr
    assert "Traceback" not in res.stderr


def test_status_goes_on_past_a_newer_or_garbage_marker(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    for step in ("step-1", "step-2", "step-3"):
        make_checkpoint(root / step)
    newer = json.loads((root / "step-1" / MARKER).read_text()) | {"version": 2}
    (root / "step-1" / MARKER).write_text(json.dumps(newer))
    (root / "step-2" / MARKER).write_bytes(b"[" * 50_000)
    with pytest.raises(UsageError, match="newer"):  # a reader is refused ...
        upload(root / "step-1", str(tmp_path / "shared"))
    rows = {r.name: r for r in status(root)}  # ... status reports it and goes on
    assert {n: r.state for n, r in rows.items()} == {
        "step-1": "unreadable",
        "step-2": "unreadable",
        "step-3": "local-only",
    }
    assert "marker version 2, newer than this lingctl reads" in rows["step-1"].problems[0]
    assert "not a valid lingctl-pcache marker" in rows["step-2"].problems[0]
    res = CliRunner().invoke(cli_app(), ["status", str(root), "--json"])
    assert res.exit_code == 0, res.output
    assert [c["state"] for c in json.loads(res.stdout)["checkpoints"]] == ["unreadable", "unreadable", "local-only"]
