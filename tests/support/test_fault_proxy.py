"""The fault proxy: byte-exact forwarding (signed S3 requests through rclone's server), injected 503s and
resets as botocore reports them, retries through them, and no threads left behind."""

from __future__ import annotations

import functools
import http.client
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError

from lingctl.core.local_s3 import LocalS3Server
from lingctl.core.storage import S3Options
from lingctl.core.storage.s3.store import make_client
from tests.support.fault_proxy import Fault, FaultProxy, FaultRequest, every_nth, every_nth_once, first_n, fraction

MiB = 1 << 20


def _wait_for_thread_count(expected: int, timeout: float = 2.0) -> int:
    deadline = time.monotonic() + timeout
    while threading.active_count() > expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


@pytest.fixture
def s3_proxy(s3_server: LocalS3Server) -> Iterator[FaultProxy]:
    """A proxy in front of the session's rclone server; on teardown its threads must all be gone."""
    before = threading.active_count()
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy
    assert _wait_for_thread_count(before) == before


def _client(proxy: FaultProxy, attempts: int = 1):
    """make_client's client for the proxy, making exactly ``attempts`` tries per call.

    S3Options.max_attempts reaches botocore as ``retries["max_attempts"]``, which botocore counts as retries
    after the first try (see test_max_attempts_counts_the_first_try); these tests need the total exact.
    """
    config = _base_config().merge(Config(retries={"total_max_attempts": attempts, "mode": "standard"}))
    return _session().client("s3", endpoint_url=proxy.endpoint, config=config)


@functools.cache
def _base_config() -> Config:
    return make_client(S3Options(endpoint_url="http://127.0.0.1:1")).meta.config


@functools.cache
def _session() -> boto3.session.Session:
    # One session: it caches botocore's service models, which makes each further client ~20x cheaper.
    return boto3.session.Session()


def _error(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    response = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def _exercise(client, bucket: str) -> None:
    """put, get, list and a two-part multipart upload, checking what comes back."""
    client.put_object(Bucket=bucket, Key="small.txt", Body=b"hello proxy")
    # A file-like body makes botocore send "Expect: 100-continue".
    client.put_object(Bucket=bucket, Key="dir/stream.bin", Body=io.BytesIO(b"x" * 300_000))
    assert client.get_object(Bucket=bucket, Key="small.txt")["Body"].read() == b"hello proxy"
    ranged = client.get_object(Bucket=bucket, Key="dir/stream.bin", Range="bytes=10-19")
    assert ranged["Body"].read() == b"x" * 10
    part1, part2 = bytes(range(256)) * (5 * MiB // 256), b"tail" * 256
    upload = client.create_multipart_upload(Bucket=bucket, Key="big.bin")["UploadId"]
    etags = [
        client.upload_part(Bucket=bucket, Key="big.bin", UploadId=upload, PartNumber=n, Body=body)["ETag"]
        for n, body in ((1, part1), (2, part2))
    ]
    client.complete_multipart_upload(
        Bucket=bucket,
        Key="big.bin",
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]},
    )
    assert client.head_object(Bucket=bucket, Key="big.bin")["ContentLength"] == len(part1) + len(part2)
    assert client.get_object(Bucket=bucket, Key="big.bin")["Body"].read() == part1 + part2
    listed = client.list_objects_v2(Bucket=bucket)
    assert sorted(o["Key"] for o in listed["Contents"]) == ["big.bin", "dir/stream.bin", "small.txt"]


