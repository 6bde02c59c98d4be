"""S3 failures become the documented error kinds, without secrets in the messages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lingctl.core.errors import AccessDeniedError, NotFoundError, RetryableError, UsageError, VerificationError
from lingctl.core.net import free_port
from lingctl.core.storage import S3Options, open_store


def test_missing_bucket_is_not_found(s3_env) -> None:
    store = open_store("s3://absent-bucket/x")
    with pytest.raises(NotFoundError, match="absent-bucket"):
        store.write("k", b"x")
    with pytest.raises(NotFoundError):
        list(store.list())


def test_wrong_secret_is_access_denied_and_not_echoed(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-123")
    store = open_store(f"s3://{s3_bucket}")
    with pytest.raises(AccessDeniedError) as info:
        store.write("k", b"x")
    assert "wrong-secret-value-123" not in str(info.value) + str(info.value.hint)
    assert info.value.exit_code == 1


def test_no_credentials_is_access_denied(s3_server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    with pytest.raises(AccessDeniedError, match="no S3 credentials"):
        open_store("s3://somebucket").check()


def test_unreachable_endpoint_is_retryable_exhausted(s3_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    store = open_store("s3://bucket", S3Options(max_attempts=2, connect_timeout=2))
    with pytest.raises(RetryableError, match="after 2 attempt") as info:
        store.check()
    assert info.value.exit_code == 5


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "ftp://host", "http://", "http://host:notaport"])
def test_bad_endpoint_url_is_usage_error(s3_env, endpoint: str) -> None:
    with pytest.raises(UsageError):
        open_store("s3://bucket", S3Options(endpoint_url=endpoint)).check()


def test_damaged_object_fails_download_and_keeps_destination(s3_bucket: str, s3_server, tmp_path: Path) -> None:
    store = open_store(f"s3://{s3_bucket}/data")
    store.write("obj.bin", b"A" * 4096)
    # Bit rot at rest: the server keeps objects as plain files; change bytes in place, keeping size and
    # mtime (the server forgets an object's metadata when its mtime changes behind its back).
    stored = s3_server.root / s3_bucket / "data" / "obj.bin"
    before = stored.stat()
    with open(stored, "r+b") as f:
        f.seek(2048)
        f.write(b"B" * 2048)
    os.utime(stored, ns=(before.st_atime_ns, before.st_mtime_ns))
    dst = tmp_path / "obj.bin"
    dst.write_bytes(b"old")
    with pytest.raises(VerificationError, match="checksum mismatch"):
        store.download("obj.bin", dst)
    assert dst.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["obj.bin"]
