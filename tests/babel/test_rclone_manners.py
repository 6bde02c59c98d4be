"""`lingctl babel` behaves as an rclone user expects: `copy` never deletes and `sync` makes DST identical
(guarded by --max-delete), single files copy in both directions (copy and copyto), stats lines off a
terminal, binary units, dry runs that size right, journals outside user trees, --bwlimit, and agreement
with rclone itself on what is up to date.

Commands run in this process (``lingctl.cli.run``: the same parsing and exit codes as the CLI, without an
interpreter start per call); S3 cases run against the real `rclone serve s3` test server.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from lingctl.babel.bwlimit import TokenBucket, parse_rate
from lingctl.babel.meter import parse_duration
from lingctl.cli import run
from lingctl.core.errors import UsageError
from lingctl.core.local_s3 import find_rclone
from lingctl.core.output import Output
from lingctl.core.storage import S3Options
from lingctl.core.storage.s3.store import make_client

KiB, MiB = 1 << 10, 1 << 20
TREE = {"a.bin": 3 * KiB, "d/b.bin": 5 * KiB, "d/e/c.txt": 100}
LEGACY = ".lingctl-babel"  # where older runs kept the journal inside a local destination


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manners") / "src"
    for key, size in TREE.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(os.urandom(size))
    # A fractional mtime: agreement with rclone must hold below the second.
    os.utime(root / "a.bin", (1_700_000_000.123456, 1_700_000_000.123456))
    return root


def babel(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run(["babel", *args])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith(("warning: ", "lingctl: WARNING"))]
    assert lines and lines[0].startswith("lingctl: error: "), err
    assert all(line.startswith(("lingctl: error: ", "hint: ")) for line in lines) and len(lines) <= 2, err
    return lines[0]


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# -- copy, sync, --max-delete, dry runs, the journal's place -------------------------------------------------


def test_copy_keeps_extras_sync_removes_them_within_limits(capsys, src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    extras = {"stale.txt": b"not in the source", "d/old.bin": b"gone from the source"}
    for key, data in extras.items():
        (dst / key).parent.mkdir(parents=True, exist_ok=True)
        (dst / key).write_bytes(data)
    (dst / LEGACY).mkdir()
    (dst / LEGACY / "journal.sqlite").write_bytes(b"left by an older lingctl")
    total = sum(TREE.values())

    code, out, _ = babel(capsys, "copy", str(src), str(dst), "--dry-run")
    assert code == 0
    assert f"would copy 3 objects ({total / KiB:.1f} KiB)" in out  # the real byte count, in binary units
    code, out, _ = babel(capsys, "copy", str(src), str(dst), "--dry-run", "--json")
    assert json.loads(out)["would_copy_bytes"] == total and not (dst / "a.bin").exists()

    code, out, _ = babel(capsys, "copy", str(src), str(dst), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["copied"] == 3 and doc["deleted"] == 0
    assert files(dst) == {**files(src), **extras, f"{LEGACY}/journal.sqlite": b"left by an older lingctl"}
    # The journal lives in lingctl's cache, not in the user's tree.
    assert Path(doc["journal"]).is_relative_to(os.environ["LINGCTL_CACHE_DIR"])
    assert os.listdir(dst / LEGACY) == ["journal.sqlite"]
    assert babel(capsys, "verify", str(src), str(dst))[0] == 4  # the extras differ

    code, out, _ = babel(capsys, "sync", str(src), str(dst), "--dry-run", "--json")
    assert code == 0 and sorted(json.loads(out)["would_delete"]) == ["d/old.bin", "stale.txt"]  # never LEGACY
    code, _, err = babel(capsys, "sync", str(src), str(dst), "--max-delete", "1")
    assert code == 1 and "would delete 2 objects, more than --max-delete 1; nothing was deleted" in error_line(err)
    assert (dst / "stale.txt").exists() and (dst / "d/old.bin").exists()
    code, out, _ = babel(capsys, "sync", str(src), str(dst), "--exclude", "d/**", "--json")
    assert code == 0 and json.loads(out)["deleted"] == 1  # filters limit what sync may delete
    assert not (dst / "stale.txt").exists() and (dst / "d/old.bin").exists()
    code, out, _ = babel(capsys, "sync", str(src), str(dst), "--delete", "--json")  # the old flag: accepted
    assert code == 0 and json.loads(out)["deleted"] == 1
    assert babel(capsys, "verify", str(src), str(dst))[0] == 0
    assert (dst / LEGACY / "journal.sqlite").exists()  # an older run's state is never touched


# -- single files: copy into a directory, copyto a name, both directions -----------------------------------


def test_single_files_copy_into_directories_and_to_names(
    capsys, src: Path, tmp_path: Path, s3_env, s3_bucket: str
) -> None:
    client = make_client(S3Options(endpoint_url=s3_env["AWS_ENDPOINT_URL"]))
    client.put_object(Bucket=s3_bucket, Key="p/other.txt", Body=b"stays")
    a = src / "a.bin"
    data = a.read_bytes()

    def s3_get(key: str) -> bytes:
        return client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()

    # sync of one file used to exit 3 ("directory does not exist"); it copies, and deletes nothing.
    code, out, err = babel(capsys, "sync", str(a), f"s3://{s3_bucket}/p/", "--json")
    assert code == 0, err
    assert json.loads(out)["copied"] == 1 and s3_get("p/a.bin") == data and s3_get("p/other.txt") == b"stays"
    code, out, _ = babel(capsys, "copy", str(a), f"s3://{s3_bucket}/p", "--json")  # an existing prefix: into it
    assert code == 0 and json.loads(out)["skipped"] == 1  # journaled: the same copy is not done twice
    code, out, _ = babel(capsys, "copy", str(a), f"s3://{s3_bucket}/p/renamed.bin", "--verify", "full", "--json")
    assert code == 0 and json.loads(out)["verified"] == 1 and s3_get("p/renamed.bin") == data

    down = tmp_path / "down"
    down.mkdir()
    code, _, err = babel(capsys, "copy", f"s3://{s3_bucket}/p/renamed.bin", str(down))  # an existing directory
    assert code == 0, err
    code, _, err = babel(capsys, "copy", f"s3://{s3_bucket}/p/renamed.bin", str(down / "new" / "x.bin"))
    assert code == 0, err
    assert files(down) == {"renamed.bin": data, "new/x.bin": data}
    code, _, err = babel(capsys, "copy", str(a), str(down / "new" / "x.bin"))  # replaces an existing file
    assert code == 0 and (down / "new" / "x.bin").stat().st_mtime == pytest.approx(a.stat().st_mtime, abs=1e-3)
    code, _, err = babel(capsys, "copy", str(a), str(src) + "/")  # onto itself
    assert code == 2 and "the same file" in error_line(err)
    code, _, err = babel(capsys, "copy", str(tmp_path / "missing.bin"), str(down))
    assert code == 3 and "does not exist" in error_line(err)
    # An S3 prefix with nothing under it is most likely a typo: sync refuses it rather than empty DST.
    code, _, err = babel(capsys, "sync", f"s3://{s3_bucket}/no-such-prefix", str(down))
    assert code == 3 and "no objects under this prefix" in error_line(err)
    assert files(down) == {"renamed.bin": data, "new/x.bin": data}


# -- progress off a terminal, binary units, --bwlimit --------------------------------------------------------


def test_stats_lines_off_a_terminal_and_forced_progress(capsys, src: Path, tmp_path: Path) -> None:
    code, out, err = babel(capsys, "copy", str(src), str(tmp_path / "a"), "--stats", "1ms", "--bwlimit", "100M")
    assert code == 0 and "copied 3 objects (8.1 KiB)" in out
    stats = [line for line in err.splitlines() if "Transferred:" in line]
    assert stats, err
    assert re.search(
        r"Transferred: 8\.1 KiB / 8\.1 KiB, 100%, .* objects: 3 copied, 3 checked, 3 listed; "
        r"errors: 0",
        stats[-1],
    ), stats[-1]
    code, _, err = babel(capsys, "copy", str(src), str(tmp_path / "b"), "--stats", "0")
    assert code == 0 and "Transferred:" not in err
    code, _, err = babel(capsys, "copy", str(src), str(tmp_path / "c"), "-P", "--stats", "1ms")
    assert code == 0 and "\x1b[" in err and "Transferred:" not in err  # the live display, not log lines
    for flag, value in (("--stats", "soon"), ("--bwlimit", "fast")):
        code, _, err = babel(capsys, "copy", str(src), str(tmp_path / "d"), flag, value)
        assert code == 2 and f"invalid {'duration' if flag == '--stats' else '--bwlimit'}" in error_line(err)
    assert not (tmp_path / "d").exists()


def test_progress_bar_uses_binary_units() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Terminal()
    out = Output(stderr=err, stdout=io.StringIO())
    with out.progress("syncing", total=3 * MiB, unit="bytes", binary_units=True) as bar:
        bar.advance(1.5 * MiB)
    assert "1.5/3.0 MiB" in err.getvalue() and "MB" not in err.getvalue()


def test_bwlimit_rates_and_token_bucket() -> None:
    assert parse_rate("10M") == 10 * MiB and parse_rate("512") == 512 * KiB and parse_rate("1.5GiB") == 1.5 * 1024 * MiB
    assert parse_rate("0") == parse_rate("off") == 0
    with pytest.raises(UsageError):
        parse_rate("10 Mbit")
    assert parse_duration("1m") == 60 and parse_duration("1h30m") == 5400 and parse_duration("500ms") == 0.5
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    bucket = TokenBucket(1 * MiB, clock=lambda: now[0], sleep=sleep)
    bucket.take(3 * MiB)  # from empty: three seconds' worth
    assert slept == [pytest.approx(3.0)]
    now[0] += 10.0  # idle: at most one second of tokens is saved up
    bucket.take(2 * MiB)
    assert slept[-1] == pytest.approx(1.0) and sum(slept) == pytest.approx(4.0)


def test_bwlimit_paces_a_large_object_part_by_part(tmp_path: Path) -> None:
    from lingctl.babel.sync import Syncer, SyncOptions
    from lingctl.core.storage import parse_url

    (tmp_path / "src").mkdir()
    data = os.urandom(20 * MiB)
    (tmp_path / "src" / "big.bin").write_bytes(data)
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    bucket = TokenBucket(5 * MiB, clock=lambda: now[0], sleep=sleep)
    opts = SyncOptions(state_dir=tmp_path / "state", part_size=5 * MiB, jobs=1, limiter=bucket)
    result = Syncer(parse_url(str(tmp_path / "src")), parse_url(str(tmp_path / "dst")), S3Options(), opts).run()
    assert result.copied == 1 and (tmp_path / "dst" / "big.bin").read_bytes() == data
    # Four parts of 5 MiB, each held back one second as it went through, not one 4-second wait at the end.
    assert len(slept) == 4 and sum(slept) == pytest.approx(4.0)


# -- agreement with rclone ------------------------------------------------------------------------------------


def rclone(s3_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The rclone client with a remote "t:" configured from the environment only (no config file)."""
    env = {
        **s3_env,
        "RCLONE_CONFIG_T_TYPE": "s3",
        "RCLONE_CONFIG_T_PROVIDER": "Other",
        "RCLONE_CONFIG_T_ENDPOINT": s3_env["AWS_ENDPOINT_URL"],
        "RCLONE_CONFIG_T_ACCESS_KEY_ID": s3_env["AWS_ACCESS_KEY_ID"],
        "RCLONE_CONFIG_T_SECRET_ACCESS_KEY": s3_env["AWS_SECRET_ACCESS_KEY"],
    }
    exe = find_rclone()
    assert exe is not None
    return subprocess.run([exe, "--config", os.devnull, *args], capture_output=True, text=True, env=env, timeout=60)