@pytest.mark.slow
def test_signed_requests_pass_through_intact(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    _exercise(_client(s3_proxy), s3_bucket)
    assert s3_proxy.stats["requests"] == s3_proxy.stats["forwarded"] == 11
    assert s3_proxy.stats["injected_503"] == s3_proxy.stats["injected_reset"] == 0


@pytest.mark.slow
def test_every_second_request_is_throttled(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    client = _client(s3_proxy)
    s3_proxy.set_rule(every_nth(2))
    client.put_object(Bucket=s3_bucket, Key="a", Body=b"a")
    with pytest.raises(ClientError) as exc:
        client.put_object(Bucket=s3_bucket, Key="b", Body=io.BytesIO(b"b" * 1000))
    assert _error(exc) == ("SlowDown", 503)
    assert client.get_object(Bucket=s3_bucket, Key="a")["Body"].read() == b"a"
    with pytest.raises(ClientError) as exc:
        client.get_object(Bucket=s3_bucket, Key="a")
    assert _error(exc) == ("SlowDown", 503)
    client.list_objects_v2(Bucket=s3_bucket)
    with pytest.raises(ClientError) as exc:  # HEAD answers carry no body: botocore reports the status
        client.head_object(Bucket=s3_bucket, Key="a")
    assert _error(exc) == ("503", 503)
    assert s3_proxy.stats == {"requests": 6, "injected_503": 3, "injected_reset": 0, "forwarded": 3}
    # The throttled PUT never reached the server.
    assert [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]] == ["a"]


@pytest.mark.slow
def test_retries_get_through_throttling(s3_proxy: FaultProxy, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # botocore waits up to 1 s, 2 s, ... before retrying a throttled call; the point here is that it
    # retries and succeeds, not how long it waits.
    monkeypatch.setattr("botocore.retries.standard.ExponentialBackoff.delay_amount", lambda self, ctx: 0.0)
    s3_proxy.set_rule(every_nth(2))
    _exercise(_client(s3_proxy, attempts=5), s3_bucket)
    stats = s3_proxy.stats
    assert stats["forwarded"] == 11 and stats["injected_503"] >= 10
    assert stats["requests"] == stats["forwarded"] + stats["injected_503"]


@pytest.mark.slow
def test_reset_is_a_connection_error(s3_proxy: FaultProxy, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(s3_proxy)
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    s3_proxy.set_rule(first_n(1, "reset"))
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        client.get_object(Bucket=s3_bucket, Key="k")
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"v"  # the proxy carries on

    monkeypatch.setattr("botocore.retries.standard.ExponentialBackoff.delay_amount", lambda self, ctx: 0.0)
    s3_proxy.set_rule(every_nth(2, "reset"))
    retrying = _client(s3_proxy, attempts=5)
    for key in ("r1", "r2", "r3"):
        retrying.put_object(Bucket=s3_bucket, Key=key, Body=io.BytesIO(key.encode() * 1000))
        assert retrying.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == key.encode() * 1000
    assert s3_proxy.stats["injected_reset"] >= 4


@pytest.mark.slow
def test_faults_by_method(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    client = _client(s3_proxy)
    s3_proxy.set_rule(every_nth(1, methods={"put"}))
    with pytest.raises(ClientError) as exc:
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    assert _error(exc) == ("SlowDown", 503)
    assert "Contents" not in client.list_objects_v2(Bucket=s3_bucket)
    s3_proxy.set_rule(None)
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    assert len(client.list_objects_v2(Bucket=s3_bucket)["Contents"]) == 1


@pytest.mark.slow
def test_max_attempts_counts_the_first_try(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    client = make_client(S3Options(endpoint_url=s3_proxy.endpoint, max_attempts=1))
    s3_proxy.set_rule(first_n(1))
    with pytest.raises(ClientError):
        client.list_objects_v2(Bucket=s3_bucket)


# Byte-level forwarding, against an upstream that echoes what it received ------------------------------


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _raw_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            raw = b""
            while True:  # chunk lines and data, kept with their framing
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    break
                raw += self.rfile.read(size + 2)
            while (line := self.rfile.readline()) not in (b"\r\n", b""):
                raw += line
            return raw + line
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _echo(self) -> None:
        body = json.dumps(
            {
                "method": self.command,
                "target": self.path,
                "headers": list(self.headers.items()),
                "body": self._raw_body().decode("latin-1"),
            }
        ).encode()
        self.send_response(200)
        if self.path.startswith("/chunked-answer"):  # an upstream that answers without a Content-Length
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 100):
                piece = body[i : i + 100]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = _echo


@pytest.fixture
def echo_proxy() -> Iterator[FaultProxy]:
    before = threading.active_count()
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    serving = threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": 0.05})
    serving.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            yield proxy
    finally:
        upstream.shutdown()
        upstream.server_close()
        serving.join()
    assert _wait_for_thread_count(before) == before


def _send(
    conn: http.client.HTTPConnection, method: str, target: str, headers: list[tuple[str, str]], body: bytes = b""
) -> tuple[http.client.HTTPResponse, bytes]:
    conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
    for name, value in headers:
        conn.putheader(name, value)
    conn.endheaders(body or None)
    response = conn.getresponse()
    return response, response.read()


def test_request_is_forwarded_byte_for_byte(echo_proxy: FaultProxy) -> None:
    host = echo_proxy.endpoint.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=5)
    rule_saw: list[FaultRequest] = []
    echo_proxy.set_rule(lambda request: rule_saw.append(request))
    headers = [
        ("Host", "bucket.s3.example:9000"),
        ("X-Amz-Date", "20250101T000000Z"),
        ("x-amz-meta-A", "1"),
        ("x-amz-meta-a", "2"),
        ("Authorization", "AWS4-HMAC-SHA256 Credential=k/.., Signature=abc"),
        ("Content-Length", "5"),
    ]
    response, body = _send(conn, "PUT", "/b/k%20ey?partNumber=1&uploadId=x%2By", headers, b"hello")
    seen = json.loads(body)
    assert response.status == 200 and response.getheader("Content-Length") == str(len(body))
    assert (seen["method"], seen["target"], seen["body"]) == ("PUT", "/b/k%20ey?partNumber=1&uploadId=x%2By", "hello")
    assert [tuple(h) for h in seen["headers"]] == headers  # order, case, repeats and Host all unchanged
    assert (rule_saw[0].method, rule_saw[0].path, rule_saw[0].query, rule_saw[0].number) == (
        "PUT",
        "/b/k%20ey",
        "partNumber=1&uploadId=x%2By",
        1,
    )
    assert rule_saw[0].headers["Host"] == "bucket.s3.example:9000"

    # A chunked (aws-chunked style) body with a trailer, on the same kept-alive connection.
    chunked = (
        b"5;chunk-signature=aa\r\nhello\r\n6;chunk-signature=bb\r\n world\r\n0\r\n"
        b"x-amz-checksum-crc64nvme: Zm9v\r\n\r\n"
    )
    headers = [("Host", host), ("Transfer-Encoding", "chunked"), ("Content-Encoding", "aws-chunked")]
    response, body = _send(conn, "PUT", "/b/chunked", headers, chunked)
    seen = json.loads(body)
    assert response.status == 200
    assert seen["body"].encode("latin-1") == chunked
    assert [tuple(h) for h in seen["headers"]] == headers
    conn.close()
    assert echo_proxy.stats["forwarded"] == 2


def test_chunked_upstream_answer_gets_a_content_length(echo_proxy: FaultProxy) -> None:
    conn = http.client.HTTPConnection(echo_proxy.endpoint.removeprefix("http://"), timeout=5)
    for _ in range(2):  # twice: the client connection stays usable
        response, body = _send(conn, "GET", "/chunked-answer", [("Host", "h")])
        assert response.getheader("Transfer-Encoding") is None
        length = response.getheader("Content-Length")
        assert length is not None and int(length) == len(body)
        assert json.loads(body)["target"] == "/chunked-answer"
    conn.close()


def test_injected_503_drains_the_body_and_keeps_the_connection(echo_proxy: FaultProxy) -> None:
    conn = http.client.HTTPConnection(echo_proxy.endpoint.removeprefix("http://"), timeout=5)
    echo_proxy.set_rule(first_n(1))
    response, body = _send(conn, "PUT", "/b/k", [("Host", "h"), ("Content-Length", "100000")], b"z" * 100_000)
    assert response.status == 503 and response.getheader("Content-Type") == "application/xml"
    assert b"<Code>SlowDown</Code>" in body
    response, body = _send(conn, "GET", "/after", [("Host", "h")])
    assert response.status == 200 and json.loads(body)["target"] == "/after"
    conn.close()
    assert echo_proxy.stats == {"requests": 2, "injected_503": 1, "injected_reset": 0, "forwarded": 1}


def test_reset_drops_the_connection(echo_proxy: FaultProxy) -> None:
    conn = http.client.HTTPConnection(echo_proxy.endpoint.removeprefix("http://"), timeout=5)
    echo_proxy.set_rule(first_n(1, "reset"))
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        _send(conn, "GET", "/x", [("Host", "h")])
    conn.close()
    assert echo_proxy.stats["injected_reset"] == 1


def test_stop_ends_idle_kept_alive_connections(s3_server: LocalS3Server) -> None:
    before = threading.active_count()
    proxy = FaultProxy(s3_server.endpoint).start()
    conns = [http.client.HTTPConnection(proxy.endpoint.removeprefix("http://"), timeout=5) for _ in range(3)]
    for conn in conns:
        conn.request("GET", "/")  # unsigned: rclone refuses it, but the connection stays open to the proxy
        conn.getresponse().read()
    assert threading.active_count() >= before + 4  # the accept loop and one thread per connection
    proxy.stop()
    assert _wait_for_thread_count(before) == before
    for conn in conns:
        conn.close()


# Rules ------------------------------------------------------------------------------------------------


def _requests(methods: list[str]) -> list[FaultRequest]:
    return [FaultRequest(method=m, path="/b/k", query="", headers={}, number=i) for i, m in enumerate(methods, 1)]


def test_every_nth() -> None:
    rule = every_nth(3, "reset")
    assert [rule(r) for r in _requests(["GET"] * 7)] == [None, None, "reset", None, None, "reset", None]
    rule = every_nth(2, methods={"PUT"})
    assert [rule(r) for r in _requests(["PUT", "GET", "PUT", "GET", "PUT", "PUT"])] == [
        None,
        None,
        "503",
        None,
        None,
        "503",
    ]


def test_every_nth_once_fails_a_distinct_request_once() -> None:
    rule = every_nth_once(2)
    req = [
        FaultRequest(method="GET", path=f"/b/{p}", query=q, headers={}, number=i)
        for i, (p, q) in enumerate([("a", ""), ("b", ""), ("b", ""), ("a", "x=1"), ("c", ""), ("a", "x=1")], 1)
    ]
    # distinct requests a, b, a?x=1, c: the 2nd (b) and 4th (c) fail on their first attempt only
    assert [rule(r) for r in req] == [None, "503", None, None, "503", None]


def test_first_n() -> None:
    rule = first_n(2)
    assert [rule(r) for r in _requests(["GET"] * 4)] == ["503", "503", None, None]
    assert all(first_n(0)(r) is None for r in _requests(["GET"] * 3))


def test_fraction_is_deterministic() -> None:
    def run(rule) -> list[str | None]:
        return [rule(r) for r in _requests(["GET"] * 200)]

    first = run(fraction(0.3, seed=7))
    assert run(fraction(0.3, seed=7)) == first
    assert run(fraction(0.3, seed=8)) != first
    assert 40 <= first.count("503") <= 80
    assert run(fraction(0.0)) == [None] * 200
    assert run(fraction(1.0, fault="reset")) == ["reset"] * 200


@pytest.mark.parametrize(
    "make",
    [
        lambda: every_nth(0),
        lambda: first_n(-1),
        lambda: fraction(1.5),
        lambda: every_nth(2, cast(Fault, "timeout")),  # not a Fault: refused at run time too
        lambda: FaultProxy("https://x:1"),
    ],
)
def test_bad_arguments(make) -> None:
    with pytest.raises(ValueError):
        make()
