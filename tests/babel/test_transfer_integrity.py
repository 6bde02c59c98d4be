"""Transfers that converge and never tear: forgotten multipart uploads, sources overwritten during a copy,
temporary files of killed runs, a full disk, and exit codes that say whether running again can help.

Against the real `rclone serve s3` (through the fault proxy where a request must be held or failed at an
exact point), real files and real `lingctl` subprocesses.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from lingctl.babel.journal import Done, Journal
from lingctl.babel.sync import Syncer, SyncOptions
from lingctl.core.atomic import TMP_MARKER, host_tag
from lingctl.core.errors import DiskFullError
from lingctl.core.storage import LocalStore as LocalSide
from lingctl.core.storage import S3Options, SourceChangedError, Version, parse_url
from lingctl.core.storage.s3.store import make_client
from tests.babel.test_sync import babel, make_tree, read_tree, s3_tree
from tests.support.fault_proxy import FaultProxy, FaultRequest

MiB = 1 << 20


@pytest.fixture
def cache_env(tmp_path, s3_env):
    return {**s3_env, "LINGCTL_CACHE_DIR": str(tmp_path / "cache")}


def _client():
    return make_client(S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))


def _syncer(src: str, dst: str, endpoint: str, state: Path, *, attempts: int = 3, **opts) -> Syncer:
    return Syncer(
        parse_url(src),
        parse_url(dst),
        S3Options(endpoint_url=endpoint, max_attempts=attempts),
        SyncOptions(state_dir=state, **opts),
    )


def _is_upload_part(r: FaultRequest) -> bool:
    return r.method == "PUT" and "uploadId=" in r.query


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if TMP_MARKER in p.name]


def _wait_for(condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- a multipart upload the server forgot ------------------------------------------------------------------


def test_forgotten_upload_id_is_replaced_on_the_next_run(tmp_path, s3_bucket, s3_server, cache_env, lingctl):
    """A run stopped after two parts leaves its upload id in the journal; the upload is then aborted behind
    babel's back (as a lifecycle rule or a server restart would). The next run must not exit 5 for ever."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(20 * MiB + 17)  # 5 parts of 5 MiB
    (src / "model.bin").write_bytes(data)
    dest, state = f"s3://{s3_bucket}/gone", tmp_path / "state"
    sent = {"parts": 0}
    lock = threading.Lock()

    def first_two_parts_only(r: FaultRequest):
        if not _is_upload_part(r):
            return None
        with lock:
            sent["parts"] += 1
            return None if sent["parts"] <= 2 else "503"

    with FaultProxy(s3_server.endpoint, rule=first_two_parts_only) as proxy:
        result = _syncer(str(src), dest, proxy.endpoint, state, attempts=1, part_size=5 * MiB, jobs=2).run()
    assert result.failed
    failure = result.failure()
    assert failure is not None and failure.exit_code == 5
    with sqlite3.connect(state / "journal.sqlite") as db:
        (upload_id,) = db.execute("SELECT upload_id FROM uploads").fetchone()
        assert db.execute("SELECT COUNT(*) FROM parts").fetchone()[0] == 2
    client = _client()
    client.abort_multipart_upload(Bucket=s3_bucket, Key="gone/model.bin", UploadId=upload_id)

    res, doc = babel(
        lingctl,
        "sync",
        str(src),
        dest,
        "--part-size",
        "5MiB",
        "--state-dir",
        str(state),
        "--verify",
        "full",
        env=cache_env,
    )
    assert res.returncode == 0, res.stderr
    assert doc["restarts"] == 1 and doc["copied"] == 1 and doc["verified"] == 1
    assert s3_tree(s3_bucket, "gone/") == {"model.bin": data}
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    with sqlite3.connect(state / "journal.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM uploads").fetchone()[0] == 0


def test_upload_forgotten_during_the_run_restarts_in_the_same_run(tmp_path, s3_bucket, s3_server, s3_env):
    """The upload is aborted after its last part, before CompleteMultipartUpload: that run starts a new
    upload and finishes. (Aborting before an UploadPart makes rclone answer before reading the part's body
    and close the connection, which the proxy relays as a 502; the next-run test covers UploadPart.)"""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(15 * MiB + 3)
    (src / "weights.bin").write_bytes(data)
    client = _client()
    aborted: list[str] = []

    def abort_before_complete(r: FaultRequest):
        if r.method == "POST" and "uploadId=" in r.query and not aborted:
            upload_id = parse_qs(r.query)["uploadId"][0]
            client.abort_multipart_upload(Bucket=s3_bucket, Key="live/weights.bin", UploadId=upload_id)
            aborted.append(upload_id)
        return None

    with FaultProxy(s3_server.endpoint, rule=abort_before_complete) as proxy:
        result = _syncer(
            str(src),
            f"s3://{s3_bucket}/live",
            proxy.endpoint,
            tmp_path / "state",
            part_size=5 * MiB,
            jobs=1,
            verify="full",
        ).run()
    assert aborted, "the rule never saw CompleteMultipartUpload"
    assert result.failed == [] and result.restarts == 1 and result.copied == 1
    assert s3_tree(s3_bucket, "live/") == {"weights.bin": data}
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


