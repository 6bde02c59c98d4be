"""The signed HTTP S3 client against a real server (rclone serve s3 on 127.0.0.1) and the fault proxy."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from lingctl.core.checksum import crc64_bytes
from lingctl.core.errors import AccessDeniedError, NotFoundError, RetryableError, UsageError
from lingctl.core.local_s3 import LocalS3Server
from lingctl.core.net import free_port
from lingctl.core.storage.retry import is_throttle
from lingctl.core.storage.s3.client import S3Options, make_client, translate
from lingctl.core.storage.s3.reply import S3ConnectionError, S3HTTPError, as_reply, user_metadata
from lingctl.core.storage.s3.signed_http import SignedS3Client
from tests.support.fault_proxy import FaultProxy, FaultRequest, first_n

DATA = os.urandom(40_000)


@pytest.fixture
def client(s3_server: LocalS3Server, s3_bucket: str) -> Iterator[SignedS3Client]:
    with SignedS3Client(S3Options(endpoint_url=s3_server.endpoint), s3_bucket) as c:
        yield c


def test_put_metadata_and_checksum_are_what_boto3_sees(
    client: SignedS3Client, s3_server: LocalS3Server, s3_bucket: str
) -> None:
    crc = crc64_bytes(DATA).b64()
    meta = {"mtime": "1700000000.25", "color": "blue"}
    put = client.put("dir/obj.bin", DATA, metadata=meta, checksum_crc64nvme_b64=crc)
    head = make_client(S3Options(endpoint_url=s3_server.endpoint)).head_object(
        Bucket=s3_bucket, Key="dir/obj.bin", ChecksumMode="ENABLED"
    )
    assert head["ContentLength"] == len(DATA)
    assert {k.lower(): v for k, v in head["Metadata"].items()} == meta
    assert head["ChecksumCRC64NVME"] == crc
    assert head["ETag"] == put["ETag"]
    # HEAD through the client: the same headers, the metadata under its own names.
    mine = client.head("dir/obj.bin")
    assert mine is not None
    assert int(mine["Content-Length"]) == len(DATA) and mine["etag"] == put["ETag"]
    assert user_metadata(mine) == meta
    # The same fields, in boto3's shape, for the one reply parser.
    reply = as_reply(mine)
    assert {k: reply[k] for k in ("ContentLength", "ETag", "LastModified", "ChecksumCRC64NVME")} == {
        k: head[k] for k in ("ContentLength", "ETag", "LastModified", "ChecksumCRC64NVME")
    }
    assert reply["Metadata"] == meta


def test_get_whole_ranged_and_past_the_end(client: SignedS3Client) -> None:
    client.put("k", DATA, metadata={}, checksum_crc64nvme_b64=None)
    body, headers = client.get("k")
    assert body == DATA and int(headers["Content-Length"]) == len(DATA)
    body, headers = client.get("k", offset=1000, length=5000)
    assert body == DATA[1000:6000]
    assert headers["Content-Range"] == f"bytes 1000-5999/{len(DATA)}"
    assert client.get("k", offset=len(DATA) - 7)[0] == DATA[-7:]
    with pytest.raises(S3HTTPError) as info:
        client.get("k", offset=len(DATA))
    assert (info.value.status, info.value.code) == (416, "InvalidRange")
    assert isinstance(translate(info.value, "b/k", "", 1), UsageError)
    with pytest.raises(ValueError):
        client.get("k", length=0)


def test_if_match_is_sent_and_rclone_ignores_it(s3_server: LocalS3Server, s3_bucket: str) -> None:
    seen: list[str | None] = []

    def record(request: FaultRequest) -> None:
        if request.method == "GET":
            seen.append(request.headers.get("If-Match"))

    with (
        FaultProxy(s3_server.endpoint, rule=record) as proxy,
        SignedS3Client(S3Options(endpoint_url=proxy.endpoint), s3_bucket) as client,
    ):
        etag = client.put("k", DATA, metadata={}, checksum_crc64nvme_b64=None)["ETag"]
        assert client.get("k", if_match=etag)[0] == DATA
        assert client.get("k", if_match=etag.strip('"'))[0] == DATA  # quoted for the caller
        # AWS answers 412 PreconditionFailed here; rclone serve s3 (v1.75) ignores If-Match on GET and
        # sends the object, so callers must still compare the answer's ETag with the one they pinned.
        body, headers = client.get("k", if_match='"0123456789abcdef"')
        assert body == DATA and headers["ETag"] == etag
    assert seen == [etag, etag, '"0123456789abcdef"']


def test_payload_hash_in_the_signature(s3_server: LocalS3Server, s3_bucket: str) -> None:
    sent: list[str | None] = []

    def record(request: FaultRequest) -> None:
        sent.append({k.lower(): v for k, v in request.headers.items()}.get("x-amz-content-sha256"))

    with (
        FaultProxy(s3_server.endpoint, rule=record) as proxy,
        SignedS3Client(S3Options(endpoint_url=proxy.endpoint), s3_bucket) as client,
    ):
        client.put("with-crc", DATA, metadata={}, checksum_crc64nvme_b64=crc64_bytes(DATA).b64())
        client.put("without", DATA, metadata={}, checksum_crc64nvme_b64=None)  # plain http, nothing else
        client.sign_payload = True
        client.put("forced", DATA, metadata={}, checksum_crc64nvme_b64=crc64_bytes(DATA).b64())
        assert client.get("forced")[0] == DATA
    body_sha = hashlib.sha256(DATA).hexdigest()
    assert sent == ["UNSIGNED-PAYLOAD", body_sha, body_sha, hashlib.sha256(b"").hexdigest()]


def test_missing_keys_and_delete(client: SignedS3Client) -> None:
    assert client.head("absent") is None
    with pytest.raises(S3HTTPError) as info:
        client.get("absent")
    assert (info.value.status, info.value.code) == (404, "NoSuchKey")
    assert isinstance(translate(info.value, "b/absent", "", 1), NotFoundError)
    client.put("gone", b"x", metadata={}, checksum_crc64nvme_b64=None)
    assert client.head("gone") is not None
    client.delete("gone")
    assert client.head("gone") is None
    client.delete("gone")  # deleting what is not there succeeds, as on S3


def test_keys_with_spaces_unicode_and_reserved_characters(
    client: SignedS3Client, s3_server: LocalS3Server, s3_bucket: str
) -> None:
    keys = ["with space/a b.bin", "plus+sign", "ünïcødé/日本.txt", "q?&=#%;@!$'()*,"]
    for i, key in enumerate(keys):
        client.put(key, DATA[i : i + 100], metadata={"n": str(i)}, checksum_crc64nvme_b64=None)
    for i, key in enumerate(keys):
        body, headers = client.get(key)
        assert body == DATA[i : i + 100] and user_metadata(headers) == {"n": str(i)}
    listed = make_client(S3Options(endpoint_url=s3_server.endpoint)).list_objects_v2(Bucket=s3_bucket)
    assert sorted(o["Key"] for o in listed["Contents"]) == sorted(keys)


def test_throttle_and_dropped_connections_are_classifiable(s3_server: LocalS3Server, s3_bucket: str) -> None:
    with (
        FaultProxy(s3_server.endpoint, rule=first_n(1)) as proxy,
        SignedS3Client(S3Options(endpoint_url=proxy.endpoint), s3_bucket) as client,
    ):
        with pytest.raises(S3HTTPError) as info:
            client.put("k", DATA, metadata={}, checksum_crc64nvme_b64=None)
        err = info.value
        assert (err.status, err.code, err.message) == (503, "SlowDown", "Please reduce your request rate.")
        assert is_throttle(err)
        assert isinstance(translate(err, f"{s3_bucket}/k", proxy.endpoint, 1), RetryableError)
        assert proxy.stats["requests"] == 1  # one call, one request: no retries inside
        client.put("k", DATA, metadata={}, checksum_crc64nvme_b64=None)  # the connection is still usable
        proxy.set_rule(first_n(1, "reset"))
        with pytest.raises(S3ConnectionError) as dropped:
            client.get("k")
        assert is_throttle(dropped.value)
        assert isinstance(translate(dropped.value, f"{s3_bucket}/k", proxy.endpoint, 1), RetryableError)
        assert client.get("k")[0] == DATA
    refused = SignedS3Client(S3Options(endpoint_url=f"http://127.0.0.1:{free_port()}"), s3_bucket)
    with pytest.raises(S3ConnectionError, match="refused"):
        refused.head("k")


def test_bad_credentials_are_403_with_the_code(
    s3_server: LocalS3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-123")
    client = SignedS3Client(S3Options(endpoint_url=s3_server.endpoint), s3_bucket)
    with pytest.raises(S3HTTPError) as info:
        client.put("k", b"x", metadata={}, checksum_crc64nvme_b64=None)
    assert (info.value.status, info.value.code) == (403, "SignatureDoesNotMatch")
    mapped = translate(info.value, f"{s3_bucket}/k", s3_server.endpoint, 1)
    assert isinstance(mapped, AccessDeniedError)
    assert "wrong-secret-value-123" not in f"{info.value} {mapped} {mapped.hint}"
    with pytest.raises(S3HTTPError) as head:  # HEAD answers carry no body: the status is the code
        client.head("k")
    assert (head.value.status, head.value.code) == (403, "403")
    anonymous = SignedS3Client(S3Options(endpoint_url=s3_server.endpoint), s3_bucket, unsigned=True)
    with pytest.raises(S3HTTPError) as unsigned:  # no Authorization header at all
        anonymous.get("k")
    # A private bucket refuses anonymous reads: AWS with 403 AccessDenied, rclone serve s3 (v1.75) with
    # 400 UnsupportedAlgorithm.
    assert 400 <= unsigned.value.status < 500
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(AccessDeniedError, match="no S3 credentials"):
        SignedS3Client(S3Options(endpoint_url=s3_server.endpoint), s3_bucket)


def test_one_client_many_threads(client: SignedS3Client) -> None:
    def round_trip(i: int) -> bool:
        body = DATA[i : i + 1000 + i]
        client.put(f"t/{i}", body, metadata={"i": str(i)}, checksum_crc64nvme_b64=crc64_bytes(body).b64())
        got, headers = client.get(f"t/{i}")
        return got == body and user_metadata(headers) == {"i": str(i)}

    client.put("t/first", b"", metadata={}, checksum_crc64nvme_b64=None)  # the directory, made once
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(round_trip, range(64)))


def test_addressing(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    opts = S3Options(endpoint_url="http://127.0.0.1:9000", region="eu-west-1")
    assert SignedS3Client(opts, "bkt").url("a b/c+d") == "http://127.0.0.1:9000/bkt/a%20b/c%2Bd"
    virtual = SignedS3Client(S3Options(endpoint_url="https://s3.example.com/base", path_style=False), "bkt")
    assert virtual.url("k") == "https://bkt.s3.example.com/base/k"
    # Names that cannot be a DNS label go path style even when virtual hosts are asked for.
    dotted = SignedS3Client(S3Options(endpoint_url="https://s3.example.com", path_style=False), "my.bkt")
    assert dotted.url("k") == "https://s3.example.com/my.bkt/k"
    assert SignedS3Client(S3Options(), "bkt").region == s3_env["AWS_DEFAULT_REGION"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # AWS itself: virtual hosts under the region's endpoint
    aws = SignedS3Client(S3Options(region="eu-west-1"), "bkt", unsigned=True)
    assert aws.url("k") == "https://bkt.s3.eu-west-1.amazonaws.com/k"


def test_multipart_upload_complete_abort_and_a_wrong_part_digest(
    client: SignedS3Client, s3_server: LocalS3Server, s3_bucket: str
) -> None:
    import base64

    part1, part2 = os.urandom(5 << 20), os.urandom(1000)
    md5 = base64.b64encode(hashlib.md5(part1).digest()).decode()
    refused_id = client.create_multipart("mp/refused", metadata={})
    with pytest.raises(S3HTTPError) as refused:  # the digest of other bytes: the server refuses the part
        client.upload_part("mp/refused", refused_id, 1, part2, content_md5_b64=md5)
    assert refused.value.status == 400 and refused.value.code == "BadDigest"
    # (rclone serve s3 then forgets that upload: babel's copy starts a new one, UploadGoneError.)
    upload_id = client.create_multipart("mp/obj", metadata={"mtime": "12.5"})
    tags = [
        (1, client.upload_part("mp/obj", upload_id, 1, part1, content_md5_b64=md5)),
        (2, client.upload_part("mp/obj", upload_id, 2, part2)),
    ]
    assert tags[1][1] == hashlib.md5(part2).hexdigest()
    assert client.complete_multipart("mp/obj", upload_id, tags)
    body, headers = client.get("mp/obj")
    assert body == part1 + part2 and user_metadata(headers) == {"mtime": "12.5"}
    # An aborted upload leaves no object; the id is then unknown to the server.
    gone = client.create_multipart("mp/aborted", metadata={})
    client.upload_part("mp/aborted", gone, 1, part2)
    client.abort_multipart("mp/aborted", gone)
    assert client.head("mp/aborted") is None
    with pytest.raises(S3HTTPError) as unknown:
        client.upload_part("mp/aborted", gone, 2, part2)
    assert unknown.value.code == "NoSuchUpload" or unknown.value.status == 404
