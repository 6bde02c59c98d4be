from __future__ import annotations

from pathlib import Path

import pytest

from lingctl.core.errors import UsageError
from lingctl.core.storage import StoreURL, parse_url


@pytest.mark.parametrize("text, expected", [
    ("s3://bucket", StoreURL("s3", "bucket", "")),
    ("s3://bucket/", StoreURL("s3", "bucket", "")),
    ("s3://bucket/a/b/", StoreURL("s3", "bucket", "a/b")),
    ("S3://my.bucket-1/x", StoreURL("s3", "my.bucket-1", "x")),
    ("/data/set", StoreURL("file", prefix="/data/set")),
    ("file:///data/set", StoreURL("file", prefix="/data/set")),
    ("relative/dir", StoreURL("file", prefix="relative/dir")),
])
def test_parse(text: str, expected: StoreURL) -> None:
    assert parse_url(text) == expected


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("s3://", "no bucket"),
    ("s3:///key", "no bucket"),
    ("s3://ab", "invalid bucket"),
    ("s3://bad!bucket/x", "invalid bucket"),
    ("s3://-bucket", "invalid bucket"),
    ("s3://bucket/a//b", "empty path segment"),
    ("gs://bucket/x", "unsupported URL scheme 'gs'"),
    ("http://host/x", "unsupported URL scheme 'http'"),
    ("file://", "no path"),
])
def test_bad_urls_are_usage_errors(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        parse_url(text)
    assert info.value.exit_code == 2


def test_join_and_str() -> None:
    root = parse_url("s3://bucket/pre")
    assert str(root.join("a/b")) == "s3://bucket/pre/a/b"
    assert str(parse_url("s3://bucket").join("k")) == "s3://bucket/k"
    assert parse_url("/tmp/x").join("y").path == Path("/tmp/x/y")
    with pytest.raises(ValueError):
        root.path  # noqa: B018