def test_rclone_sees_babels_mtimes_and_finds_nothing_to_copy(capsys, src: Path, s3_env, s3_bucket: str) -> None:
    code, _, err = babel(capsys, "copy", str(src), f"s3://{s3_bucket}/rc")
    assert code == 0, err
    listing = rclone(s3_env, "lsl", f"t:{s3_bucket}/rc")
    assert listing.returncode == 0, listing.stderr
    seen = {}
    for line in listing.stdout.splitlines():  # "<size> <YYYY-MM-DD HH:MM:SS.nnnnnnnnn> <name>", local time
        size, day, clock, name = line.split(maxsplit=3)
        seen[name] = dt.datetime.strptime(f"{day} {clock[:15]}", "%Y-%m-%d %H:%M:%S.%f").timestamp()
    assert set(seen) == set(TREE)
    for name, mtime in seen.items():
        assert mtime == pytest.approx((src / name).stat().st_mtime, abs=1e-3), name
    again = rclone(s3_env, "copy", str(src), f"t:{s3_bucket}/rc", "-v", "--use-json-log")
    assert again.returncode == 0, again.stderr
    logs = [json.loads(line) for line in again.stderr.splitlines() if line.startswith("{")]
    final = [r["stats"] for r in logs if "stats" in r]
    assert final and final[-1]["transfers"] == 0, again.stderr
    assert not [r for r in logs if "modification time" in r.get("msg", "")]  # nor did it rewrite any mtime


