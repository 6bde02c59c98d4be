from __future__ import annotations

from pathlib import Path

import pytest

from lingctl.core.errors import UsageError
from lingctl.core.storage import StoreURL, check_key, parse_url
from lingctl.core.storage.url import add_secret, check_endpoint_url, redact_secrets, redact_url, server_words


@pytest.mark.parametrize(
    "text, expected",
    [
        ("s3://bucket", StoreURL("s3", "bucket", "")),
        ("s3://bucket/", StoreURL("s3", "bucket", "")),
        ("s3://bucket/a/b/", StoreURL("s3", "bucket", "a/b")),
        ("S3://my.bucket-1/x", StoreURL("s3", "my.bucket-1", "x")),
        ("/data/set", StoreURL("file", prefix="/data/set")),
        ("file:///data/set", StoreURL("file", prefix="/data/set")),
        ("relative/dir", StoreURL("file", prefix="relative/dir")),
    ],
)
def test_parse(text: str, expected: StoreURL) -> None:
    assert parse_url(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
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
    ],
)
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


# -- keys -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["a", "dir/file", "with space+plus", "ünï/日本語", "a..b"])
def test_check_key_accepts_relative_names(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key, reason",
    [
        ("", "not a file name"),
        ("/abs", "absolute"),
        ("a/", "segment"),
        ("a//b", "segment"),
        ("../x", "segment"),
        ("a/./b", "segment"),
        ("nul\x00", "control"),
        ("esc\x1b[31m", "control"),
        ("new\nline", "control"),
        ("x" * 256, "too long"),
    ],
)
def test_check_key_follows_the_shared_name_rules_as_usage_errors(key: str, reason: str) -> None:
    with pytest.raises(UsageError, match=reason) as info:
        check_key(key)
    assert info.value.exit_code == 2
    assert info.value.message.startswith("invalid object key")
    assert "\x1b" not in info.value.message and "\n" not in info.value.message


# -- endpoints and redaction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, shown",
    [
        ("http://user:hunter2@127.0.0.1:9000", "http://***@127.0.0.1:9000"),
        ("https://AKIA:se/cr@t@host/path", "https://***@host/path"),  # '/' and '@' inside the password
        (
            "could not reach http://u:hunter2@h:1 (x); also https://h2?token=hunter2&b=1",
            "could not reach http://***@h:1 (x); also https://h2?token=***&b=1",
        ),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=hunter2&X-Amz-Security-Token=t",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***",
        ),
        ("s3://bucket/mail@example.com/x", "s3://bucket/mail@example.com/x"),  # an '@' in a key is not a secret
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("http://h/\x1b[2Jx\n", "http://h/\\x1b[2Jx\\n"),
    ],
)
def test_redact_url(text: str, shown: str) -> None:
    assert redact_url(text) == shown
    assert "hunter2" not in redact_url(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("http://127.0.0.1:9000/", "http://127.0.0.1:9000"),
        ("https://s3.example.com", "https://s3.example.com"),
        ("http://[::1]:9000", "http://[::1]:9000"),
        ("http://user:hunter2@127.0.0.1:9000", "http://127.0.0.1:9000"),  # never used by S3, so never kept
    ],
)
def test_check_endpoint_url_accepts_and_drops_user_info(text: str, expected: str) -> None:
    assert check_endpoint_url(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "http://[::1",
        "http://user:hunter2@h:99999",
        "http://h:port",
        "ftp://h",
        "not-a-url",
        "http://",
        "http://h /x",
        "http://user:hun/ter2@h",
        "http://h:9000/?token=hunter2",  # an endpoint takes no query: every value hidden, not only secret names
        "http://h:9000/?x=hunter2",
        "http://h:9000/#hunter2",
    ],
)
def test_malformed_endpoints_are_one_line_usage_errors_without_secrets(text: str) -> None:
    with pytest.raises(UsageError, match="invalid endpoint URL") as info:
        check_endpoint_url(text)
    assert info.value.exit_code == 2
    assert "hunter2" not in info.value.message and "ter2" not in info.value.message
    assert "\n" not in info.value.message


def test_credentials_a_server_echoes_are_redacted() -> None:
    add_secret("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    sigv4 = (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20240101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;x-amz-date, Signature=fe5f80f77d5fa3beca038a248ff027d0445342fe2855ddc963176630326f1024"
    )
    echoes = {
        f"you sent Authorization: {sigv4}": "you sent Authorization: ***",
        f"<Auth>{sigv4}</Auth>": "<Auth>AWS4-HMAC-SHA256 ***</Auth>",
        "Authorization: AWS AKIAIOSFODNN7EXAMPLE:frJIUN8DYpKDtOLCwo//yllqDzg=": "Authorization: ***",
        "sig AWS AKIAIOSFODNN7EXAMPLE:frJIUN8DYpKDtOLCwo//yllqDzg= end": "sig AWS *** end",
        "X-Amz-Security-Token: FwoGZXIvYXdzEJr; next": "X-Amz-Security-Token: ***; next",
        "q X-Amz-Signature=abc123&X-Amz-Credential=AKIA%2Fx done": "q X-Amz-Signature=***&X-Amz-Credential=*** done",
        "secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY!": "secret ***!",
        "SignatureDoesNotMatch: The request signature we calculated does not match": None,  # words stay
    }
    for text, shown in echoes.items():
        assert redact_secrets(text) == (text if shown is None else shown)
    # Cut after redaction: a secret straddling the cut does not leave its first half behind.
    long = "x" * 190 + " wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    assert "wJal" not in server_words(long, 200) and len(server_words(long, 200)) <= 200
