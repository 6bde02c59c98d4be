"""lingctl's SigV4 signatures are botocore's, byte for byte, for the requests lingctl sends (path-style and
virtual-host GETs with queries, PUTs with metadata and checksums, session tokens)."""

from __future__ import annotations

import datetime as dt

import pytest

from lingctl.core.storage.s3.sigv4 import EMPTY_SHA256, UNSIGNED_PAYLOAD, Credentials, CredentialSource, Signer

NOW = dt.datetime(2026, 12, 3, 10, 30, 5, tzinfo=dt.timezone.utc)
CASES = [
    (
        "GET",
        "127.0.0.1:9000",
        "/my-bucket",
        "delimiter=%2F&encoding-type=url&list-type=2&prefix=a%20b%2F",
        {},
        EMPTY_SHA256,
    ),
    (
        "PUT",
        "my-bucket.s3.eu-west-1.amazonaws.com",
        "/dir/%C3%A9t%C3%A9%20%2B%20x.bin",
        "",
        {
            "Content-Length": "5",
            "Content-MD5": "XUFAKrxLKna5cZ2REBfFkg==",
            "x-amz-meta-mtime": "1700000000.123456789",
            "x-amz-checksum-crc64nvme": "BeXKuz/B+us=",
            "User-Agent": "lingctl/0",
        },
        UNSIGNED_PAYLOAD,
    ),
    (
        "GET",
        "host:1",
        "/b/k",
        "",
        {"Range": "bytes=0-9", "If-Match": '"abc"', "x-amz-checksum-mode": "ENABLED"},
        EMPTY_SHA256,
    ),
]


@pytest.mark.parametrize("token", [None, "session-token/+="])
@pytest.mark.parametrize("case", CASES, ids=["list", "put", "ranged-get"])
def test_signature_is_botocores(case, token) -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    method, host, path, query, headers, payload = case
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    signer = Signer(CredentialSource(creds), "eu-west-1", clock=lambda: NOW)
    ours = signer.sign(method, path, query, {"Host": host, **headers}, payload)

    class Fixed(S3SigV4Auth):
        def payload(self, request):  # the hash the request carries, as lingctl decides it
            return payload

    url = f"http://{host}{path}" + (f"?{query}" if query else "")
    request = AWSRequest(method=method, url=url, headers={k: v for k, v in ours.items() if k != "Authorization"})
    request.context["timestamp"] = NOW.strftime("%Y%m%dT%H%M%SZ")
    auth = Fixed(BotoCredentials(creds.access_key, creds.secret_key, token), "s3", "eu-west-1")
    canonical = auth.canonical_request(request)
    signature = auth.signature(auth.string_to_sign(request, canonical), request)
    assert ours["Authorization"].endswith(f"Signature={signature}")
    assert f"SignedHeaders={auth.signed_headers(auth.headers_to_sign(request))}," in ours["Authorization"]
    assert ours["x-amz-date"] == "20261203T103005Z" and ours["x-amz-content-sha256"] == payload
    assert ("x-amz-security-token" in ours) == (token is not None)
