"""list_tree on real trees: a local directory, and a bucket on the rclone S3 server compared with boto3's own
paginator (the reference for what S3 holds)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import cast

import pytest

from lingctl.babel.listing import Listed, ListStats, list_tree
from lingctl.core.atomic import TMP_MARKER
from lingctl.core.atomic import tmp_path as atomic_tmp_path
from lingctl.core.errors import AccessDeniedError, NotFoundError, RetryableError, UsageError
from lingctl.core.local_s3 import LocalS3Server
from lingctl.core.net import free_port
from lingctl.core.storage import S3Options
from lingctl.core.storage.s3 import listing as s3_listing
from lingctl.core.storage.s3.store import make_client
from tests.support.fault_proxy import Fault, FaultProxy, every_nth_once, first_n

# Every character the lister places range boundaries at, but "/" (a directory on the server's disk).
ALPHABET = "-.0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz~"


def collect(batches: Iterable[list[Listed]]) -> dict[str, Listed]:
    out: dict[str, Listed] = {}
    for batch in batches:
        for entry in batch:
            assert entry.key not in out, f"listed twice: {entry.key!r}"
            out[entry.key] = entry
    return out


# -- local ------------------------------------------------------------------------------------------------


@pytest.fixture
def local_tree(tmp_path: Path) -> tuple[Path, dict[str, os.stat_result]]:
    """~300 files in nested directories plus everything a listing must leave out; returns the expected stats."""
    root = tmp_path / "src"
    expected: dict[str, os.stat_result] = {}
    dirs = ["", "a", "a/b", "a/b/c", "d", "e f", "ünï", "deep/1/2/3/4"]
    n = 0
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
        for i in range(38):
            key = f"{d}/f{i:03d}.bin" if d else f"f{i:03d}.bin"
            path = root / key
            path.write_bytes(b"x" * ((n * 37) % 101))
            # Distinct, sub-second mtimes, so the comparison below checks they come through exactly.
            os.utime(path, ns=(1_700_000_000_000_000_000 + n * 1_234_567, 1_700_000_000_000_000_000 + n * 1_234_567))
            expected[key] = path.stat()
            n += 1
    (root / ".lingctl-babel" / "inner").mkdir(parents=True)
    (root / ".lingctl-babel" / "journal").write_bytes(b"state")
    (root / "a" / ".lingctl-babel").mkdir()  # skipped at any depth
    (root / "a" / ".lingctl-babel" / "x").write_bytes(b"state")
    atomic_tmp_path(root / "a" / "f001.bin").write_bytes(b"half-written")  # an unfinished write: left out
    user_file = root / "a" / f"notes{TMP_MARKER}keep.txt"  # merely holds the marker: a user's file like any other
    user_file.write_bytes(b"mine")
    expected[f"a/notes{TMP_MARKER}keep.txt"] = user_file.stat()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"secret")
    (root / "link-in").symlink_to(root / "a" / "f001.bin")
    expected["link-in"] = (root / "a" / "f001.bin").stat()
    (root / "d" / "link-rel").symlink_to("../e f/f002.bin")
    expected["d/link-rel"] = (root / "e f" / "f002.bin").stat()
    (root / "link-out").symlink_to(outside)
    (root / "link-dir").symlink_to(root / "a", target_is_directory=True)
    (root / "link-broken").symlink_to(root / "absent")
    return root, expected


@pytest.mark.parametrize("jobs", [1, 8])
def test_local_tree_lists_every_file_once_with_exact_stats(
    local_tree, jobs: int, caplog: pytest.LogCaptureFixture
) -> None:
    root, expected = local_tree
    stats = ListStats()
    with caplog.at_level(logging.WARNING, logger="lingctl.babel.listing"):
        got = collect(list_tree(str(root), jobs=jobs, stats=stats, skip_dirs=frozenset({".lingctl-babel"})))
    assert sorted(got) == sorted(expected)
    for key, st in expected.items():
        assert (got[key].size, got[key].mtime) == (st.st_size, st.st_mtime), key
    assert stats.objects == len(expected)
    assert stats.requests == 12  # directories scanned: 7 with files, deep/ and its 4 nested levels
    warned = caplog.text
    assert warned.count("link-out") == 1 and "outside" in warned
    assert "link-dir" in warned and "link-broken" in warned


def test_local_without_skip_dirs_lists_state_files(local_tree) -> None:
    root, expected = local_tree
    got = collect(list_tree(root.as_posix(), jobs=4))
    assert set(got) - set(expected) == {".lingctl-babel/journal", "a/.lingctl-babel/x"}


def test_local_root_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        list_tree(str(tmp_path / "absent"))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        list_tree(str(tmp_path / "file"))
    with pytest.raises(UsageError, match="jobs"):
        list_tree(str(tmp_path), jobs=0)
    assert collect(list_tree(str(tmp_path))).keys() == {"file"}


def test_batches_stream_while_listing_goes_on(local_tree) -> None:
    root, expected = local_tree
    stats = ListStats()
    it = list_tree(str(root), jobs=1, stats=stats, skip_dirs=frozenset({".lingctl-babel"}))
    first = next(it)
    time.sleep(0.2)  # give the worker time to run ahead as far as it may
    # One batch per directory here; the worker stops a few batches ahead of the consumer.
    assert first and stats.requests < 12
    assert len(collect([first, *it])) == len(expected)
    assert stats.requests == 12


def test_stopping_early_releases_the_workers(local_tree) -> None:
    root, _ = local_tree
    before = threading.active_count()
    it = cast(Generator[list[Listed], None, None], list_tree(str(root), jobs=8))  # list_tree's is a generator
    assert next(it)
    it.close()
    assert threading.active_count() == before


def test_abandoned_listing_does_not_block_exit(local_tree) -> None:
    root, _ = local_tree
    # The generator stays suspended (a global holds it) with its workers blocked on a full queue.
    code = f"import sys; from lingctl.babel.listing import list_tree\nit = list_tree({str(root)!r}, jobs=1)\nnext(it)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


# -- S3 ---------------------------------------------------------------------------------------------------

WEIRD_KEYS = [
    "weird/with space.txt",
    "weird/plus+sign",
    "weird/percent%20literal",
    "weird/amp&er&sand",
    "weird/ünïcödé/日本語.bin",
    "weird/a b/c d/e+f",
    "weird/tilde~x",
    "weird/quote'and\"dq",
    "weird/lt<gt>",
    "weird/question?mark",
    "weird/hash#tag",
    "weird/semi;colon=eq",
]


def flat_keys() -> list[str]:
    """~6,200 keys under flat/: every boundary character as a first character, keys that equal split
    boundaries exactly ("flat/a", "flat/xQ"), one dense first character (x) that needs a second split, and a
    numbered subdirectory (flat/m/) that needs splits at digit positions."""
    keys = []
    for c in ALPHABET:
        if c not in "m.":  # flat/m is a directory; "flat/." cannot be a file
            keys.append(f"flat/{c}")
        keys += [f"flat/{c}{i:02d}" for i in range(30)]
        keys.append(f"flat/x{c}")
        keys += [f"flat/x{c}{i:02d}" for i in range(40)]
    keys += [f"flat/m/{i:05d}" for i in range(1500)]
    keys += ["flat/m-1", "flat/m.2"]  # '-' and '.' sort before '/': around the common prefix flat/m/
    return keys


NESTED_KEYS = (
    [f"nested/a/b/c/f{i}" for i in range(5)]
    + [f"nested/x{i}" for i in range(10)]
    + ["nested/sp ace+dir/é/f", "nested/a/top", ".lingctl-babel/journal", "nested/.lingctl-babel/j"]
)


@pytest.fixture(scope="module")
def tree_bucket(s3_server: LocalS3Server) -> Iterator[str]:
    """One bucket for the module: flat/ written straight into the server's directory (thousands of PUTs
    would take most of the test's time), the rest uploaded through boto3."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env().items():
            mp.setenv(key, value)
        client = make_client(S3Options(endpoint_url=s3_server.endpoint))
        name = f"list-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=name)
        # rclone caches a directory's listing for minutes once read; nothing has listed this bucket yet,
        # so files written behind its back now are seen.
        for key in flat_keys():
            path = s3_server.root / name / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"z" * (len(key) % 13))
        for key in WEIRD_KEYS + NESTED_KEYS:
            client.put_object(Bucket=name, Key=key, Body=key.encode())
        yield name


