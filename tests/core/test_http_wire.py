"""The keep-alive HTTP/1.1 client against a scripted raw-socket server on 127.0.0.1.

The server reads each request (request line, headers, a Content-Length body), records it with the number of
the connection it came on, and answers with canned bytes; what happens to the connection afterwards is
scripted too: kept, closed by the server, or left hanging without an answer.
"""

from __future__ import annotations

import io
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lingctl.core.storage.s3.http_wire import Pool, WireError

WAIT_S = 10.0  # upper bound on any wait for the server; only reached when something is wrong


@dataclass(frozen=True, slots=True)
class Received:
    conn: int  # 1 for the first connection the server accepted
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


# An answer: the raw bytes, then "keep" (read the next request), "close" (the server closes its side)
# or "hang" (no answer at all; wait for the end of the test).
Answer = tuple[bytes, str]
Handler = Callable[[Received], Answer]


class ScriptedServer:
    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.received: list[Received] = []
        self.connections = 0
        self.closed = 0  # connections the server closed after an answer scripted "close"
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self._start(self._accept_loop)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self.changed:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # the listener was shut down
            with self.changed:
                self.connections += 1
                self._socks.append(sock)
                self._start(self._serve, sock, self.connections)

    def _serve(self, sock: socket.socket, number: int) -> None:
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_side=True)
            except OSError:  # the client refused the certificate
                sock.close()
                with self.changed:
                    self.closed += 1
                    self.changed.notify_all()
                return
        reader = sock.makefile("rb")
        try:
            while request := _read_request(reader, number):
                with self.changed:
                    self.received.append(request)
                    self.changed.notify_all()
                data, then = self.handler(request)
                sock.sendall(data)
                if then == "hang":
                    self.stopping.wait(WAIT_S)
                if then != "keep":
                    break
        except OSError:
            pass  # the client went away, or the test ended
        finally:
            reader.close()
            sock.close()
            with self.changed:
                self.closed += 1
                self.changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, WAIT_S), "the server did not get there in time"

    def stop(self) -> None:
        self.stopping.set()
        with self.changed:
            socks, threads = list(self._socks), list(self._threads)
        for sock in [self.listener, *socks]:  # shutdown wakes a thread blocked in accept or recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.listener.close()
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), "a server thread did not stop"


def _read_request(reader: io.BufferedReader, number: int) -> Received | None:
    line = reader.readline()
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while (header := reader.readline()) not in (b"\r\n", b""):
        name, _, value = header.decode("latin-1").partition(":")
        headers.append((name, value.strip()))
    length = int(dict((k.lower(), v) for k, v in headers).get("content-length", "0"))
    body = reader.read(length) if length else b""
    return Received(number, method, target, headers, body)


def script(*answers: Answer) -> Handler:
    """A handler giving the answers in order, one per request, whatever the request."""
    queue = list(answers)
    lock = threading.Lock()

    def handler(_: Received) -> Answer:
        with lock:
            return queue.pop(0)

    return handler


def ok(body: bytes, *extra: str, then: str = "keep") -> Answer:
    head = "".join(f"{h}\r\n" for h in (f"Content-Length: {len(body)}", *extra))
    return f"HTTP/1.1 200 OK\r\n{head}\r\n".encode() + body, then


Start = Callable[..., tuple[ScriptedServer, Pool]]


@pytest.fixture
def start() -> Iterator[Start]:
    """start(handler, read_timeout=...) -> (a running server, a Pool to it); both stopped after the test."""
    made: list[tuple[ScriptedServer, Pool]] = []

    def _start(handler: Handler, read_timeout: float = WAIT_S) -> tuple[ScriptedServer, Pool]:
        server = ScriptedServer(handler)
        pool = Pool("127.0.0.1", server.port, read_timeout=read_timeout)
        made.append((server, pool))
        return server, pool

    yield _start
    for server, pool in made:
        pool.close()
        server.stop()


H = {"Host": "127.0.0.1"}


