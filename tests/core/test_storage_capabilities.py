"""The store interface beyond plain reads and writes, on the local store and a real S3 server: recorded mtimes
(lingctl's and rclone's metadata keys), HEAD parsing, pinned reads, one-key versions, multipart uploads
(including an upload continued by another store object, as a re-run does) and the retry policy."""

from __future__ import annotations

import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import cast

import pytest

from lingctl.core.atomic import TMP_MARKER
from lingctl.core.checksum import crc64_bytes
from lingctl.core.errors import NotFoundError, RetryableError
from lingctl.core.storage import ObjectStore, S3Options, SourceChangedError, UploadGoneError, open_store
from lingctl.core.storage.metadata import object_metadata, parse_reply, rclone_time
from lingctl.core.storage.retry import THROTTLE_CODES, Aimd
from lingctl.core.storage.s3.client import translate
from lingctl.core.storage.s3.store import S3Store, make_client
from tests.support.fault_proxy import FaultProxy, FaultRequest, first_n

MiB = 1 << 20
MTIME = 1_600_000_000.25
MTIME_NS = 1_600_000_000_123_456_789


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(str(tmp_path / "root"))
    return open_store(f"s3://{request.getfixturevalue('s3_bucket')}/caps")


def _temp_files(store: ObjectStore) -> list[str]:
    root = store.local_root
    return [] if root is None or not root.exists() else [p.name for p in root.rglob("*") if TMP_MARKER in p.name]


def test_write_records_the_source_mtime_and_head_reads_it(store: ObjectStore) -> None:
    info = store.write("d/a.bin", b"payload", mtime=MTIME)
    assert info.checksum == crc64_bytes(b"payload").tagged()
    head = store.head("d/a.bin")
    assert head is not None and (head.size, head.mtime) == (7, MTIME)
    assert head.checksum == (crc64_bytes(b"payload").tagged() if store.records_checksums else None)
    assert store.head("d/missing") is None and store.version("d/missing") is None
    listed = {o.key: o for o in store.list()}
    assert (listed["d/a.bin"].mtime == MTIME) is store.keeps_mtime  # S3 listings show LastModified
    version = store.version("d/a.bin")
    assert version is not None and version.size == 7 and version.etag == listed["d/a.bin"].etag


def test_mtime_to_the_nanosecond(store: ObjectStore, s3_env: dict[str, str]) -> None:
    store.write("ns.bin", b"x", mtime=MTIME_NS / 1e9, mtime_ns=MTIME_NS)
    if store.local_root is not None:
        assert (store.local_root / "ns.bin").stat().st_mtime_ns == MTIME_NS
        assert store.mtime_ns("ns.bin") == MTIME_NS
        return
    assert store.mtime_ns("ns.bin") is None
    client = make_client(S3Options())
    meta = client.head_object(Bucket=store.url.bucket, Key="caps/ns.bin")["Metadata"]
    # rclone's own key and format (seconds, nine decimals), beside lingctl's.
    assert {k.lower(): v for k, v in meta.items()}["mtime"] == "1600000000.123456789"
    assert "lingctl-mtime" in {k.lower() for k in meta}


def test_head_prefers_lingctl_mtime_then_rclones_then_last_modified(s3_bucket: str) -> None:
    client = make_client(S3Options())
    client.put_object(Bucket=s3_bucket, Key="h/rclone", Body=b"r", Metadata={"mtime": "1500000000.500000000"})
    client.put_object(Bucket=s3_bucket, Key="h/plain", Body=b"p")
    client.put_object(
        Bucket=s3_bucket, Key="h/both", Body=b"b", Metadata=object_metadata(mtime=MTIME) | {"mtime": "1.0"}
    )
    store = open_store(f"s3://{s3_bucket}/h")
    heads = {k: store.head(k) for k in ("rclone", "plain", "both")}
    assert heads["rclone"] is not None and heads["rclone"].mtime == 1_500_000_000.5
    assert heads["both"] is not None and heads["both"].mtime == MTIME
    listed = {o.key: o.mtime for o in store.list()}
    assert heads["plain"] is not None and abs(heads["plain"].mtime - listed["plain"]) < 1.0


def test_reply_parser_and_rclone_format() -> None:
    modified = datetime(2024, 1, 2, tzinfo=timezone.utc)
    base = {"ContentLength": 3, "LastModified": modified, "ETag": '"abc"'}
    assert parse_reply("k", base).mtime == modified.timestamp() and parse_reply("k", base).etag == "abc"
    assert parse_reply("k", {**base, "Metadata": {"Mtime": "12.5"}}).mtime == 12.5  # a server keeping case
    assert parse_reply("k", {**base, "Metadata": {"mtime": "garbage"}}).mtime == modified.timestamp()
    assert parse_reply("k", {**base, "ChecksumCRC64NVME": "AAAAAAAAAAE=", "ChecksumType": "COMPOSITE"}).checksum is None
    assert rclone_time(1.5) == "1.500000000" and rclone_time(0.0, 7) == "0.000000007"