# -- --timeout and --contimeout, rclone's names for the idle and connect timeouts ---------------------------


def test_timeout_and_contimeout_bound_every_request(capsys, tmp_path: Path, monkeypatch) -> None:
    from tests.support.hostile_http import FakeObject, FakeS3, HostileServer, object_head, trickled

    for name, value in (("AWS_ACCESS_KEY_ID", "AKIDTIMEOUTTEST00001"), ("AWS_SECRET_ACCESS_KEY", "s" * 40)):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for bad in ("0", "-1s", "soon"):
        code, _, err = babel(capsys, "ls", "s3://bkt", "--timeout", bad)
        assert code == 2 and "--timeout" in error_line(err)
    # A GET that trickles (a byte every 20 ms): cut once a --timeout window brings less than 1 KiB/s.
    obj = FakeObject(2000)
    fake = FakeS3("bkt", {"obj.bin": obj}, on_get=trickled(object_head(obj) + bytes(obj.size), 0.02))
    with HostileServer(fake) as server:
        common = ["--retries", "1", "--endpoint-url", server.endpoint]
        code, _, err = babel(capsys, "copy", "s3://bkt/", str(tmp_path / "dst"), "--timeout", "500ms", *common)
        assert code == 5 and "the answer is too slow" in error_line(err)
        assert server.sent < obj.size  # cut, not waited out
    # A server whose accept queue is full: the connect waits for --contimeout, then the usual exit 5.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        fillers = [socket.socket() for _ in range(3)]
        for s in fillers:
            s.setblocking(False)
            s.connect_ex(listener.getsockname())
        try:
            port = listener.getsockname()[1]
            code, _, err = babel(capsys, "ls", "s3://bkt", "--contimeout", "300ms", "--retries", "1",
                                 "--endpoint-url", f"http://127.0.0.1:{port}")  # fmt: skip
            assert code == 5 and "could not reach S3 endpoint" in error_line(err) and "connect timed out" in err
        finally:
            for s in fillers:
                s.close()


