"""Hostile and careless input to `lingctl babel`: overlapping trees, names that look like lingctl's own,
unreadable directories, escape sequences in keys, passwords in endpoint URLs, unusable state directories.

Exit codes and one-line errors are checked on real subprocesses; S3 cases run against the real test server.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lingctl.babel.overlap import overlap
from lingctl.babel.preflight import prepare
from lingctl.babel.sync import state_dir_for
from lingctl.core.atomic import TMP_MARKER
from lingctl.core.atomic import tmp_path as atomic_tmp_path
from lingctl.core.errors import AccessDeniedError
from lingctl.core.net import free_port
from lingctl.core.storage import S3Options, StoreURL, parse_url
from lingctl.core.storage.s3.store import make_client

OTHER_UID = 65534  # nobody
ESC_KEY = "esc\x1b[2J\x1b]0;pwned\x07.txt"
NEWLINE_KEY = "two\nlines.txt"


def one_line_error(stderr: str) -> str:
    """The error line of a failed command: exactly one 'lingctl: error:' line, an optional hint, no traceback."""
    lines = [line for line in stderr.strip().splitlines() if not line.startswith(("lingctl: WARNING", "warning: "))]
    assert lines and lines[0].startswith("lingctl: error: "), stderr
    assert len(lines) <= 2 and all(line.startswith(("lingctl: error: ", "hint: ")) for line in lines), stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".lingctl-babel" not in p.parts
    }


def write(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)


# -- 1. overlapping trees -------------------------------------------------------------------------------


def test_overlap_rule(tmp_path: Path) -> None:
    par = tmp_path / "par"
    (par / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(par, target_is_directory=True)

    def url(text: object) -> StoreURL:
        return parse_url(str(text))

    assert overlap(url(par / "sub"), url(par)) == "is inside"
    assert overlap(url(par), url(par / "copy")) == "contains"  # a destination that does not exist yet
    assert overlap(url(par), url(tmp_path / "link")) == "is the same as"  # through a symlink
    assert overlap(url(par / "sub"), url(tmp_path / "link" / "sub" / ".." / "sub")) == "is the same as"
    assert overlap(url(par), url(tmp_path / "parallel")) is None  # a common prefix of characters is not overlap
    assert overlap(url("s3://bkt/a"), url("s3://bkt/ab")) is None
    assert overlap(url("s3://bkt/a"), url("s3://bkt/a/x")) == "contains"
    assert overlap(url("s3://bkt"), url("s3://bkt/anything")) == "contains"
    assert overlap(url("s3://bkt/a/"), url("s3://bkt/a")) == "is the same as"
    assert overlap(url("s3://bkt/a"), url("s3://other/a")) is None
    assert overlap(url(par), url("s3://par/sub")) is None


def test_overlapping_trees_are_refused_and_left_as_they_were(lingctl, tmp_path: Path) -> None:
    par = tmp_path / "par"
    write(par, {"keep.txt": b"parent", "sub/data.bin": b"child"})
    before = tree(par)
    r = lingctl("babel", "sync", str(par / "sub"), str(par), "--delete")
    assert r.returncode == 2
    assert "is inside destination" in one_line_error(r.stderr)
    r = lingctl("babel", "sync", str(par), str(par / "copy"))
    assert r.returncode == 2
    assert "contains destination" in one_line_error(r.stderr)
    r = lingctl("babel", "verify", str(par), str(tmp_path / "x" / ".." / "par"))
    assert r.returncode == 2
    assert "the same tree" in one_line_error(r.stderr)
    assert tree(par) == before and not (par / "copy").exists() and not (par / ".lingctl-babel").exists()


# -- 2. names that merely contain lingctl's temporary marker ----------------------------------------------


def test_user_file_holding_the_temp_marker_is_synced_and_verified(lingctl, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    mine = f"notes{TMP_MARKER}draft.txt"
    write(src, {mine: b"the user's own file", f"d/.x{TMP_MARKER}12345678": b"also the user's", "a.txt": b"a"})
    unfinished = atomic_tmp_path(src / "d" / "model.bin")  # as lingctl's atomic writes name it
    unfinished.write_bytes(b"half-written by a lingctl that died")
    r = lingctl("babel", "sync", str(src), str(dst), "--json")
    assert r.returncode == 0, r.stderr
    assert tree(dst) == {k: v for k, v in tree(src).items() if k != unfinished.relative_to(src).as_posix()}
    assert (dst / mine).read_bytes() == b"the user's own file"
    (dst / mine).write_bytes(b"the user's own filX")  # same size: only the content check can see it
    r = lingctl("babel", "verify", str(src), str(dst), "--mode", "full", "--json")
    assert r.returncode == 4
    assert [d["key"] for d in json.loads(r.stdout)["differences"]] == [mine]


# -- 3. unreadable subdirectories -----------------------------------------------------------------------


def _drop_dac_override() -> None:
    """In the child: give up root's power to read any directory (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so
    mode 000 means unreadable, as for any other user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the bounding set at exec
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_unprivileged(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lingctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_drop_dac_override if os.geteuid() == 0 else None,
    )