_references: dict[str, dict[str, tuple[int, float, str]]] = {}


def reference(bucket: str) -> dict[str, tuple[int, float, str]]:
    """What boto3's paginator lists in ``bucket``: key -> (size, mtime, etag)."""
    if bucket not in _references:
        client = make_client(S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
        _references[bucket] = {
            o["Key"]: (o["Size"], o["LastModified"].timestamp(), o["ETag"].strip('"'))
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", ())
        }
    return _references[bucket]


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 16])
def test_s3_bucket_listing_equals_paginator(tree_bucket: str, s3_env, jobs: int) -> None:
    stats = ListStats()
    got = collect(list_tree(f"s3://{tree_bucket}", jobs=jobs, stats=stats))
    want = reference(tree_bucket)
    assert set(want) == set(flat_keys() + WEIRD_KEYS + NESTED_KEYS)
    assert {k: (e.size, e.mtime, e.etag) for k, e in got.items()} == want
    assert stats.objects == len(want) and stats.retries == 0


@pytest.mark.slow
@pytest.mark.parametrize("forced", [False, True], ids=["adaptive", "forced"])
def test_s3_flat_prefix_lists_in_parallel_ranges(
    tree_bucket: str, s3_env, forced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if forced:
        # Split at full width whatever the measured gain, so every boundary case below is met.
        monkeypatch.setattr(s3_listing, "_MIN_GAIN", 0.0)
        monkeypatch.setattr(s3_listing, "_FIRST_SPLIT", 64)
    stats = ListStats()
    got = collect(list_tree(f"s3://{tree_bucket}/flat", jobs=16, stats=stats))
    assert set(got) == {k.removeprefix("flat/") for k in flat_keys()}
    # Page by page this takes 7 requests: 5 for flat/ and 2 for flat/m/. More means ranges were listed.
    assert stats.requests > (40 if forced else 7)


@pytest.mark.slow
def test_s3_sub_prefix_gives_relative_keys_and_skips_state_dirs(tree_bucket: str, s3_env) -> None:
    got = collect(list_tree(f"s3://{tree_bucket}/nested/", skip_dirs=frozenset({".lingctl-babel"})))
    assert set(got) == {k.removeprefix("nested/") for k in NESTED_KEYS if k.startswith("nested/")} - {
        ".lingctl-babel/j"
    }
    assert got["sp ace+dir/é/f"].size == len("nested/sp ace+dir/é/f".encode())
    weird = collect(list_tree(f"s3://{tree_bucket}/weird", S3Options(endpoint_url=os.environ["AWS_ENDPOINT_URL"])))
    assert set(weird) == {k.removeprefix("weird/") for k in WEIRD_KEYS}
    assert collect(list_tree(f"s3://{tree_bucket}/absent-prefix")) == {}


@pytest.mark.slow
def test_s3_stopping_early_releases_the_workers(tree_bucket: str, s3_env) -> None:
    before = threading.active_count()
    it = cast(Generator[list[Listed], None, None], list_tree(f"s3://{tree_bucket}", jobs=8))
    assert next(it)
    it.close()
    assert threading.active_count() == before


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["503", "reset"])
def test_s3_transient_faults_are_retried(tree_bucket: str, s3_env, s3_server: LocalS3Server, fault: Fault) -> None:
    with FaultProxy(s3_server.endpoint, rule=every_nth_once(3, fault)) as proxy:
        stats = ListStats()
        got = collect(list_tree(f"s3://{tree_bucket}", S3Options(endpoint_url=proxy.endpoint), stats=stats))
    assert {k: (e.size, e.mtime, e.etag) for k, e in got.items()} == reference(tree_bucket)
    distinct = stats.requests - stats.retries
    assert stats.retries == distinct // 3 > 0  # every third request failed once and was sent again


