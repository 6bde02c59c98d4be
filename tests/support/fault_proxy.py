"""A fault-injecting HTTP reverse proxy on 127.0.0.1, for testing S3 clients against throttling and resets.

Clients talk to ``proxy.endpoint`` as if it were the upstream server. Requests are forwarded unchanged:
method, request target, every header in order (the Host header too, because SigV4 signs it) and the body,
Content-Length-framed or chunked (relayed chunk by chunk with its framing, so aws-chunked payload signatures
survive). A ``rule`` sees each request before it is forwarded and may answer instead:

- ``"503"``: a 503 with S3's SlowDown error body, without contacting upstream (the request body is still
  read, so the client connection stays usable and the client sees a clean throttling answer);
- ``"reset"``: the connection is dropped with a TCP RST, no response at all;
- ``"flip"``: the request is forwarded with the first byte of its (Content-Length-framed) body inverted,
  as a body damaged in transit would arrive.

    with FaultProxy(server.endpoint, rule=every_nth(2)) as proxy:
        client = make_client(S3Options(endpoint_url=proxy.endpoint, max_attempts=1))

Rules are called from the proxy's connection threads; the ones here keep their state under a lock, and the
k-th request a rule sees always gets the same answer, whichever thread brings it.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal, cast
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

Fault = Literal["503", "reset", "flip"]
FAULTS: tuple[Fault, ...] = ("503", "reset", "flip")
Rule = Callable[["FaultRequest"], "Fault | None"]
# What socketserver hands its request methods; a TCP server's request is always the connection's socket.
_Request = socket.socket | tuple[bytes, socket.socket]

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
_BLOCK = 1 << 16
_JOIN_TIMEOUT = 2.0


@dataclass(frozen=True)
class FaultRequest:
    method: str
    path: str  # without the query string
    query: str  # without the "?"
    headers: dict[str, str]  # last value wins for repeated names
    number: int  # 1-based, in order of arrival over all connections


class _Handler(BaseHTTPRequestHandler):
    # Keep-alive towards the client, as S3 clients pool connections; every response carries Content-Length.
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self.upstream is not None:
                self.server.proxy._forget_upstream(self.upstream)
                self.upstream.close()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("fault proxy %s: " + format, self.address_string(), *args)

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError, OSError) as exc:
            # A client that went away, or stop() shutting the socket: nothing left to answer.
            log.debug("fault proxy connection ended: %r", exc)
            self.close_connection = True

    def _dispatch(self) -> None:
        proxy = self.server.proxy
        path, _, query = self.path.partition("?")
        number = proxy._count("requests")
        request = FaultRequest(
            method=self.command, path=path, query=query, headers=dict(self.headers.items()), number=number
        )
        fault = proxy._rule_for(request)
        if fault == "503":
            proxy._count("injected_503")
            self._drain_body()
            self._answer_slowdown()
        elif fault == "reset":
            proxy._count("injected_reset")
            self._drain_body()
            self._reset()
        else:
            if fault == "flip":
                proxy._count("injected_flip")
            self._forward(flip=fault == "flip")

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _dispatch

    # The request body -------------------------------------------------------------------------------

    def _is_chunked(self) -> bool:
        return "chunked" in self.headers.get("Transfer-Encoding", "").lower()

    def _body_pieces(self):
        """The request body as raw byte pieces, chunked framing included, read as it arrives."""
        if self._is_chunked():
            while True:
                line = self.rfile.readline(1 << 16)
                if not line.endswith(b"\n"):
                    raise ConnectionError("chunked request body ended inside a chunk-size line")
                yield line
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    break
                yield from self._read_exactly(size + 2)  # the data and its CRLF
            while True:  # trailers (aws-chunked puts checksums here), up to the empty line
                line = self.rfile.readline(1 << 16)
                if not line:
                    raise ConnectionError("chunked request body ended inside its trailers")
                yield line
                if line in (b"\r\n", b"\n"):
                    return
        yield from self._read_exactly(int(self.headers.get("Content-Length") or 0))

    def _read_exactly(self, n: int):
        while n > 0:
            block = self.rfile.read(min(n, _BLOCK))
            if not block:
                raise ConnectionError(f"request body ended {n} bytes short")
            n -= len(block)
            yield block

    def _drain_body(self) -> None:
        for _ in self._body_pieces():
            pass

    # Answers ----------------------------------------------------------------------------------------

    def _answer_slowdown(self) -> None:
        self.send_response(503, "Slow Down")
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(SLOWDOWN_BODY)))
        self.send_header("x-amz-request-id", "FAULTPROXY")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(SLOWDOWN_BODY)

    def _answer_bad_gateway(self, exc: Exception) -> None:
        body = f"fault proxy: upstream failed: {exc!r}".encode()
        self.close_connection = True
        self.send_response(502, "Bad Gateway")
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout makes close() send RST instead of FIN: the client sees
        # "connection reset by peer", as from a crashed server or a load balancer dropping the flow.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _forward(self, *, flip: bool = False) -> None:
        proxy = self.server.proxy
        if self.upstream is None:
            self.upstream = proxy._connect_upstream()
        try:
            # skip_host / skip_accept_encoding: send the client's headers and nothing of http.client's own.
            self.upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                self.upstream.putheader(name, value)
            self.upstream.endheaders()
            for piece in self._body_pieces():
                if flip and piece and not self._is_chunked():
                    piece, flip = bytes([piece[0] ^ 0xFF]) + piece[1:], False
                self.upstream.send(piece)
            response = self.upstream.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            log.debug("fault proxy upstream error: %r", exc)
            self.upstream.close()
            self._answer_bad_gateway(exc)
            return
        # Counted before the answer goes back: a client that has its answer sees the count include it.
        proxy._count("forwarded")
        self._relay(response)

    def _relay(self, response: http.client.HTTPResponse) -> None:
        headers = response.getheaders()
        length = response.getheader("Content-Length")
        bodyless = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        self.send_response_only(response.status, response.reason)
        if bodyless or length is not None:
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            if not bodyless:
                while block := response.read(_BLOCK):
                    self.wfile.write(block)
        else:
            # Chunked or read-to-close upstream bodies are re-framed with a Content-Length, which keeps the
            # client side simple; these are small XML answers, not object data.
            body = response.read()
            for name, value in headers:
                if name.lower() not in ("transfer-encoding", "content-length"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        response.close()
        if response.will_close:
            assert self.upstream is not None  # the response came from it
            self.upstream.close()  # http.client reconnects on the next request


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # never block interpreter exit; stop() joins them itself
    block_on_close = False

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request: _Request, client_address: tuple[str, int]) -> None:
        # Registered before the thread starts, so stop() can end connections that have not been served yet.
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"fault-proxy-conn-{client_address[1]}",
            daemon=True,
        )
        if not self.proxy._track(cast(socket.socket, request), thread):
            self.shutdown_request(request)
            return
        thread.start()

    def process_request_thread(self, request: _Request, client_address: tuple[str, int]) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.proxy._untrack(cast(socket.socket, request))

    def handle_error(self, request: _Request, client_address: tuple[str, int]) -> None:
        log.debug("fault proxy error serving %s", client_address, exc_info=True)


class FaultProxy:
    """A reverse proxy in front of ``upstream`` (``http://host:port``) that injects faults chosen by ``rule``."""

    def __init__(self, upstream: str, *, rule: Rule | None = None) -> None:
        parsed = urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or parsed.path not in ("", "/"):
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = upstream
        self._upstream_addr = (parsed.hostname, parsed.port or 80)
        self._rule = rule
        self._lock = threading.Lock()
        # "injected_flip" appears once a body has been damaged.
        self.stats: dict[str, int] = {"requests": 0, "injected_503": 0, "injected_reset": 0, "forwarded": 0}
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._upstreams: set[http.client.HTTPConnection] = set()
        self._stopping = False
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None
        self.endpoint = ""

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("fault proxy already started")
        self._stopping = False
        self._server = _Server(self)
        host, port = cast(tuple[str, int], self._server.server_address[:2])  # an AF_INET address
        self.endpoint = f"http://{host}:{port}"
        self._serve_thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"fault-proxy-{port}", daemon=True
        )
        self._serve_thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, cut every open connection (both sides) and join the threads."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            self._stopping = True
            conns = dict(self._conns)
            upstreams = list(self._upstreams)
        # Shutting the sockets wakes threads blocked reading the next request from an idle pooled
        # connection, or waiting on upstream; close() alone would not.
        for sock in [*conns, *(u.sock for u in upstreams if u.sock is not None)]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT
        for thread in [self._serve_thread, *conns.values()]:
            if thread is not None and thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        self._server = None
        self._serve_thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_rule(self, rule: Rule | None) -> None:
        """Change the rule for requests that arrive from now on (``None``: forward everything)."""
        with self._lock:
            self._rule = rule

    # Called from connection threads -----------------------------------------------------------------

    def _rule_for(self, request: FaultRequest) -> Fault | None:
        with self._lock:
            rule = self._rule
        fault = rule(request) if rule is not None else None
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"rule returned {fault!r}; expected one of {FAULTS} or None")
        return fault

    def _count(self, name: str) -> int:
        with self._lock:
            self.stats[name] = self.stats.get(name, 0) + 1
            return self.stats[name]

    def _track(self, sock: socket.socket, thread: threading.Thread) -> bool:
        with self._lock:
            if self._stopping:
                return False
            self._conns[sock] = thread
            return True

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.pop(sock, None)

    def _connect_upstream(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(*self._upstream_addr, timeout=60)
        with self._lock:
            self._upstreams.add(conn)
        return conn

    def _forget_upstream(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._upstreams.discard(conn)


def _check_fault(fault: str) -> None:
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")


def every_nth(n: int, fault: Fault = "503", methods: set[str] | None = None) -> Rule:
    """Fail the n-th, 2n-th, ... request this rule sees (of ``methods`` only, when given; others pass)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    _check_fault(fault)
    wanted = {m.upper() for m in methods} if methods is not None else None
    lock = threading.Lock()
    seen = 0

    def rule(request: FaultRequest) -> Fault | None:
        nonlocal seen
        if wanted is not None and request.method.upper() not in wanted:
            return None
        with lock:
            seen += 1
            return fault if seen % n == 0 else None

    return rule


def every_nth_once(n: int, fault: Fault = "503") -> Rule:
    """Fail the first attempt of the n-th, 2n-th, ... *distinct* request (method, path and query); its retries
    pass. Unlike ``every_nth``, a client whose parallel workers retry in lockstep cannot have one request land
    on the failing turn again and again."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    _check_fault(fault)
    lock = threading.Lock()
    seen: set[tuple[str, str, str]] = set()

    def rule(request: FaultRequest) -> Fault | None:
        key = (request.method.upper(), request.path, request.query)
        with lock:
            if key in seen:
                return None
            seen.add(key)
            return fault if len(seen) % n == 0 else None

    return rule


def first_n(n: int, fault: Fault = "503") -> Rule:
    """Fail the first ``n`` requests this rule sees, then forward everything."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _check_fault(fault)
    lock = threading.Lock()
    seen = 0

    def rule(request: FaultRequest) -> Fault | None:
        nonlocal seen
        with lock:
            seen += 1
            return fault if seen <= n else None

    return rule


def fraction(p: float, seed: int = 0, fault: Fault = "503") -> Rule:
    """Fail each request with probability ``p``, from a seeded generator: the k-th request this rule sees
    gets the same answer on every run."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    _check_fault(fault)
    lock = threading.Lock()
    rng = random.Random(seed)

    def rule(request: FaultRequest) -> Fault | None:
        with lock:
            return fault if rng.random() < p else None

    return rule
