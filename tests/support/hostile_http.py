"""A scripted, hostile HTTP/1.1 server on 127.0.0.1: answers no sane server sends (bodies of a GiB, endless
chunks, a byte a second, endless interim answers, echoed credentials), for testing that a client stays
bounded in memory and time whatever a server, or a man in the middle, does.

Every connection is served by its own thread, which reads each request (request line, headers, a
Content-Length body) and hands it to the ``script``; the script writes whatever it likes through a ``Wire``,
which counts the bytes the client took, paces them as the script says, and notices when the client has gone.
The script returns whether to read another request on the connection.

    with HostileServer(endless_body(b"HTTP/1.1 200 OK\\r\\nContent-Length: 1073741824\\r\\n\\r\\n")) as server:
        ...  # a client GETs from server.endpoint; server.sent says how much of the GiB it took

``fake_s3`` routes the requests of an S3 client (bucket check, ListObjectsV2, HEAD, GET, PUT) to scripts, so
whole ``lingctl`` commands can run against one hostile operation. ``stop()`` (or leaving the ``with``)
wakes every thread (the stop event for pacing scripts, a shutdown for blocked sockets) and joins it.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

WAIT_S = 10.0  # upper bound on any wait in a test; reached only when something is wrong
BLOCK = 64 * 1024


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]  # names lower-cased; the last value of a repeated name
    body: bytes
    number: int  # 1-based, in order of arrival over all connections

    @property
    def path(self) -> str:
        return unquote(urlsplit(self.target).path)

    @property
    def query(self) -> dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(urlsplit(self.target).query, keep_blank_values=True).items()}


class Wire:
    """One connection as a script sees it: ``send`` counts what the client took and is False once the client
    has gone; ``pause`` waits (ending early when the server stops)."""

    def __init__(self, sock: socket.socket, server: HostileServer) -> None:
        self.sock = sock
        self.server = server

    def send(self, data: bytes) -> bool:
        if self.server.stopping.is_set():
            return False
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        self.server.count(len(data))
        return True

    def pause(self, seconds: float) -> bool:
        return not self.server.stopping.wait(seconds)

    def stream(self, blocks: Iterator[bytes]) -> None:
        """Send block after block until the blocks end, the client goes away or the server stops."""
        for block in blocks:
            if not self.send(block):
                return

    def trickle(self, data: bytes, every_s: float) -> None:
        """``data`` one byte per ``every_s`` seconds."""
        for i in range(len(data)):
            if not self.send(data[i : i + 1]) or not self.pause(every_s):
                return


Script = Callable[[Request, Wire], bool]


class HostileServer:
    def __init__(self, script: Script, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.requests: list[Request] = []
        self.sent = 0  # bytes clients took, over all connections
        self.connections = 0
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self._start(self._accept_loop)

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self, n: int) -> None:
        with self.changed:
            self.sent += n
            self.changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout), "the server did not get there in time"

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
            self._start(self._serve, sock)

    def _serve(self, sock: socket.socket) -> None:
        try:
            if self.tls is not None:
                # The wrapped socket takes over the file descriptor: it is the one stop() must shut down.
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                with self.changed:
                    self._socks.append(sock)
                sock.do_handshake()
            reader = sock.makefile("rb")
            while (request := self._read_request(reader)) is not None:
                if not self.script(request, Wire(sock, self)):
                    break
        except OSError:
            pass  # the client went away (or refused the certificate), or the test ended
        finally:
            sock.close()

    def _read_request(self, reader: Any) -> Request | None:
        line = reader.readline()
        if not line:
            return None
        method, target, _ = line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while (header := reader.readline()) not in (b"\r\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = reader.read(length) if length else b""
        with self.changed:
            request = Request(method, target, headers, body, len(self.requests) + 1)
            self.requests.append(request)
            self.changed.notify_all()
        return request

    def stop(self) -> None:
        self.stopping.set()
        with self.changed:
            socks, threads = list(self._socks), list(self._threads)
        for sock in [self.listener, *socks]:  # shutdown wakes a thread blocked in accept, recv or send
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.listener.close()
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), "a server thread did not stop"


# -- scripts -----------------------------------------------------------------------------------------------


def head(status: str = "200 OK", *headers: str, version: str = "HTTP/1.1") -> bytes:
    return f"{version} {status}\r\n{''.join(h + chr(13) + chr(10) for h in headers)}\r\n".encode("latin-1")


def zeros(total: int | None = None) -> Iterator[bytes]:
    """Blocks of zero bytes: ``total`` of them, or for ever."""
    sent = 0
    block = bytes(BLOCK)
    while total is None or sent < total:
        piece = block if total is None else block[: total - sent]
        sent += len(piece)
        yield piece


def answer(raw: bytes, *, keep: bool = True) -> Script:
    def script(request: Request, wire: Wire) -> bool:
        return wire.send(raw) and keep

    return script


def endless_body(raw_head: bytes) -> Script:
    """``raw_head``, then zeros until the client goes away."""

    def script(request: Request, wire: Wire) -> bool:
        if wire.send(raw_head):
            wire.stream(zeros())
        return False

    return script


def forever(block: bytes) -> Iterator[bytes]:
    return iter(lambda: block, None)


def chunked_forever(status: str = "200 OK") -> Script:
    """A chunked body whose chunks never end."""
    chunk = b"%x\r\n" % BLOCK + bytes(BLOCK) + b"\r\n"

    def script(request: Request, wire: Wire) -> bool:
        if wire.send(head(status, "Transfer-Encoding: chunked")):
            wire.stream(forever(chunk))
        return False

    return script


def endless_head(line: bytes) -> Script:
    """A status line, then ``line`` for ever: header lines that never end, or one line that never ends."""

    def script(request: Request, wire: Wire) -> bool:
        if wire.send(b"HTTP/1.1 200 OK\r\n"):
            wire.stream(forever(line))
        return False

    return script


def trickled(raw: bytes, every_s: float) -> Script:
    """``raw``, one byte per ``every_s`` seconds."""

    def script(request: Request, wire: Wire) -> bool:
        wire.trickle(raw, every_s)
        return False

    return script


def interim_forever() -> Script:
    """``100 Continue`` answers, and never the real one."""

    def script(request: Request, wire: Wire) -> bool:
        wire.stream(forever(b"HTTP/1.1 100 Continue\r\n\r\n"))
        return False

    return script


def trailers_forever() -> Script:
    """A chunked body that ends, then trailer lines that do not."""

    def script(request: Request, wire: Wire) -> bool:
        if wire.send(head("200 OK", "Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n"):
            wire.stream(forever(b"X-Trailer: more\r\n" * 64))
        return False

    return script


# -- a fake S3 ---------------------------------------------------------------------------------------------


@dataclass
class FakeObject:
    size: int
    etag: str = "0123456789abcdef0123456789abcdef"
    modified: str = "2024-01-02T03:04:05.000Z"


@dataclass
class FakeS3:
    """Routes an S3 client's requests on one bucket to scripts. By default: the bucket exists, listings show
    ``objects`` (one page), HEAD answers their size, GET sends ``size`` zero bytes, PUT answers 200; any of
    ``on_list``, ``on_head``, ``on_get``, ``on_put`` replaces that operation."""

    bucket: str
    objects: dict[str, FakeObject] = field(default_factory=dict)
    on_list: Script | None = None
    on_head: Script | None = None
    on_get: Script | None = None
    on_put: Script | None = None

    def __call__(self, request: Request, wire: Wire) -> bool:
        path = request.path.lstrip("/")
        bucket, _, key = path.partition("/")
        if bucket != self.bucket:
            return wire.send(error(404, "NoSuchBucket", "no such bucket"))
        if not key:
            if request.method == "HEAD":
                return wire.send(head("200 OK", "Content-Length: 0"))
            return (self.on_list or self.list_page)(request, wire)
        script = {"HEAD": self.on_head, "GET": self.on_get, "PUT": self.on_put}.get(request.method)
        if script is not None:
            return script(request, wire)
        obj = self.objects.get(key)
        if request.method == "PUT":
            return wire.send(head("200 OK", 'ETag: "0"', "Content-Length: 0"))
        if obj is None:
            return wire.send(error(404, "NoSuchKey", "no such key"))
        if request.method == "HEAD":
            return wire.send(object_head(obj))
        return wire.send(object_head(obj) + bytes(obj.size))

    def list_page(self, request: Request, wire: Wire, *, token: str | None = None) -> bool:
        return wire.send(list_page(self.objects, truncated_with=token))


def object_head(obj: FakeObject) -> bytes:
    return head(
        "200 OK",
        f"Content-Length: {obj.size}",
        f'ETag: "{obj.etag}"',
        "Last-Modified: Tue, 02 Jan 2024 03:04:05 GMT",
    )


def list_page(objects: dict[str, FakeObject], *, truncated_with: str | None = None) -> bytes:
    """A ListObjectsV2 answer (url-encoded keys, as asked for) listing ``objects``; truncated, with that next
    continuation token, when ``truncated_with`` is set."""
    contents = "".join(
        f"<Contents><Key>{key}</Key><LastModified>{o.modified}</LastModified><ETag>&quot;{o.etag}&quot;</ETag>"
        f"<Size>{o.size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
        for key, o in sorted(objects.items())
    )
    more = f"<NextContinuationToken>{truncated_with}</NextContinuationToken>" if truncated_with else ""
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>b</Name><Prefix></Prefix><MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter><EncodingType>url</EncodingType>"
        f"<IsTruncated>{'true' if truncated_with else 'false'}</IsTruncated>{more}{contents}</ListBucketResult>"
    ).encode()
    return head("200 OK", "Content-Type: application/xml", f"Content-Length: {len(xml)}") + xml


def error(status: int, code: str, message: str, *extra: str) -> bytes:
    xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
    body = xml.encode()
    return head(f"{status} Error", *extra, f"Content-Length: {len(body)}") + body


# -- a proxy -----------------------------------------------------------------------------------------------


def proxy(refuse: bytes | None = None) -> Script:
    """An http proxy: a ``CONNECT host:port`` becomes a tunnel (bytes relayed both ways until either side
    closes), unless ``refuse`` is the answer to send instead; a request in absolute form is answered by
    itself, echoing the target it got in ``X-Target`` (and any ``Proxy-Authorization`` in ``X-Auth``)."""

    def script(request: Request, wire: Wire) -> bool:
        if request.method != "CONNECT":
            echo = (f"X-Target: {request.target}", f"X-Auth: {request.headers.get('proxy-authorization', '')}")
            return wire.send(head("200 OK", *echo, "Content-Length: 2") + b"ok")
        if refuse is not None:
            return wire.send(refuse) and False
        host, _, port = request.target.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as upstream:
            if not wire.send(b"HTTP/1.1 200 Connection established\r\n\r\n"):
                return False
            relay = threading.Thread(target=_pipe, args=(upstream, wire.sock), daemon=True)
            relay.start()
            _pipe(wire.sock, upstream)
            relay.join(WAIT_S)
        return False

    return script


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(BLOCK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