# -- a source overwritten during the copy ------------------------------------------------------------------


def _overwrite_on_later_ranges(client, bucket: str, key: str, versions: list[bytes], *, times: int):
    """A proxy rule: before forwarding a GET of ``key`` whose range does not start at 0, put the next of
    ``versions`` (at most ``times`` times): the copy has read part 1 of one version and asks for part 2."""
    state = {"n": 0}
    lock = threading.Lock()

    def rule(r: FaultRequest):
        rng = r.headers.get("Range") or r.headers.get("range") or ""
        if r.method == "GET" and r.path.endswith("/" + key) and rng and not rng.startswith("bytes=0-"):
            with lock:
                if state["n"] < times:
                    client.put_object(Bucket=bucket, Key=key, Body=versions[state["n"] % len(versions)])
                    state["n"] += 1
        return None

    return rule, state


def test_object_overwritten_during_download_gives_one_whole_version(tmp_path, s3_bucket, s3_server, cache_env, lingctl):
    client = _client()
    a, b = os.urandom(12 * MiB + 5), os.urandom(12 * MiB + 5)  # same size: only the ETag tells them apart
    client.put_object(Bucket=s3_bucket, Key="src/ckpt.bin", Body=a)  # no lingctl checksum metadata
    client.put_object(Bucket=s3_bucket, Key="src/small.txt", Body=b"small")
    rule, state = _overwrite_on_later_ranges(client, s3_bucket, "src/ckpt.bin", [b], times=1)
    dst = tmp_path / "dst"
    with FaultProxy(s3_server.endpoint, rule=rule) as proxy:
        env = {**cache_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        res, doc = babel(
            lingctl,
            "sync",
            f"s3://{s3_bucket}/src",
            str(dst),
            "--part-size",
            "5MiB",
            "--jobs",
            "1",
            "--verify",
            "full",
            env=env,
        )
    assert state["n"] == 1, "the object was not overwritten during the copy"
    assert res.returncode == 0, res.stderr
    assert doc["restarts"] == 1 and doc["verified"] == 2 and doc["failed"] == []
    assert (dst / "ckpt.bin").read_bytes() == b  # the new version, whole: never part of a and part of b
    assert _temp_files(dst) == []
    res, doc = babel(lingctl, "verify", f"s3://{s3_bucket}/src", str(dst), "--mode", "full", env=cache_env)
    assert res.returncode == 0 and doc["ok"]
    res, doc = babel(lingctl, "sync", f"s3://{s3_bucket}/src", str(dst), env=cache_env)  # the version is recorded
    assert res.returncode == 0 and doc["copied"] == 0 and doc["skipped"] == 2


def test_source_that_keeps_changing_fails_retryably_and_writes_nothing(tmp_path, s3_bucket, s3_server, s3_env):
    client = _client()
    a, b = os.urandom(11 * MiB), os.urandom(11 * MiB)
    client.put_object(Bucket=s3_bucket, Key="busy/log.bin", Body=a)
    rule, state = _overwrite_on_later_ranges(client, s3_bucket, "busy/log.bin", [b, a], times=100)
    dst = tmp_path / "dst"
    with FaultProxy(s3_server.endpoint, rule=rule) as proxy:
        result = _syncer(
            f"s3://{s3_bucket}/busy", str(dst), proxy.endpoint, tmp_path / "state", part_size=5 * MiB, jobs=1
        ).run()
    assert state["n"] >= 3 and result.restarts == 2 and result.copied == 0  # a part in flight may see more
    (failed,) = result.failed
    assert failed["kind"] == "retryable" and "changed during each of 3 attempts" in failed["error"]
    err = result.failure()
    assert err is not None and err.exit_code == 5 and "run the same command again" in (err.hint or "")
    assert not (dst / "log.bin").exists() and _temp_files(dst) == []


def test_local_pinned_read_notices_a_changed_file(tmp_path):
    side = LocalSide(parse_url(str(tmp_path)))
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    st = path.stat()
    pin = Version(st.st_size, st.st_mtime)
    assert side.read("f.bin", 10, 5, pin=pin) == b"xxxxx"
    os.utime(path, (st.st_atime, st.st_mtime + 5))  # rewritten in place: same size, new mtime
    with pytest.raises(SourceChangedError, match="changed during the copy"):
        side.read("f.bin", 10, 5, pin=pin)
    path.unlink()
    with pytest.raises(SourceChangedError, match="removed during the copy"):
        side.read("f.bin", pin=pin)


# -- temporary files of a killed run -----------------------------------------------------------------------


def test_temp_file_of_a_killed_download_is_removed_by_the_next_run(tmp_path, s3_bucket, s3_server, cache_env, lingctl):
    client = _client()
    data = os.urandom(11 * MiB)
    client.put_object(Bucket=s3_bucket, Key="k/big.bin", Body=data)
    release = threading.Event()

    def hold_later_parts(r: FaultRequest):
        rng = r.headers.get("Range") or ""
        if r.method == "GET" and rng and not rng.startswith("bytes=0-"):
            release.wait(60)  # the download stays half-done until the process is killed
        return None

    dst = tmp_path / "dst"
    user_file = dst / f"notes{TMP_MARKER}mine.txt"  # a user's file that merely contains the marker
    user_file.parent.mkdir()
    user_file.write_text("keep me")
    with FaultProxy(s3_server.endpoint, rule=hold_later_parts) as proxy:
        env = {**cache_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        cmd = [
            sys.executable,
            "-m",
            "lingctl",
            "babel",
            "copy",
            f"s3://{s3_bucket}/k",
            str(dst),
            "--part-size",
            "5MiB",
            "--jobs",
            "1",
            "--json",
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for(
                lambda: [p for p in _temp_files(dst) if p != user_file] or proc.poll() is not None,
                what="the download's temporary file",
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            proc.kill()
            release.set()
    left = [p for p in _temp_files(dst) if p != user_file]
    assert len(left) == 1 and left[0].name.startswith(".big.bin" + TMP_MARKER)
    res, doc = babel(lingctl, "copy", f"s3://{s3_bucket}/k", str(dst), env=cache_env)  # copy keeps the user's file
    assert res.returncode == 0, res.stderr
    assert doc["removed_temp_files"] == 1
    assert _temp_files(dst) == [user_file] and user_file.read_text() == "keep me"
    assert (dst / "big.bin").read_bytes() == data


# -- a full disk -------------------------------------------------------------------------------------------


def _file_size_limit(limit: int):
    def apply() -> None:
        # SIGXFSZ ignored (Python does so too): writes past the limit fail with EFBIG instead of killing.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return apply


def test_file_size_limit_is_one_line_exit_1_and_leaves_no_partial_file(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = make_tree(src, big=12 * MiB)
    cmd = [sys.executable, "-m", "lingctl", "babel", "sync", str(src), str(dst), "--part-size", "5MiB"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=_file_size_limit(4 * MiB))
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("lingctl: error:") and "file too large" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("hint: free space")
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    assert _temp_files(dst) == [] and not (dst / "big/model.safetensors").exists()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # space again: the run converges
    assert res.returncode == 0, res.stderr
    assert read_tree(dst) == files


def _private_mounts_allowed() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# The scenario runs in a private mount namespace: a 30 MiB tmpfs is the destination's file system, the first
# sync fills it, the tmpfs is grown to 80 MiB and the same sync runs again; the result is copied out before the
# namespace (and its tmpfs) goes away.
_FULL_DISK_SCRIPT = """
set -u
mount -t tmpfs -o size=30M lingctl-test "$DST" || exit 97
"$PY" -m lingctl babel sync "$SRC" "$DST" --part-size 5MiB --json > "$OUT/first.json" 2> "$OUT/first.err"
echo $? > "$OUT/first.rc"
mount -o remount,size=80M "$DST" || exit 98
"$PY" -m lingctl babel sync "$SRC" "$DST" --part-size 5MiB --json > "$OUT/second.json" 2> "$OUT/second.err"
echo $? > "$OUT/second.rc"
"$PY" -m lingctl babel verify "$SRC" "$DST" --mode full --json > "$OUT/verify.json" 2> "$OUT/verify.err"
echo $? > "$OUT/verify.rc"
cp -a "$DST/." "$OUT/copy/"
"""


@pytest.mark.skipif(not _private_mounts_allowed(), reason="needs a private mount namespace (unshare -m) for a tmpfs")
def test_a_full_disk_keeps_no_damaged_file_under_its_final_name(tmp_path, s3_bucket, cache_env):
    """15 objects, 50 MiB, into a 30 MiB file system: the run fails with "no space left"; no file reaches its
    final name unless every byte of it was written, so after space is freed the rerun copies what is missing
    (nothing damaged is called up to date) and a full verify matches."""
    src = tmp_path / "src"
    sizes = [7, 9, 11, 6, 8] + [1] * 9  # MiB: multipart objects (5 MiB parts) and single writes
    files = {f"d{i % 3}/obj-{i:02d}.bin": os.urandom(n * MiB - 1000 * i) for i, n in enumerate(sizes)}
    files["tail.bin"] = os.urandom(MiB // 3)
    for key, data in files.items():
        (src / key).parent.mkdir(parents=True, exist_ok=True)
        (src / key).write_bytes(data)
    assert 49 * MiB < sum(map(len, files.values())) < 51 * MiB and len(files) == 15
    seeded = subprocess.run(
        [sys.executable, "-m", "lingctl", "babel", "sync", str(src), f"s3://{s3_bucket}/s1", "--part-size", "5MiB"],
        capture_output=True, text=True, env=cache_env, timeout=300,
    )  # fmt: skip
    assert seeded.returncode == 0, seeded.stderr
    dst, out = tmp_path / "dst", tmp_path / "out"
    dst.mkdir()
    (out / "copy").mkdir(parents=True)
    env = {**cache_env, "SRC": f"s3://{s3_bucket}/s1", "DST": str(dst), "OUT": str(out), "PY": sys.executable}
    ran = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", _FULL_DISK_SCRIPT],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    first_err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "1", first_err
    assert "no space left" in first_err.lower() and "Traceback" not in first_err
    second = json.loads((out / "second.json").read_text())
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.err").read_text()
    assert second["copied"] >= 1 and second["copied"] + second["skipped"] == len(files)
    verify_rc = (out / "verify.rc").read_text().strip()
    assert verify_rc == "0", (out / "verify.json").read_text() + (out / "verify.err").read_text()
    assert read_tree(out / "copy") == files
    assert _temp_files(out / "copy") == []


def test_short_part_writes_never_complete_a_file(tmp_path):
    """A part write that the file system cuts short (here a file-size limit in the middle of the part) is
    written on until it fails with the reason, and an upload whose parts do not cover the file is not
    renamed into place."""
    script = f"""
import resource, signal, sys
from pathlib import Path
from lingctl.core.errors import DiskFullError
from lingctl.core.storage import LocalStore, parse_url
from lingctl.core.storage.local import IncompleteUploadError

store = LocalStore(parse_url({str(tmp_path / "dst")!r}))
size = 3 << 20
upload = store.multipart.create("f.bin", size)
first = store.multipart.put_part("f.bin", upload, 1, 0, b"a" * (1 << 20))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ((3 << 20) // 2, resource.RLIM_INFINITY))
try:
    store.multipart.put_part("f.bin", upload, 2, 1 << 20, b"b" * (1 << 20))
    print("second part: written")
except DiskFullError as exc:
    print("second part:", exc.exit_code, exc.message)
third = store.multipart.put_part("f.bin", upload, 3, 2 << 20, b"")  # an empty tag, as a lost part would leave
try:
    store.multipart.complete("f.bin", upload, [(1, first), (3, third)])
    print("complete: done")
except IncompleteUploadError as exc:
    print("complete: refused:", exc.message)
print("final name exists:", Path({str(tmp_path / "dst" / "f.bin")!r}).exists())
"""
    (tmp_path / "dst").mkdir()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("second part: 1 ") and "too large" in lines[0], lines
    assert lines[1].startswith("complete: refused:") and "starts at byte 2097152" in lines[1], lines
    assert lines[2] == "final name exists: False"
    assert _temp_files(tmp_path / "dst") == []


def test_journal_on_a_full_disk_is_a_disk_full_error(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    # sqlite's own "database or disk is full" (SQLITE_FULL), reached through a page limit on the connection.
    journal._run(lambda db: db.execute("PRAGMA max_page_count = 8"))
    with pytest.raises(DiskFullError, match="database or disk is full") as err:
        for i in range(2000):
            journal.mark_done(f"key-{i:05d}-" + "x" * 200, Done(1, 0.0, None, None, None))
            journal.flush()
    assert err.value.exit_code == 1 and "free space" in (err.value.hint or "")


# -- permanent failures ------------------------------------------------------------------------------------


def test_a_permanent_failure_exits_1_and_says_it_will_fail_again(tmp_path, lingctl):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = make_tree(src)
    dst.mkdir()
    (dst / "dir").write_text("a file where the source has a directory")  # every run fails the same way
    res, doc = babel(lingctl, "sync", str(src), str(dst))
    assert res.returncode == 1, res.stderr
    error = [line for line in res.stderr.splitlines() if line.startswith("lingctl: error:")]
    assert len(error) == 1 and "will happen again" in error[0]  # after one warning per failed object
    assert "run the same command again: finished" not in res.stderr and "Traceback" not in res.stderr
    failed = {f["key"] for f in doc["failed"]}
    assert failed == {k for k in files if k.startswith("dir/")}
    assert all(f["kind"] == "error" for f in doc["failed"])
    assert doc["copied"] == len(files) - len(failed)  # the others were copied all the same


def test_journal_tells_a_run_that_an_earlier_one_did_not_end(tmp_path):
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    assert journal.begin_run() is False  # a fresh journal: nothing to clean up
    journal.end_run()
    journal.close()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    with sqlite3.connect(path) as db:  # what a run killed with -9 leaves
        db.execute("INSERT INTO state VALUES (?, ?)", (f"run:{host_tag()}:{int(dead.stdout)}", repr(time.time())))
    journal = Journal(path)
    assert journal.begin_run() is True
    journal.end_run()
    assert journal.begin_run() is False  # the dead run's record went with the first look
    journal.close()


# -- a body damaged on its way to the server ----------------------------------------------------------------


def test_a_put_body_damaged_in_transit_is_refused_by_the_server_and_sent_again(tmp_path, s3_bucket, s3_server, s3_env):
    """Sampled verification of an object sent in one PUT is the server's check of its Content-MD5: a body
    that arrives with one byte changed is refused (400 BadDigest), sent again, and stored intact; with
    ``--verify none`` too, since the digest is always sent (only ``full`` reads back instead)."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(300_000)
    (src / "a.bin").write_bytes(data)
    flipped: list[int] = []

    def flip_first_put(r: FaultRequest):
        if r.method == "PUT" and r.path.endswith("/a.bin") and not flipped:
            flipped.append(r.number)
            return "flip"
        return None

    with FaultProxy(s3_server.endpoint, rule=flip_first_put) as proxy:
        result = _syncer(str(src), f"s3://{s3_bucket}/md5", proxy.endpoint, tmp_path / "state").run()
        assert proxy.stats["injected_flip"] == 1
    assert result.failed == [] and result.copied == 1 and result.retries == 1 and result.verified == 1
    assert s3_tree(s3_bucket, "md5/") == {"a.bin": data}
    flipped.clear()
    with FaultProxy(s3_server.endpoint, rule=flip_first_put) as proxy:
        result = _syncer(
            str(src), f"s3://{s3_bucket}/nocheck", proxy.endpoint, tmp_path / "state2", verify="none"
        ).run()
    # --verify none still sends the digest, as rclone always does: the server's check costs no read-back.
    assert result.failed == [] and result.retries == 1 and result.verified == 0
    assert s3_tree(s3_bucket, "nocheck/") == {"a.bin": data}


def test_a_part_damaged_in_transit_is_refused_and_no_part_is_read_back(tmp_path, s3_bucket, s3_server, s3_env):
    """A multipart copy with the default verification sends each part's Content-MD5: a part that arrives with
    one byte changed is refused and sent again; the object is not read back (no GET), since the server
    checked every byte it stored."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(12 * MiB)
    (src / "big.bin").write_bytes(data)
    flipped: list[int] = []

    def flip_second_part(r: FaultRequest):
        if _is_upload_part(r) and "partNumber=2" in r.query and not flipped:
            flipped.append(r.number)
            return "flip"
        return None

    gets: list[str] = []

    def rule(r: FaultRequest):
        if r.method == "GET" and "big.bin" in r.path:
            gets.append(r.query)
        return flip_second_part(r)

    with FaultProxy(s3_server.endpoint, rule=rule) as proxy:
        result = _syncer(
            str(src), f"s3://{s3_bucket}/parts-md5", proxy.endpoint, tmp_path / "state", part_size=5 * MiB
        ).run()
        assert proxy.stats["injected_flip"] == 1
    assert result.failed == [] and result.copied == 1 and result.retries == 1 and result.verified == 1
    assert gets == []
    assert s3_tree(s3_bucket, "parts-md5/") == {"big.bin": data}