def test_pinned_read_notices_an_overwrite(store: ObjectStore) -> None:
    store.write("p.bin", b"A" * 100, mtime=MTIME)
    pin = store.version("p.bin")
    assert pin is not None and store.read("p.bin", 10, 5, pin=pin) == b"AAAAA"
    store.write("p.bin", b"B" * 120, mtime=MTIME + 1)
    with pytest.raises(SourceChangedError):
        store.read("p.bin", 10, 5, pin=pin)
    store.delete("p.bin")
    with pytest.raises(SourceChangedError):
        store.read("p.bin", pin=pin)


def test_multipart_parts_in_any_order_then_complete(store: ObjectStore) -> None:
    uploads = store.multipart
    assert uploads is not None
    part = 5 * MiB
    data = os.urandom(2 * part + 1234)
    crc = crc64_bytes(data).tagged()
    upload_id = uploads.create("big/obj.bin", len(data), mtime=MTIME, crc=crc)
    tags = {
        n: uploads.put_part("big/obj.bin", upload_id, n, (n - 1) * part, data[(n - 1) * part : n * part])
        for n in (3, 1, 2)
    }
    assert not store.exists("big/obj.bin")  # nothing is visible before completion
    done = uploads.complete("big/obj.bin", upload_id, sorted(tags.items()), mtime=MTIME)
    assert store.read("big/obj.bin") == data and store.read("big/obj.bin", part - 2, 4) == data[part - 2 : part + 2]
    head = store.head("big/obj.bin")
    listed = {o.key: o for o in store.list()}
    assert head is not None and head.mtime == MTIME and done.etag == listed["big/obj.bin"].etag
    assert head.checksum == (crc if store.records_checksums else None)
    assert _temp_files(store) == []


def test_multipart_abort_leaves_nothing(store: ObjectStore) -> None:
    uploads = store.multipart
    assert uploads is not None
    upload_id = uploads.create("gone.bin", 6 * MiB)
    uploads.put_part("gone.bin", upload_id, 1, 0, b"x" * (5 * MiB))
    uploads.abort("gone.bin", upload_id)
    uploads.abort("gone.bin", upload_id)  # aborting one that is gone is not an error
    assert not store.exists("gone.bin") and _temp_files(store) == []
    if uploads.resumable:
        with pytest.raises(UploadGoneError):
            uploads.put_part("gone.bin", upload_id, 2, 5 * MiB, b"y")


def test_s3_multipart_upload_continues_in_another_store_object(s3_bucket: str) -> None:
    """A re-run opens a new store and sends only the missing parts under the same upload id."""
    first = open_store(f"s3://{s3_bucket}/resume")
    assert first.multipart is not None and first.multipart.resumable
    data = os.urandom(5 * MiB + 77)
    upload_id = first.multipart.create("r.bin", len(data), mtime=MTIME)
    tag1 = first.multipart.put_part("r.bin", upload_id, 1, 0, data[: 5 * MiB])
    second = open_store(f"s3://{s3_bucket}/resume")
    assert second.multipart is not None
    tag2 = second.multipart.put_part("r.bin", upload_id, 2, 5 * MiB, data[5 * MiB :])
    second.multipart.complete("r.bin", upload_id, [(1, tag1), (2, tag2)])
    assert second.read("r.bin") == data


def test_throttling_lowers_concurrency_and_is_retried(s3_server, s3_bucket: str, s3_env) -> None:
    store = open_store(f"s3://{s3_bucket}/t")
    store.write("k", b"v")
    with FaultProxy(s3_server.endpoint, rule=first_n(2, "503")) as proxy:
        gate = Aimd(8, cooldown_s=0.0)
        throttled = cast(
            S3Store,
            open_store(f"s3://{s3_bucket}/t", S3Options(endpoint_url=proxy.endpoint, max_attempts=4), gate=gate),
        )
        assert throttled.read("k") == b"v"
    assert throttled.retrier.counters.throttled == 2 and throttled.retrier.counters.retries == 2
    assert gate.lowest == 2  # halved on each of the two SlowDowns: 8 -> 4 -> 2


def test_not_found_is_not_retried_and_not_guessed_from_text(s3_server, s3_bucket: str, s3_env) -> None:
    seen: list[str] = []
    lock = threading.Lock()

    def count(r: FaultRequest) -> None:
        with lock:
            seen.append(r.method)

    with FaultProxy(s3_server.endpoint, rule=count) as proxy:
        store = open_store(f"s3://{s3_bucket}/t", S3Options(endpoint_url=proxy.endpoint, max_attempts=5))
        assert store.head("absent") is None
        with pytest.raises(NotFoundError):
            store.read("absent")
    assert seen == ["HEAD", "GET"]  # one request each: a 404 is an answer, not a failure to retry


def test_translate_and_retrier_share_the_throttle_codes() -> None:
    import botocore.exceptions

    for code in sorted(THROTTLE_CODES):
        exc = botocore.exceptions.ClientError(
            {"Error": {"Code": code, "Message": "404 in the text"}, "ResponseMetadata": {"HTTPStatusCode": 400}},
            "GetObject",
        )
        assert isinstance(translate(exc, "b/k", "", 1), RetryableError), code
    text_only = botocore.exceptions.ClientError(
        {"Error": {"Code": "Weird", "Message": "404 Not Found"}, "ResponseMetadata": {"HTTPStatusCode": 400}},
        "GetObject",
    )
    assert not isinstance(translate(text_only, "b/k", "", 1), NotFoundError)
