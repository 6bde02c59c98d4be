"""`lingctl babel sync / verify` as real subprocesses against a real `rclone serve s3` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lingctl.core.checksum import crc64_bytes, tag_from_b64
from lingctl.core.errors import LingctlError
from lingctl.core.storage import LocalStore as LocalSide
from lingctl.core.storage import S3Options, parse_url
from lingctl.core.storage.s3.store import make_client
from tests.support.fault_proxy import FaultProxy, every_nth

MiB = 1 << 20


def make_tree(root: Path, *, big: int = 0) -> dict[str, bytes]:
    """A small mixed tree: nested dirs, empty file, odd names, and optionally one multipart-sized object."""
    files = {
        "a.txt": b"alpha\n" * 100,
        "empty.bin": b"",
        "dir/b.txt": b"bravo" * 1000,
        "dir/sub/c.bin": os.urandom(300_000),
        "dir/sub/with space & plus+.txt": b"odd name",
        "ckpt/step-1/weights.bin": os.urandom(200_000),
        "ckpt/step-1/MANIFEST": b"done",
        "logs/run.tmp": b"scratch",
    }
    if big:
        files["big/model.safetensors"] = os.urandom(big)
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(".lingctl-babel"):
            out[rel] = path.read_bytes()
    return out


def s3_tree(bucket: str, prefix: str = "") -> dict[str, bytes]:
    client = make_client(S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            key = o["Key"][len(prefix) :].lstrip("/")
            out[key] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def babel(lingctl, *args: str, env: dict | None = None):
    res = lingctl("babel", *args, "--json", env=env)
    doc = json.loads(res.stdout) if res.stdout.strip() else None
    return res, doc


@pytest.fixture
def cache_env(tmp_path, s3_env):
    return {**s3_env, "LINGCTL_CACHE_DIR": str(tmp_path / "cache")}


def test_local_to_local_copies_skips_and_recopies_changes(lingctl, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = make_tree(src)
    res, doc = babel(lingctl, "sync", str(src), str(dst))
    assert res.returncode == 0, res.stderr
    assert doc["copied"] == len(files) and read_tree(dst) == files
    assert os.stat(dst / "dir/b.txt").st_mtime == pytest.approx(os.stat(src / "dir/b.txt").st_mtime, abs=1e-3)
    res, doc = babel(lingctl, "sync", str(src), str(dst))
    assert doc["copied"] == 0 and doc["skipped"] == len(files)
    (src / "a.txt").write_bytes(b"changed")
    res, doc = babel(lingctl, "sync", str(src), str(dst))
    assert doc["copied"] == 1 and (dst / "a.txt").read_bytes() == b"changed"


@pytest.mark.parametrize("direction", ["local->s3", "s3->local", "s3->s3"])
def test_all_directions_with_multipart_and_full_verify(lingctl, tmp_path, s3_bucket, s3_server, cache_env, direction):
    src = tmp_path / "src"
    files = make_tree(src, big=12 * MiB + 123)
    staging = f"s3://{s3_bucket}/staging"
    # Seed S3 sources with a local->s3 sync first (itself checked by the local->s3 case).
    if direction != "local->s3":
        assert babel(lingctl, "sync", str(src), staging, "--part-size", "5MiB", env=cache_env)[0].returncode == 0
    source = {"local->s3": str(src), "s3->local": staging, "s3->s3": staging}[direction]
    dest = {
        "local->s3": f"s3://{s3_bucket}/copy",
        "s3->local": str(tmp_path / "dst"),
        "s3->s3": f"s3://{s3_bucket}/copy2",
    }[direction]
    res, doc = babel(lingctl, "sync", source, dest, "--part-size", "5MiB", "--verify", "full", env=cache_env)
    assert res.returncode == 0, res.stderr
    assert doc["copied"] == len(files) and doc["verified"] == len(files) and doc["failed"] == []
    got = read_tree(tmp_path / "dst") if dest.startswith("/") else s3_tree(s3_bucket, dest.split("/", 3)[3])
    assert got == files
    if dest.startswith("s3://"):
        # The multipart object carries the full-object CRC64NVME of the source from its creation on.
        client = make_client(S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
        head = client.head_object(Bucket=s3_bucket, Key=dest.split("/", 3)[3] + "/big/model.safetensors")
        meta = {k.lower(): v for k, v in head["Metadata"].items()}
        assert tag_from_b64(meta["lingctl-crc64nvme"]) == crc64_bytes(files["big/model.safetensors"]).tagged()
    res, doc = babel(lingctl, "verify", source, dest, "--mode", "full", env=cache_env)
    assert res.returncode == 0 and doc["ok"] and doc["checked"] == len(files)
    # A no-op re-sync decides from the listings and the journal alone: no HEAD per object.
    res, doc = babel(lingctl, "sync", source, dest, env=cache_env)
    assert res.returncode == 0 and doc["copied"] == 0 and doc["skipped"] == len(files)
    assert doc["head_requests"] == 0


def test_sync_killed_midway_resumes_without_loss_or_duplicates(tmp_path, s3_bucket, cache_env, lingctl):
    src = tmp_path / "src"
    files = make_tree(src, big=40 * MiB)
    dest = f"s3://{s3_bucket}/resume"
    journal = tmp_path / "state" / "journal.sqlite"
    cmd = [
        sys.executable,
        "-m",
        "lingctl",
        "babel",
        "sync",
        str(src),
        dest,
        "--part-size",
        "5MiB",
        "--jobs",
        "2",
        "--state-dir",
        str(tmp_path / "state"),
        "--json",
    ]
    proc = subprocess.Popen(cmd, env=cache_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts_done = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.exists():
                try:
                    with sqlite3.connect(journal) as db:
                        parts_done = db.execute("SELECT COUNT(*) FROM parts").fetchone()[0]
                except sqlite3.Error:
                    parts_done = 0
                if parts_done >= 2:
                    break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert parts_done >= 2, "the sync finished before it could be interrupted"
    assert "big/model.safetensors" not in s3_tree(s3_bucket, "resume/")  # nothing half-visible
    res, doc = babel(
        lingctl,
        "sync",
        str(src),
        dest,
        "--part-size",
        "5MiB",
        "--state-dir",
        str(tmp_path / "state"),
        "--verify",
        "full",
        env=cache_env,
    )
    assert res.returncode == 0, res.stderr
    assert doc["resumed_parts"] >= 2
    assert s3_tree(s3_bucket, "resume/") == files
    client = make_client(S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_corrupted_byte_found_by_full_and_sampled_verify(lingctl, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = make_tree(src, big=20 * MiB)
    assert babel(lingctl, "sync", str(src), str(dst))[0].returncode == 0

    def flip(path: Path, offset: int) -> None:
        st = path.stat()
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: invisible to metadata

    flip(dst / "dir/sub/c.bin", 12345)  # a small object: sampled mode reads it whole
    flip(dst / "big/model.safetensors", 100)  # the first MiB of a large object is always sampled
    meta, doc = babel(lingctl, "verify", str(src), str(dst), "--mode", "meta")
    assert meta.returncode == 0 and doc["ok"]
    for mode in ("sampled", "full"):
        res, doc = babel(lingctl, "verify", str(src), str(dst), "--mode", mode)
        assert res.returncode == 4, res.stderr
        bad = {d["key"]: d for d in doc["differences"]}
        assert set(bad) == {"dir/sub/c.bin", "big/model.safetensors"}
        assert bad["dir/sub/c.bin"]["source_checksum"] != bad["dir/sub/c.bin"]["destination_checksum"]
        assert res.stderr.startswith("lingctl: error: 2 difference(s)")
    human = lingctl("babel", "verify", str(src), str(dst), "--mode", "full")
    assert "DIFFERS dir/sub/c.bin" in human.stdout and "crc64nvme:" in human.stdout
    assert len(files) == 9


def test_503_slowdowns_are_survived_and_shrink_concurrency(lingctl, tmp_path, s3_bucket, s3_server, cache_env):
    src = tmp_path / "src"
    files = make_tree(src, big=11 * MiB)
    with FaultProxy(s3_server.endpoint, rule=every_nth(3)) as proxy:
        env = {**cache_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        res, doc = babel(
            lingctl,
            "sync",
            str(src),
            f"s3://{s3_bucket}/flaky",
            "--part-size",
            "5MiB",
            "--jobs",
            "8",
            "--verify",
            "full",
            env=env,
        )
        assert res.returncode == 0, res.stderr
        assert proxy.stats["injected_503"] > 0
    assert doc["throttled"] > 0 and doc["retries"] > 0 and doc["min_concurrency"] < 8
    assert s3_tree(s3_bucket, "flaky/") == files


def test_persistent_failure_exits_5_and_a_rerun_finishes(lingctl, tmp_path, s3_bucket, s3_server, cache_env):
    src = tmp_path / "src"
    files = make_tree(src)
    with FaultProxy(s3_server.endpoint, rule=lambda r: "503" if r.method == "PUT" else None) as proxy:
        env = {**cache_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        res, doc = babel(lingctl, "sync", str(src), f"s3://{s3_bucket}/down", "--retries", "2", env=env)
    assert res.returncode == 5 and doc["failed"]
    assert "lingctl: error:" in res.stderr and "run the same command again" in res.stderr
    assert "Traceback" not in res.stderr
    res, doc = babel(lingctl, "sync", str(src), f"s3://{s3_bucket}/down", env=cache_env)
    assert res.returncode == 0 and s3_tree(s3_bucket, "down/") == files


def test_include_exclude_delete_and_max_delete(lingctl, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src)
    res, doc = babel(
        lingctl, "sync", str(src), str(dst), "--exclude", "*.tmp", "--include", "dir/**", "--include", "*.txt"
    )
    assert res.returncode == 0
    assert set(read_tree(dst)) == {"a.txt", "dir/b.txt", "dir/sub/c.bin", "dir/sub/with space & plus+.txt"}
    (dst / "stale1").write_text("x")
    (dst / "stale2").write_text("y")
    res, doc = babel(lingctl, "sync", str(src), str(dst), "--delete", "--max-delete", "1", "--dry-run")
    assert res.returncode == 0 and sorted(doc["would_delete"]) == ["stale1", "stale2"]
    assert (dst / "stale1").exists()
    res, _ = babel(lingctl, "sync", str(src), str(dst), "--delete", "--max-delete", "1")
    assert res.returncode == 1 and "more than --max-delete 1" in res.stderr
    assert (dst / "stale1").exists() and (dst / "stale2").exists()
    res, doc = babel(lingctl, "sync", str(src), str(dst), "--delete")
    assert res.returncode == 0 and doc["deleted"] == 2
    assert not (dst / "stale1").exists() and not (dst / ".lingctl-babel").exists()  # the journal is elsewhere


def test_shards_split_the_work_and_commit_last_lands_last(lingctl, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = make_tree(src)
    copied = []
    for shard in ("0/2", "1/2"):
        res, doc = babel(lingctl, "sync", str(src), str(dst), "--shard", shard, "--commit-last", "MANIFEST")
        assert res.returncode == 0, res.stderr
        copied.append(doc["copied"])
    assert sum(copied) == len(files) and all(copied)
    assert read_tree(dst) == files
    dst2 = tmp_path / "dst2"
    assert babel(lingctl, "sync", str(src), str(dst2), "--commit-last", "MANIFEST", "--jobs", "4")[0].returncode == 0
    ctimes = {p.relative_to(dst2).as_posix(): p.stat().st_ctime_ns for p in dst2.rglob("*") if p.is_file()}
    manifest = ctimes.pop("ckpt/step-1/MANIFEST")
    ctimes.pop(".lingctl-babel/journal.sqlite", None)
    assert manifest >= max(v for k, v in ctimes.items() if not k.startswith(".lingctl-babel"))


def test_keys_that_would_escape_a_local_destination_are_refused(tmp_path):
    side = LocalSide(parse_url(str(tmp_path)))
    for key in ("../evil", "a/../../evil", "/etc/passwd", "a//b"):
        with pytest.raises(LingctlError, match="refusing key"):
            side.write(key, b"x", mtime=0.0)
    assert not (tmp_path.parent / "evil").exists()


def test_bad_url_missing_bucket_and_wrong_credentials_are_one_line_errors(lingctl, tmp_path, s3_env, s3_bucket):
    res = lingctl("babel", "sync", "ftp://x/y", str(tmp_path / "d"))
    assert res.returncode == 2 and res.stderr.startswith("lingctl: error:") and "Traceback" not in res.stderr
    res = lingctl("babel", "sync", str(tmp_path), "s3://no-such-bucket-here/x", env=s3_env)
    assert res.returncode == 3 and "no-such-bucket-here" in res.stderr.splitlines()[0]
    bad = {**s3_env, "AWS_SECRET_ACCESS_KEY": "wrong-secret-key-123"}
    res = lingctl("babel", "ls", f"s3://{s3_bucket}", "--recursive", env=bad)
    assert res.returncode == 1 and res.stderr.startswith("lingctl: error:") and "Traceback" not in res.stderr
    assert "wrong-secret-key-123" not in res.stderr
    res = lingctl("babel", "sync", str(tmp_path / "missing"), str(tmp_path / "d"))
    assert res.returncode == 3 and "does not exist" in res.stderr


def test_dry_run_changes_nothing_and_ls_lists(lingctl, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = make_tree(src)
    res, doc = babel(lingctl, "sync", str(src), str(dst), "--dry-run")
    assert res.returncode == 0 and sorted(doc["would_copy"]) == sorted(files)
    assert not dst.exists()
    res, doc = babel(lingctl, "ls", str(src), "--recursive")
    assert [d["key"] for d in doc] == sorted(files) and doc[0]["size"] == len(files[doc[0]["key"]])
    res, doc = babel(lingctl, "ls", str(src), "--summary")
    assert doc == {"url": str(src), "objects": len(files), "bytes": sum(map(len, files.values()))}