def test_content_length_answer_and_headers(start: Start) -> None:
    raw = (
        b'HTTP/1.1 200 Fine Thanks\r\nContent-Length: 5\r\nX-Amz-Meta-Color: blue\r\nETag: "e1"\r\n'
        b"x-amz-meta-color: green\r\n\r\nhello"
    )
    server, pool = start(script((raw, "keep")))
    reply = pool.request("GET", "/b/k?x=1", H)
    assert (reply.status, reply.reason, reply.data) == (200, "Fine Thanks", b"hello")
    assert reply.headers["etag"] == reply.headers["ETAG"] == '"e1"'
    assert "content-LENGTH" in reply.headers and "X-Missing" not in reply.headers
    assert reply.headers.get("x-missing", "d") == "d"
    assert reply.headers["X-AMZ-META-COLOR"] == "blue, green"
    assert reply.headers.items() == [("Content-Length", "5"), ("X-Amz-Meta-Color", "blue, green"), ("ETag", '"e1"')]
    assert [(r.method, r.target) for r in server.received] == [("GET", "/b/k?x=1")]


def test_keep_alive_reuses_until_the_server_says_close(start: Start) -> None:
    server, pool = start(script(ok(b"1"), ok(b"2", "Connection: close", then="close"), ok(b"3")))
    assert [pool.request("GET", f"/{i}", H).data for i in range(3)] == [b"1", b"2", b"3"]
    assert [(r.conn, r.target) for r in server.received] == [(1, "/0"), (1, "/1"), (2, "/2")]


def test_chunked_body_is_decoded_and_the_connection_reused(start: Start) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;x=y\r\nhello\r\n1\r\n \r\nc\r\nworld, again\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    server, pool = start(script((chunked, "keep"), ok(b"next")))
    assert pool.request("GET", "/a", H).data == b"hello world, again"
    assert pool.request("GET", "/b", H).data == b"next"
    assert [r.conn for r in server.received] == [1, 1]


