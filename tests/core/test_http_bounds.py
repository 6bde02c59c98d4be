"""Every answer is bounded in memory and time, whatever the server sends: lingctl's HTTP client against a
scripted hostile server on 127.0.0.1 (tests/support/hostile_http.py).

Memory is checked by what the server managed to hand over before the client dropped the connection: far less
than the body it offered (a GiB, or no end at all). Time is checked with small timeouts, so each case ends in
about a second; the assertion is that the error came, not how fast.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from lingctl.core.storage.s3.http_wire import AnswerTooLarge, ConnectError, Pool, TooSlow, WireError
from tests.support.hostile_http import (
    HostileServer,
    Script,
    answer,
    chunked_forever,
    endless_body,
    endless_head,
    head,
    interim_forever,
    trailers_forever,
    trickled,
    zeros,
)

GiB, MiB = 1 << 30, 1 << 20
H = {"Host": "127.0.0.1"}
# What the server may hand over before the client drops it: the client's limit plus what the loopback
# socket buffers hold (a few MiB); an unbounded client would take the whole GiB, or until memory runs out.
TAKEN = 32 * MiB


@pytest.fixture
def serve() -> Iterator[object]:
    """serve(script) -> a running HostileServer, stopped (threads joined) after the test."""
    servers: list[HostileServer] = []

    def _serve(script: Script) -> HostileServer:
        servers.append(HostileServer(script))
        return servers[-1]

    yield _serve
    for server in servers:
        server.stop()


def pool(server: HostileServer, *, read_timeout: float = 10.0, low_speed_limit: int = 1024) -> Pool:
    return Pool("127.0.0.1", server.port, read_timeout=read_timeout, low_speed_limit=low_speed_limit)


# -- size ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "match"),
    [
        (endless_body(head("200 OK", f"Content-Length: {GiB}")), "declares a body of 1073741824 bytes"),
        (chunked_forever(), "chunked body runs past the 1000 bytes"),
        (endless_body(head("200 OK", version="HTTP/1.0")), "runs past the 1000 bytes"),  # to the close
        (endless_body(head("200 OK", "Transfer-Encoding: gzip")), "runs past the 1000 bytes"),
    ],
    ids=["content-length-1GiB", "endless-chunks", "http10-no-length", "unknown-coding"],
)
def test_a_body_beyond_what_the_request_needs_is_refused_and_not_read(serve, script: Script, match: str) -> None:
    server = serve(script)
    client = pool(server)
    with pytest.raises(AnswerTooLarge, match=match):
        client.request("GET", "/b/obj", H, limit=1000)
    server.wait_for(lambda: len(server.requests) == 1)
    assert server.sent < TAKEN
    client.close()


@pytest.mark.parametrize("status", ["500 Internal Error", "403 Forbidden", "301 Moved"])
def test_error_answers_are_bounded_whatever_the_request_allows(serve, status: str) -> None:
    declared = serve(endless_body(head(status, f"Content-Length: {GiB}")))
    with pytest.raises(AnswerTooLarge, match="declares a body of 1073741824 bytes, more than the 1048576"):
        pool(declared).request("GET", "/b/obj", H, limit=4 * GiB)
    endless = serve(chunked_forever(status))
    with pytest.raises(AnswerTooLarge, match="past the 1048576 bytes"):
        pool(endless).request("GET", "/b/obj", H, limit=4 * GiB)
    assert declared.sent < TAKEN and endless.sent < TAKEN


def test_a_put_answered_with_a_gib_is_refused_by_the_default_limit(serve) -> None:
    server = serve(endless_body(head("200 OK", f"Content-Length: {GiB}")))
    body = b"x" * 100
    with pytest.raises(AnswerTooLarge, match="more than the 1048576"):
        pool(server).request("PUT", "/b/obj", {**H, "Content-Length": "100"}, body)
    assert server.requests[0].body == body and server.sent < TAKEN


@pytest.mark.parametrize(
    "size_line",
    [b"-1", b"+10", b"0x10", b"1_0", b" ", b"zz", b"fffffffffffffffffff", b"\xff"],
)
def test_malformed_chunk_sizes_are_refused(serve, size_line: bytes) -> None:
    server = serve(answer(head("200 OK", "Transfer-Encoding: chunked") + size_line + b"\r\n" + bytes(100)))
    with pytest.raises(WireError, match="malformed chunk size|past the"):
        pool(server).request("GET", "/b/obj", H, limit=10 * MiB)


def test_a_limit_may_depend_on_the_answer(serve) -> None:
    # A ranged GET to a server that ignores Range gets the whole object: its own bound.
    whole = b"y" * 5000
    server = serve(answer(head("200 OK", f"Content-Length: {len(whole)}") + whole))
    client = pool(server)
    assert client.request("GET", "/o", H, limit=lambda s, h: 10 if "Content-Range" in h else 5000).data == whole
    with pytest.raises(AnswerTooLarge):
        client.request("GET", "/o", H, limit=lambda s, h: 10 if "Content-Range" in h else 4999)


# -- time ----------------------------------------------------------------------------------------------------

OK_ANSWER = head("200 OK", "Content-Length: 5") + b"hello"


@pytest.mark.parametrize(
    "script",
    [
        trickled(OK_ANSWER, 0.05),  # the head, a byte at a time
        trickled(head("200 OK", "Content-Length: 4000") + bytes(4000), 0.002),  # ~500 bytes/s throughout
        trickled(head("200 OK", "Transfer-Encoding: chunked") + b"1\r\nx\r\n" * 2000 + b"0\r\n\r\n", 0.002),
        trickled(head("200 OK", "Transfer-Encoding: chunked") + b"0\r\n" + b"X-T: 1\r\n" * 100 + b"\r\n", 0.002),
    ],
    ids=["head", "content-length-body", "chunks", "trailers"],
)
def test_an_answer_slower_than_the_low_speed_limit_is_cut(serve, script: Script) -> None:
    server = serve(script)
    client = pool(server, read_timeout=0.5, low_speed_limit=1024)  # at least 512 bytes per 0.5 s window
    with pytest.raises(TooSlow, match="too slow"):
        client.request("GET", "/b/obj", H)
    assert server.sent < 4000  # the answer was cut, not waited for to its end


def test_the_same_trickle_passes_when_the_limit_is_off(serve) -> None:
    server = serve(trickled(OK_ANSWER, 0.005))
    assert pool(server, read_timeout=0.5, low_speed_limit=0).request("GET", "/", H).data == b"hello"


@pytest.mark.parametrize(
    ("script", "match"),
    [
        (interim_forever(), "more than 16 interim"),
        (trailers_forever(), "more than 200 trailer lines"),
        (endless_head(b"x" * 4096), "header line too long"),
        (endless_head(b"X-A: 1\r\n" * 512), "headers are longer than 262144 bytes"),
    ],
    ids=["100-continue-forever", "trailers-forever", "one-endless-header", "headers-forever"],
)
def test_endless_answers_that_come_fast_are_cut_by_count(serve, script: Script, match: str) -> None:
    server = serve(script)
    with pytest.raises(WireError, match=match):
        pool(server).request("GET", "/", H)
    assert server.sent < TAKEN


def test_a_slow_answer_allowed_by_the_request_still_has_an_end(serve) -> None:
    # CompleteMultipartUpload: AWS keeps the connection alive with a space now and then; the request asks
    # for a total bound in place of the low-speed rule, and a server that never finishes meets it.
    spaces = head("200 OK", "Transfer-Encoding: chunked") + b"1\r\n \r\n" * 10_000
    server = serve(trickled(spaces, 0.01))
    with pytest.raises(TooSlow, match="took longer than 1 s"):
        pool(server, read_timeout=0.5).request("POST", "/b/k?uploadId=1", {**H, "Content-Length": "0"}, slow_answer_s=1)


def test_connect_timeout_is_a_connect_error() -> None:
    # A listener whose accept queue is full drops new SYNs: the connect waits until its own timeout.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        fillers = []
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(listener.getsockname())
            fillers.append(s)
        try:
            client = Pool("127.0.0.1", listener.getsockname()[1], connect_timeout=0.3)
            with pytest.raises(ConnectError, match="connect timed out"):
                client.request("GET", "/", H)
        finally:
            for s in fillers:
                s.close()


# -- malformed heads -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (head("200 OK", "Content-Length: abc"), "malformed Content-Length"),
        (head("200 OK", "Content-Length: -5"), "malformed Content-Length"),
        (head("200 OK", "Content-Length: +5"), "malformed Content-Length"),
        (head("200 OK", "Content-Length: 1_0"), "malformed Content-Length"),
        (head("200 OK", "Content-Length: " + "9" * 5000), "malformed Content-Length"),  # int() raises past 4300
        (head("200 OK", "Content-Length: \xb2"), "malformed Content-Length"),  # a latin-1 superscript two
        (head("200 OK", "Content-Length: 5", "Content-Length: 6"), "conflicting Content-Length"),
        (head("2x0 OK"), "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"\r\n\r\n", "malformed status line"),
    ],
)
def test_malformed_heads_are_wire_errors(serve, raw: bytes, match: str) -> None:
    server = serve(answer(raw + b"hello", keep=False))
    with pytest.raises(WireError, match=match):
        pool(server).request("GET", "/", H)


def test_equal_repeated_lengths_and_odd_bytes_in_values_are_taken(serve) -> None:
    raw = b"HTTP/1.1 200 \xff\xfe\r\nContent-Length: 5\r\nContent-Length: 5\r\nX-Odd: \xe9\xff\r\n\r\nhello"
    server = serve(answer(raw))
    reply = pool(server).request("GET", "/", H)
    assert (reply.data, reply.reason, reply.headers["x-odd"]) == (b"hello", "\xff\xfe", "\xe9\xff")


# -- behind an https:// proxy: urllib3 sends, read_proxied reads -------------------------------------------


def _negative_chunk(request, wire) -> bool:
    if wire.send(head("200 OK", "Transfer-Encoding: chunked") + b"-1\r\n"):
        wire.stream(zeros())
    return False


@pytest.mark.parametrize(
    ("script", "error"),
    [
        (endless_body(head("200 OK", f"Content-Length: {GiB}")), AnswerTooLarge),
        (chunked_forever(), AnswerTooLarge),
        (_negative_chunk, WireError),  # urllib3 alone would read it to the end of the connection
        (endless_body(head("200 OK", version="HTTP/1.0")), AnswerTooLarge),
        (endless_body(head("503 Slow Down", f"Content-Length: {GiB}")), AnswerTooLarge),
    ],
    ids=["content-length-1GiB", "endless-chunks", "chunk-size-minus-1", "to-the-close", "503-with-1GiB"],
)
def test_answers_read_through_urllib3_have_the_same_size_bounds(serve, script: Script, error: type) -> None:
    import urllib3

    from lingctl.core.storage.s3.http_wire import read_proxied

    server = serve(script)
    manager = urllib3.PoolManager(timeout=urllib3.Timeout(connect=10, read=10))
    resp = manager.request("GET", f"{server.endpoint}/b/obj", preload_content=False, retries=False)
    with pytest.raises(error):
        read_proxied(resp, 1000)
    assert server.sent < TAKEN
    manager.clear()


def test_the_signed_client_goes_through_an_http_proxy_from_the_environment(serve, monkeypatch) -> None:
    from lingctl.core.storage.s3.client import S3Options
    from lingctl.core.storage.s3.signed_http import SignedS3Client
    from tests.support.hostile_http import proxy

    server = serve(proxy())
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{server.port}")
    client = SignedS3Client(S3Options(endpoint_url="http://s3.example:9000", region="us-east-1"), "bkt", unsigned=True)
    headers = client.head("dir/k")
    client.close()
    assert headers is not None and headers["X-Target"] == "http://s3.example:9000/bkt/dir/k"