# -- rclone's selection and comparison flags, -v lines, --log-file, Content-Type -------------------------------


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root


def test_size_only_and_ignore_existing_decide_as_rclone_does(capsys, tmp_path: Path) -> None:
    src = _tree(tmp_path / "s", {"same.bin": b"x" * 10, "grown.bin": b"y" * 20, "new.bin": b"z"})
    dst = _tree(tmp_path / "d", {"same.bin": b"o" * 10, "grown.bin": b"o" * 5})
    os.utime(dst / "same.bin", (1_000_000_000, 1_000_000_000))  # another time: a plain copy would replace it
    code, _, err = babel(capsys, "copy", str(src), str(dst), "--size-only", "--json")
    assert code == 0, err
    assert (dst / "same.bin").read_bytes() == b"o" * 10  # equal sizes: left alone
    assert (dst / "grown.bin").read_bytes() == b"y" * 20 and (dst / "new.bin").read_bytes() == b"z"
    (src / "same.bin").write_bytes(b"q" * 99)
    code, _, err = babel(capsys, "copy", str(src), str(dst), "--ignore-existing")
    assert code == 0, err
    assert (dst / "same.bin").read_bytes() == b"o" * 10  # another size, but DST has it: ignored
    code, _, err = babel(capsys, "copy", str(src), str(dst), "--size-only", "--checksum")
    assert code == 2 and "contradict" in error_line(err)