def test_unreadable_subdirectories_are_reported_and_the_rest_synced(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    write(src, {"a.txt": b"a", "ok/b.txt": b"b", "locked/secret.txt": b"s", "deep/also-locked/x": b"x"})
    write(dst, {"locked/old.txt": b"must survive --delete", "gone.txt": b"not in the source"})
    locked = [src / "locked", src / "deep" / "also-locked"]
    for d in locked:
        d.chmod(0)
    try:
        r = run_unprivileged("babel", "sync", str(src), str(dst), "--delete", "--json")
        listing = run_unprivileged("babel", "ls", "-R", str(src))
    finally:
        for d in locked:
            d.chmod(0o755)
    assert r.returncode == 1, r.stderr  # permanent until fixed: not 5 ("run again")
    for d in locked:  # one line each on stderr, naming the directory and why
        assert (
            len(
                [
                    line
                    for line in r.stderr.splitlines()
                    if f"{d}: permission denied" in line and not line.startswith(("lingctl: error", "hint"))
                ]
            )
            == 1
        ), r.stderr
    assert "permission denied" in one_line_error(r.stderr)
    result = json.loads(r.stdout)
    assert sorted(f["key"] for f in result["failed"]) == sorted(str(d) for d in locked)
    assert result["copied"] == 2 and result["deleted"] == 0
    assert (dst / "a.txt").read_bytes() == b"a" and (dst / "ok" / "b.txt").read_bytes() == b"b"
    # The listing was incomplete, so nothing was deleted: not what the locked directory may still hold...
    assert (dst / "locked" / "old.txt").read_bytes() == b"must survive --delete"
    assert (dst / "gone.txt").exists()  # ...and not even what is certainly gone
    assert listing.returncode == 1
    assert sorted(line.split()[-1] for line in listing.stdout.splitlines()) == ["a.txt", "ok/b.txt"]
    assert len([line for line in listing.stderr.splitlines() if line.startswith("warning: cannot read")]) == 2
    assert "2 entries could not be listed" in one_line_error(listing.stderr)


def test_a_name_that_is_not_utf8_fails_the_run_and_deletes_nothing(tmp_path: Path, lingctl) -> None:
    """Such a name cannot be a key: it is reported (escaped) with exit 1, never skipped in silence, the rest
    is copied, and --delete deletes nothing because the listing is incomplete."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    write(src, {"a.txt": b"a"})
    write(dst, {"gone.txt": b"not in the source"})
    with open(os.path.join(os.fsencode(src), b"latin1-\xe9.bin"), "wb") as f:
        f.write(b"x")
    r = lingctl("babel", "sync", str(src), str(dst), "--delete", "--json")
    assert r.returncode == 1, r.stderr
    error = one_line_error(r.stderr)
    assert "1 object(s) failed" in error and "latin1-\\udce9.bin" in error and "not valid UTF-8" in error
    assert "Traceback" not in r.stderr
    result = json.loads(r.stdout)
    assert [f["key"] for f in result["failed"]] == [f"{src}/latin1-\\udce9.bin"]
    assert result["copied"] == 1 and result["deleted"] == 0 and (dst / "gone.txt").exists()


# -- 4 and 7. keys from a remote listing: shown escaped, refused as local file names ------------------------


def test_escape_sequences_in_s3_keys_never_reach_the_terminal(lingctl, tmp_path: Path, s3_env, s3_bucket) -> None:
    client = make_client(S3Options(endpoint_url=s3_env["AWS_ENDPOINT_URL"]))
    keys = {"ok.txt": b"fine", ESC_KEY: b"escape", NEWLINE_KEY: b"newline", "bidi\u202etxt.exe": b"rlo"}
    for key, data in keys.items():
        client.put_object(Bucket=s3_bucket, Key=f"in/{key}", Body=data)

    r = lingctl("babel", "ls", "-R", f"s3://{s3_bucket}/in", env=s3_env)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    lines = r.stdout.splitlines()
    assert len(lines) == 4  # one line per key: a newline in a key cannot forge a second one
    assert any(line.endswith("esc\\x1b[2J\\x1b]0;pwned\\x07.txt") for line in lines)
    # A right-to-left override would show "bidiexe.txt": it is shown as an escape.
    assert "\u202e" not in r.stdout and any(line.endswith("bidi\\u202etxt.exe") for line in lines)
    assert any(line.endswith("two\\nlines.txt") for line in lines)
    r = lingctl("babel", "ls", "-R", f"s3://{s3_bucket}/in", "--json", env=s3_env)
    assert sorted(row["key"] for row in json.loads(r.stdout)) == sorted(keys)  # JSON keeps keys exact

    dst = tmp_path / "dst"
    r = lingctl("babel", "sync", f"s3://{s3_bucket}/in", str(dst), env=s3_env)
    assert r.returncode in (1, 4), r.stderr  # refused names are permanent failures, never "retry" (5)
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 2 and all("control characters" in line for line in failed)
    error = one_line_error("\n".join(line for line in r.stderr.splitlines() if line.startswith(("lingctl: e", "hint"))))
    assert "\x1b" not in error
    assert "\u202e" not in r.stdout + r.stderr
    # The refused names created nothing, anywhere; the override is a legal (if sly) file name and is copied.
    assert tree(dst) == {"ok.txt": b"fine", "bidi\u202etxt.exe": b"rlo"}
    assert sorted(os.listdir(tmp_path)) == ["dst"]


# -- 5. credentials in endpoint URLs ---------------------------------------------------------------------


def test_endpoint_password_is_never_shown_and_malformed_endpoints_are_usage_errors(
    lingctl, tmp_path: Path, s3_env
) -> None:
    src = tmp_path / "src"
    write(src, {"a.txt": b"a"})
    dead = f"http://admin:hunter2@127.0.0.1:{free_port()}"
    r = lingctl("babel", "sync", str(src), "s3://bucket/x", "--endpoint-url", dead, "--retries", "1", env=s3_env)
    assert r.returncode == 5
    assert "could not reach S3 endpoint http://127.0.0.1:" in one_line_error(r.stderr)
    assert "hunter2" not in r.stderr + r.stdout and "admin" not in r.stderr + r.stdout
    for bad in ("http://[::1", "http://admin:hunter2@h:99999", "http://admin:hun/ter2@h"):
        r = lingctl("babel", "ls", "s3://bucket", "--endpoint-url", bad, env=s3_env)
        assert r.returncode == 2
        assert "invalid endpoint URL" in one_line_error(r.stderr)
        assert "hunter2" not in r.stderr and "ter2" not in r.stderr


# -- 6. state directories ------------------------------------------------------------------------------


def test_unusable_state_dirs_are_one_line_errors(lingctl, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    write(src, {"a.txt": b"a"})
    (tmp_path / "a-file").write_bytes(b"in the way")
    for state, words in (
        (Path("/proc/lingctl-state"), "cannot create the state directory"),
        (Path("/proc/self"), "cannot write in the state directory"),
        (tmp_path / "a-file" / "state", "state directory"),
    ):
        r = lingctl("babel", "sync", str(src), str(dst), "--state-dir", str(state))
        assert r.returncode == 2, r.stderr
        assert words in one_line_error(r.stderr)
    assert not dst.exists()  # checked before anything was created
    r = lingctl("babel", "sync", str(src), "/proc/lingctl-dst")
    assert r.returncode == 2 and "cannot create the destination directory" in one_line_error(r.stderr)


@pytest.mark.parametrize("how", ["fresh", "readable by others", "open to others", "another user's"])
def test_default_state_dir_in_a_shared_place_must_be_private(tmp_path: Path, monkeypatch, how: str) -> None:
    shared = tmp_path / "shared"  # like /tmp: anyone may create entries
    shared.mkdir()
    shared.chmod(0o1777)
    cache = shared / "cache"
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(cache))
    src, dst = parse_url(str(tmp_path)), parse_url("s3://bucket/prefix")
    if how == "fresh":
        state = prepare(src, dst, None, dry_run=False)
        assert state == state_dir_for(dst, None)
        for d in (cache, cache / "babel", state):
            assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
        return
    cache.mkdir()
    if how == "readable by others":  # mkdir's usual 0755: nobody else can plant entries, so it is used
        cache.chmod(0o755)
        state = prepare(src, dst, None, dry_run=False)
        assert state is not None and state.is_dir() and (state.stat().st_mode & 0o777) == 0o700
        return
    if how == "open to others":
        cache.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another uid needs root")
        cache.chmod(0o700)
        os.chown(cache, OTHER_UID, OTHER_UID)
    with pytest.raises(AccessDeniedError, match="mode 0777" if how == "open to others" else "belongs to uid"):
        prepare(src, dst, None, dry_run=False)
    assert list(cache.iterdir()) == []  # nothing was created in it