@pytest.mark.slow
def test_s3_throttling_that_persists_is_retryable_exhausted(tree_bucket: str, s3_env, s3_server: LocalS3Server) -> None:
    stats = ListStats()
    with (
        FaultProxy(s3_server.endpoint, rule=first_n(1000)) as proxy,
        pytest.raises(RetryableError, match="after 5 attempt.*SlowDown") as info,
    ):
        collect(list_tree(f"s3://{tree_bucket}", S3Options(endpoint_url=proxy.endpoint, max_attempts=2), stats=stats))
    assert info.value.exit_code == 5
    assert (stats.requests, stats.retries) == (5, 4)


@pytest.mark.slow
def test_s3_missing_bucket_is_not_found(s3_env) -> None:
    with pytest.raises(NotFoundError, match="absent-bucket") as info:
        collect(list_tree("s3://absent-bucket/x"))
    assert info.value.exit_code == 3


@pytest.mark.slow
def test_s3_wrong_secret_is_access_denied(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-123")
    stats = ListStats()
    with pytest.raises(AccessDeniedError) as info:
        collect(list_tree(f"s3://{s3_bucket}", stats=stats))
    assert info.value.exit_code == 1
    assert "wrong-secret-value-123" not in f"{info.value} {info.value.hint}"
    assert stats.requests == 1  # not retried


def test_s3_no_credentials_fails_before_listing(s3_server: LocalS3Server) -> None:
    with pytest.raises(AccessDeniedError, match="no S3 credentials"):
        list_tree("s3://somebucket", S3Options(endpoint_url=s3_server.endpoint))


def test_s3_unreachable_endpoint_is_retryable_and_quick(s3_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    stats = ListStats()
    start = time.monotonic()
    with pytest.raises(RetryableError, match="after 5 attempt") as info:
        collect(list_tree("s3://bucket", S3Options(max_attempts=1, connect_timeout=1), stats=stats))
    assert info.value.exit_code == 5
    assert (stats.requests, stats.retries) == (5, 4)
    assert time.monotonic() - start < 5
