"""The same contract, run against the local store and a real S3 server (rclone serve s3 on 127.0.0.1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lingctl.core.checksum import crc64_bytes
from lingctl.core.errors import NotFoundError, UsageError
from lingctl.core.storage import ObjectStore, S3Options, open_store


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(str(tmp_path / "root"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/some/prefix")


def test_write_stat_read(store: ObjectStore) -> None:
    info = store.write("a/b.bin", b"hello world")
    assert info.size == 11
    assert info.checksum == crc64_bytes(b"hello world").tagged()
    st = store.stat("a/b.bin")
    assert (st.key, st.size) == ("a/b.bin", 11)
    assert st.mtime > 0
    assert store.read("a/b.bin") == b"hello world"
    assert store.read("a/b.bin", 6) == b"world"
    assert store.read("a/b.bin", 2, 3) == b"llo"
    assert store.read("a/b.bin", 0, 0) == b""
    assert store.checksum("a/b.bin") == crc64_bytes(b"hello world").tagged()


def test_overwrite_replaces_content(store: ObjectStore) -> None:
    store.write("k", b"first version, longer")
    store.write("k", b"second")
    assert store.read("k") == b"second"
    assert store.stat("k").size == 6


def test_missing_key_is_not_found(store: ObjectStore) -> None:
    with pytest.raises(NotFoundError):
        store.stat("nope/missing.txt")
    with pytest.raises(NotFoundError):
        store.read("nope/missing.txt")
    assert not store.exists("nope/missing.txt")
    store.delete("nope/missing.txt")  # deleting an absent key is not an error


def test_listing_is_in_key_byte_order(store: ObjectStore) -> None:
    keys = ["a/x", "a-b", "a/y/z", "b", "a.c", "A", "a/y0", "\u00e9t\u00e9"]
    for key in keys:
        store.write(key, key.encode())
    listed = [o.key for o in store.list()]
    assert listed == sorted(keys, key=lambda k: k.encode())
    sizes = {o.key: o.size for o in store.list()}
    assert sizes == {k: len(k.encode()) for k in keys}


def test_prefix_and_directory_listing(store: ObjectStore) -> None:
    for key in ["d/1", "d/2", "d/sub/3", "d/sub/deeper/4", "dx", "e"]:
        store.write(key, b"x")
    assert [o.key for o in store.list("d/")] == ["d/1", "d/2", "d/sub/3", "d/sub/deeper/4"]
    assert [o.key for o in store.list("d")] == ["d/1", "d/2", "d/sub/3", "d/sub/deeper/4", "dx"]
    top = [(o.key, o.is_dir) for o in store.list("", recursive=False)]
    assert top == [("d", True), ("dx", False), ("e", False)]
    inner = [(o.key, o.is_dir) for o in store.list("d", recursive=False)]
    assert inner == [("d/1", False), ("d/2", False), ("d/sub", True)]
    assert list(store.list("nothing-here/")) == []


def test_delete_removes_from_listing(store: ObjectStore) -> None:
    store.write("dir/one", b"1")
    store.write("dir/two", b"2")
    store.delete("dir/one")
    assert [o.key for o in store.list()] == ["dir/two"]
    store.delete("dir/two")
    assert list(store.list()) == []


def test_upload_download_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    payload = os.urandom(3 << 20)
    src.write_bytes(payload)
    info = store.upload("blobs/x.bin", src)
    assert info.size == len(payload)
    assert info.checksum == crc64_bytes(payload).tagged()
    dst = tmp_path / "out" / "x.bin"
    got = store.download("blobs/x.bin", dst)
    assert got.size == len(payload)
    assert dst.read_bytes() == payload
    assert not [p for p in dst.parent.iterdir() if p.name != "x.bin"], "temporary files left behind"


def test_upload_missing_source_is_not_found(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        store.upload("k", tmp_path / "does-not-exist")
    assert list(store.list()) == []


def test_download_missing_key_leaves_destination_untouched(store: ObjectStore, tmp_path: Path) -> None:
    dst = tmp_path / "keep.txt"
    dst.write_text("previous")
    with pytest.raises(NotFoundError):
        store.download("absent", dst)
    assert dst.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "root") == ["keep.txt"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", "dir/"])
def test_keys_cannot_escape_the_root(store: ObjectStore, key: str) -> None:
    with pytest.raises(UsageError):
        store.write(key, b"x")


def test_check_reports_missing_root(tmp_path: Path, s3_server, s3_env) -> None:
    with pytest.raises(NotFoundError):
        open_store(str(tmp_path / "missing")).check()
    with pytest.raises(NotFoundError, match="does not exist"):
        open_store("s3://no-such-bucket-here").check()


@pytest.mark.slow
def test_s3_multipart_upload_round_trip(s3_bucket: str, tmp_path: Path) -> None:
    """Above the threshold the upload goes in parts; the object is whole and its checksum recorded."""
    store = open_store(f"s3://{s3_bucket}/mp", S3Options(multipart_threshold=5 << 20, part_size=5 << 20))
    payload = os.urandom((12 << 20) + 12345)  # three parts, the last one short
    src = tmp_path / "big.bin"
    src.write_bytes(payload)
    info = store.upload("big.bin", src)
    # The ETag recorded is the one listings show (some servers list another than CompleteMultipartUpload returned).
    assert info.etag is not None and [o.etag for o in store.list()] == [info.etag]
    assert store.stat("big.bin").checksum == crc64_bytes(payload).tagged()
    store.download("big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == payload


def test_read_past_the_end_is_empty(store: ObjectStore) -> None:
    store.write("k", b"abc")
    assert store.read("k", 3) == b""
    assert store.read("k", 10, 5) == b""
    assert store.read("k", 1, 100) == b"bc"


def test_local_listing_skips_broken_links_and_prunes(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write("keep/a", b"1")
    store.write("other/b", b"2")
    (tmp_path / "keep" / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "keep" / "loop").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "keep" / "link-to-a").symlink_to(tmp_path / "keep" / "a")
    assert [o.key for o in store.list("keep/")] == ["keep/a", "keep/link-to-a"]
    assert [(o.key, o.is_dir) for o in store.list("keep", recursive=False)] == [
        ("keep/a", False),
        ("keep/link-to-a", False),
    ]


def test_empty_object(store: ObjectStore, tmp_path: Path) -> None:
    info = store.write("empty", b"")
    assert info.size == 0 and store.stat("empty").size == 0
    assert store.read("empty") == b"" and store.read("empty", 0, 10) == b""
    store.download("empty", tmp_path / "empty.out")
    assert (tmp_path / "empty.out").read_bytes() == b""