def test_files_from_limits_what_is_copied_and_what_sync_may_delete(capsys, tmp_path: Path) -> None:
    src = _tree(tmp_path / "s", {"a.txt": b"a", "d/b.txt": b"b", "c.txt": b"c"})
    dst = _tree(tmp_path / "d", {"old.txt": b"old", "d/gone.txt": b"g"})
    listing = tmp_path / "list.txt"
    listing.write_text("# the two wanted\n  a.txt  \n/d/b.txt\n\n; d/gone.txt is not listed\nd/gone.txt\n")
    code, _, err = babel(capsys, "sync", str(src), str(dst), "--files-from", str(listing))
    assert code == 0, err
    assert (dst / "a.txt").exists() and (dst / "d/b.txt").exists() and not (dst / "c.txt").exists()
    assert (dst / "old.txt").exists()  # not listed: outside the run, never deleted
    assert not (dst / "d/gone.txt").exists()  # listed, not in SRC: sync deletes it
    bad = tmp_path / "bad.txt"
    bad.write_text("a.txt\n../etc/passwd\n")
    code, _, err = babel(capsys, "copy", str(src), str(dst), "--files-from", str(bad))
    assert code == 2 and "bad.txt:2" in error_line(err)


def test_verbose_logs_one_line_per_object_and_log_file_takes_them(capsys, tmp_path: Path) -> None:
    src = _tree(tmp_path / "s", {"a.txt": b"a", "b.txt": b"b"})
    dst = _tree(tmp_path / "d", {"b.txt": b"old b", "x.txt": b"extra"})
    log = tmp_path / "babel.log"
    log.write_text("an earlier line\n")
    code, _, err = babel(capsys, "sync", str(src), str(dst), "-v", "--log-file", str(log))
    assert code == 0, err
    text = log.read_text()
    assert text.startswith("an earlier line\n")  # appended to, as rclone does
    assert "a.txt: Copied (new)" in text and "b.txt: Copied (replaced existing)" in text
    assert "x.txt: Deleted" in text
    assert "Copied" not in err  # the records went to the file, not stderr
    (src / "c.txt").write_bytes(b"c")
    code, _, err = babel(capsys, "copy", str(src), str(dst), "-v")
    assert code == 0 and "c.txt: Copied (new)" in err and "a.txt: Copied" not in err
    code, _, err = babel(capsys, "copy", str(src), str(dst), "--log-file", str(tmp_path / "no" / "dir" / "x.log"))
    assert code != 0 and "--log-file" in error_line(err)


def test_uploads_carry_a_content_type_from_the_name(capsys, tmp_path: Path, s3_env, s3_bucket: str) -> None:
    src = _tree(tmp_path / "s", {"p.png": b"\x89PNG", "n.json": b"{}", "r.txt": b"t", "w.safetensors": b"0"})
    code, _, err = babel(capsys, "copy", str(src), f"s3://{s3_bucket}/ct")
    assert code == 0, err
    client = make_client(S3Options(endpoint_url=s3_env["AWS_ENDPOINT_URL"]))
    types = {
        k: client.head_object(Bucket=s3_bucket, Key=f"ct/{k}")["ContentType"] for k in ("p.png", "n.json", "r.txt")
    }
    assert types == {"p.png": "image/png", "n.json": "application/json", "r.txt": "text/plain"}
    unknown = client.head_object(Bucket=s3_bucket, Key="ct/w.safetensors")["ContentType"]
    assert unknown == "application/octet-stream"