def test_body_without_length_is_read_to_the_close(start: Start) -> None:
    server, pool = start(script((b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nuntil the end", "close"), ok(b"x")))
    assert pool.request("GET", "/a", H).data == b"until the end"
    assert pool.request("GET", "/b", H).data == b"x"
    assert [r.conn for r in server.received] == [1, 2]


@pytest.mark.parametrize(
    ("method", "head"),
    [
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"),
        ("GET", b"HTTP/1.1 204 No Content\r\nContent-Length: 1234\r\n\r\n"),
        ("GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
        ("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n"),
    ],
)
def test_answers_without_a_body_leave_the_connection_usable(start: Start, method: str, head: bytes) -> None:
    server, pool = start(script((head, "keep"), ok(b"after")))
    first = pool.request(method, "/a", H)
    assert first.data == b"" and first.status == int(head[9:12])
    second = pool.request("GET", "/b", H)
    assert (second.status, second.data) == (200, b"after")
    assert [(r.conn, r.method) for r in server.received] == [(1, method), (1, "GET")]


@pytest.mark.parametrize("size", [10, 64 * 1024, 64 * 1024 + 1, 300_000])
def test_put_sends_the_exact_body_and_headers_in_order(start: Start, size: int) -> None:
    body = bytes(i % 251 for i in range(size))
    headers = {
        "Host": "bucket.example.test:9000",
        "x-amz-date": "20240101T000000Z",
        "Content-Length": str(size),
        "X-Custom": "a b",
    }
    server, pool = start(script(ok(b"")))
    assert pool.request("PUT", "/bucket/key%20x", headers, memoryview(body)).status == 200
    (got,) = server.received
    assert (got.method, got.target, got.body) == ("PUT", "/bucket/key%20x", body)
    assert got.headers == list(headers.items())


def test_idle_connection_closed_by_the_server_is_replaced(start: Start) -> None:
    server, pool = start(script(ok(b"1", then="close"), ok(b"2")))
    assert pool.request("GET", "/a", H).data == b"1"
    # The server's close has returned, so its FIN reached the loopback peer: the idle connection is dead.
    server.wait_for(lambda: server.closed == 1)
    assert pool.request("GET", "/b", H).data == b"2"
    assert [r.conn for r in server.received] == [1, 2]


def test_bytes_beyond_an_answer_retire_its_connection(start: Start) -> None:
    # A body sent with an answer that has none (or junk) arrives in the same packet: the next answer read on
    # that connection would start with it, so the connection is not reused.
    head_with_body = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nJUNK"
    server, pool = start(script((head_with_body, "keep"), ok(b"2")))
    assert pool.request("HEAD", "/a", H).data == b""
    assert pool.request("GET", "/b", H).data == b"2"
    assert [r.conn for r in server.received] == [1, 2]


def test_connection_refused_is_a_wire_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = Pool("127.0.0.1", port, connect_timeout=WAIT_S)
    with pytest.raises(WireError) as caught:
        pool.request("GET", "/", H)
    assert isinstance(caught.value.cause, ConnectionRefusedError)


def test_body_cut_short_names_the_byte_counts(start: Start) -> None:
    server, pool = start(
        script((b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10, "close"), ok(b"again"))
    )
    with pytest.raises(WireError, match="10 of 1000 bytes"):
        pool.request("GET", "/a", H)
    assert pool.request("GET", "/b", H).data == b"again"  # the broken connection was not kept
    assert [r.conn for r in server.received] == [1, 2]


@pytest.mark.parametrize("line", [b"HTTP/1.1 2000 OK\r\n", b"ICY 200 OK\r\n", b"garbage\r\n"])
def test_malformed_status_line_is_a_wire_error(start: Start, line: bytes) -> None:
    _, pool = start(script((line + b"Content-Length: 0\r\n\r\n", "keep")))
    with pytest.raises(WireError, match="malformed status line"):
        pool.request("GET", "/", H)


def test_server_closing_without_answering_is_a_wire_error(start: Start) -> None:
    _, pool = start(script((b"", "close")))
    with pytest.raises(WireError) as caught:
        pool.request("GET", "/", H)
    assert isinstance(caught.value.cause, ConnectionResetError)
    assert "without answering" in str(caught.value)


def test_read_timeout_is_a_wire_error(start: Start) -> None:
    server, pool = start(script((b"", "hang")), read_timeout=0.3)
    with pytest.raises(WireError, match="timed out") as caught:
        pool.request("GET", "/", H)
    assert isinstance(caught.value.cause, TimeoutError)
    server.wait_for(lambda: len(server.received) == 1)


def test_many_threads_share_one_pool(start: Start) -> None:
    threads, per_thread = 16, 20
    server, pool = start(lambda r: ok(r.target.encode(), f"X-Conn: {r.conn}"))
    wrong: list[tuple[str, bytes]] = []
    failures: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(per_thread):
                target = f"/t{t}/r{i}"
                reply = pool.request("GET", target, H)
                if reply.data != target.encode():
                    wrong.append((target, reply.data))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers)
    assert failures == [] and wrong == []
    assert len(server.received) == threads * per_thread
    # At most one connection in use per thread, and maxsize (16) idle ones are kept: none is ever dropped.
    assert server.connections <= threads


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_https_checks_the_certificate_and_keeps_the_connection(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = ScriptedServer(script(ok(b"one"), ok(b"two")), tls=context)
    trusting = Pool("127.0.0.1", server.port, https=True, ca_certs=str(cert), read_timeout=WAIT_S)
    stranger = Pool("127.0.0.1", server.port, https=True, read_timeout=WAIT_S)  # the system's CAs only
    try:
        assert trusting.request("GET", "/a", H).data == b"one"
        assert trusting.request("GET", "/b", H).data == b"two"
        assert [r.conn for r in server.received] == [1, 1]
        with pytest.raises(WireError, match="TLS certificate verification failed") as refused:
            stranger.request("GET", "/c", H)
        assert isinstance(refused.value.cause, ssl.SSLCertVerificationError)
    finally:
        trusting.close()
        stranger.close()
        server.stop()


# -- through an http proxy ------------------------------------------------------------------------------------


def test_an_http_proxy_gets_absolute_targets_and_its_credentials() -> None:
    import base64

    from tests.support.hostile_http import HostileServer, proxy

    with HostileServer(proxy()) as server:
        pool = Pool("s3.example", 9000, proxy=f"http://user:p%40ss@127.0.0.1:{server.port}", read_timeout=WAIT_S)
        reply = pool.request("GET", "/b/k?x=1", {"Host": "s3.example:9000"})
        pool.close()
    assert reply.data == b"ok" and reply.headers["X-Target"] == "http://s3.example:9000/b/k?x=1"
    assert reply.headers["X-Auth"] == "Basic " + base64.b64encode(b"user:p@ss").decode()


def test_https_through_an_http_proxy_is_a_tunnel_with_every_check(certificate: tuple[Path, Path]) -> None:
    from lingctl.core.storage.s3.http_wire import AnswerTooLarge, ConnectError
    from tests.support.hostile_http import HostileServer, proxy

    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    huge = (b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n", "close")
    origin = ScriptedServer(script(ok(b"through the tunnel"), huge), tls=context)
    with HostileServer(proxy()) as tunnel, HostileServer(proxy(refuse=b"HTTP/1.1 407 No\r\n\r\n")) as refusing:
        via = f"http://127.0.0.1:{tunnel.port}"
        trusting = Pool("127.0.0.1", origin.port, https=True, ca_certs=str(cert), proxy=via, read_timeout=WAIT_S)
        stranger = Pool("127.0.0.1", origin.port, https=True, proxy=via, read_timeout=WAIT_S)
        refused = Pool("127.0.0.1", origin.port, https=True, proxy=f"http://127.0.0.1:{refusing.port}")
        try:
            assert trusting.request("GET", "/a", H).data == b"through the tunnel"
            with pytest.raises(AnswerTooLarge):  # the bounds hold inside the tunnel too
                trusting.request("GET", "/b", H, limit=1000)
            with pytest.raises(ConnectError, match="TLS certificate verification failed"):
                stranger.request("GET", "/c", H)
            with pytest.raises(ConnectError, match="refused the tunnel to 127.0.0.1:.* \\(HTTP 407\\)"):
                refused.request("GET", "/d", H)
        finally:
            for pool in (trusting, stranger, refused):
                pool.close()
            origin.stop()
        # The proxy saw only where to connect; the requests went inside TLS.
        assert {(r.method, r.target) for r in tunnel.requests} == {("CONNECT", f"127.0.0.1:{origin.port}")}
    assert [r.target for r in origin.received] == ["/a", "/b"]


def test_an_https_proxy_goes_through_urllib3_with_the_same_body_limits(certificate: tuple[Path, Path]) -> None:
    from lingctl.core.storage.s3.http_wire import AnswerTooLarge, ConnectError, ProxiedPool, certificate_failure
    from tests.support.hostile_http import FakeObject, FakeS3, HostileServer, chunked_forever, proxy

    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with (
        HostileServer(proxy(), tls=context) as tls_proxy,
        HostileServer(FakeS3("bkt", {"a": FakeObject(3)}, on_get=chunked_forever()), tls=context) as origin,
    ):
        trusting = ProxiedPool(origin.endpoint, tls_proxy.endpoint, connect_timeout=WAIT_S, read_timeout=WAIT_S,
                               maxsize=4, ca_certs=str(cert))  # fmt: skip
        stranger = ProxiedPool(origin.endpoint, tls_proxy.endpoint, connect_timeout=WAIT_S, read_timeout=WAIT_S,
                               maxsize=4, ca_certs=None)  # fmt: skip
        host = {"Host": f"127.0.0.1:{origin.port}"}
        try:
            assert trusting.request("HEAD", "/bkt/a", host).headers["Content-Length"] == "3"
            with pytest.raises(AnswerTooLarge):  # endless chunks from the origin, inside TLS inside TLS
                trusting.request("GET", "/bkt/a", host, limit=1000)
            with pytest.raises(ConnectError) as refused:  # the proxy's own certificate is checked
                stranger.request("GET", "/bkt/a", host)
            assert certificate_failure(refused.value) is not None
        finally:
            trusting.close()
            stranger.close()
        assert origin.sent < 32 << 20
    assert [r.method for r in tls_proxy.requests] == ["CONNECT"]  # one tunnel, kept; the stranger never got in
