"""A small HTTP/1.1 client with keep-alive connections, for S3 object requests.

Copying or verifying thousands of small objects is one request each, and on a machine whose cores are shared
with the S3 server the client's CPU per request decides the wall time. urllib3 over ``http.client`` spends
most of that CPU on machinery an S3 request does not need: ``email``-parser header parsing, a liveness poll
before every reuse, per-request timeout and URL objects. This client keeps what the wire needs:

- one ``sendall`` of the request line and headers (and the body, when small), ``TCP_NODELAY`` set;
- the status line and headers read from a buffered socket file and split by hand; bodies by
  ``Content-Length``, ``Transfer-Encoding: chunked``, or (without either) to the close of the connection;
- no body for HEAD, 1xx, 204 and 304 answers;
- connections kept for reuse (last in, first out) unless the server says ``Connection: close`` or the answer
  was not read to its end; at most ``maxsize`` idle ones are kept;
- an idle connection is checked before reuse (one zero-timeout ``select``): one the server closed, or that
  has unexpected bytes waiting, is dropped and the next idle one or a new one is used;
- TLS with certificate and host name checks when the origin is https.

There are no retries: each call sends its request once, and the caller's retry policy sees every failure, as ``WireError`` (no
complete answer; ``cause`` holds the operating system's error when there was one). Proxies are not handled
here (``proxy_for`` says when one applies); the callers use urllib3 for a proxied endpoint.
"""

from __future__ import annotations

import errno
import io
import os
import select
import socket
import ssl
import threading
from collections.abc import Iterator, Mapping
from typing import Any, cast

_MAX_LINE = 65536  # longest status or header line accepted
_MAX_HEADERS = 200
_ONE_SEND = 64 * 1024  # bodies up to this size go out in the same send as the headers
_NO_BODY_STATUS = (204, 304)


class WireError(Exception):
    """No complete answer: refused, reset, timed out, a malformed answer, or a body cut short."""

    def __init__(self, what: str, cause: BaseException | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.cause = cause


class Headers(Mapping[str, str]):
    """An answer's headers: case-insensitive lookups, the server's spelling kept for iteration. A header
    sent more than once is joined with ", " (RFC 9110's rule for list-valued fields)."""

    __slots__ = ("_by_lower", "_names")

    def __init__(self, pairs: list[tuple[str, str]] | None = None) -> None:
        self._by_lower: dict[str, str] = {}
        self._names: dict[str, str] = {}
        for name, value in pairs or ():
            low = name.lower()
            if low in self._by_lower:
                self._by_lower[low] += ", " + value
            else:
                self._by_lower[low] = value
                self._names[low] = name

    def __getitem__(self, name: str) -> str:
        return self._by_lower[name.lower()]

    def get(self, name: str, default: Any = None) -> Any:
        return self._by_lower.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_lower

    def __iter__(self) -> Iterator[str]:
        return iter(self._names.values())

    def __len__(self) -> int:
        return len(self._by_lower)

    def items(self) -> Any:
        return [(self._names[low], value) for low, value in self._by_lower.items()]

    def __repr__(self) -> str:
        return f"Headers({dict(self.items())!r})"


class Reply:
    """One complete answer: ``status``, ``reason``, ``headers`` and the whole body as ``data``."""

    __slots__ = ("data", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: Headers, data: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.data = data


class _Connection:
    __slots__ = ("reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # A buffered reader (peek, readline); typeshed types makefile with an explicit buffer size as IOBase.
        self.reader = cast(io.BufferedReader, sock.makefile("rb", buffering=65536))

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()


class Pool:
    """Keep-alive connections to one origin (``host:port``, TLS when ``https``), shared by many threads:
    each request takes an idle connection or opens one, and gives it back when the answer was read whole."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        https: bool = False,
        connect_timeout: float | None = 60.0,
        read_timeout: float | None = 60.0,
        maxsize: int = 16,
        ca_certs: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.https = https
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.maxsize = maxsize
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        if https:
            self._tls = ssl.create_default_context(cafile=ca_certs)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def request(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | bytearray | memoryview | None = None
    ) -> Reply:
        """Send one request and read its whole answer. ``headers`` must include ``Host`` when the server
        needs it and ``Content-Length`` for a body; they are sent as given, in order."""
        lines = [f"{method} {target} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn = self._take()
        try:
            reply, keep = self._exchange(conn, method, head, body)
        except BaseException:
            conn.close()
            raise
        if keep and not self._leftover(conn):
            self._give_back(conn)
        else:
            conn.close()
        return reply

    # -- connections ------------------------------------------------------------------------------------
    def _take(self) -> _Connection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._open()
            if _alive(conn):
                return conn
            conn.close()

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if len(self._idle) < self.maxsize:
                self._idle.append(conn)
                return
        conn.close()

    def _open(self) -> _Connection:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise WireError("cannot connect", exc) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.read_timeout)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except OSError as exc:  # ssl.SSLError is an OSError
            sock.close()
            raise WireError("TLS handshake failed" if isinstance(exc, ssl.SSLError) else "cannot connect", exc) from exc
        return _Connection(sock)

    def _leftover(self, conn: _Connection) -> bool:
        """Whether bytes beyond the answer are already buffered (a body sent with a HEAD or 204 answer, or
        junk): the next answer read on this connection would start with them. A zero-timeout peek returns
        buffered bytes without waiting and nothing when the socket has nothing more."""
        conn.sock.settimeout(0.0)
        try:
            return bool(conn.reader.peek(1))
        except (OSError, ValueError):  # TLS answers "want read" instead of "would block": nothing waiting
            return False
        finally:
            conn.sock.settimeout(self.read_timeout)

    # -- one exchange -----------------------------------------------------------------------------------
    def _exchange(
        self, conn: _Connection, method: str, head: bytes, body: bytes | bytearray | memoryview | None
    ) -> tuple[Reply, bool]:
        """(the answer, whether the connection may be reused)."""
        cut_short: OSError | None = None
        try:
            try:
                if body is not None and len(body) <= _ONE_SEND:
                    conn.sock.sendall(head + body)
                else:
                    conn.sock.sendall(head)
                    if body is not None:
                        conn.sock.sendall(body)
            except (BrokenPipeError, ConnectionResetError) as exc:
                # A server may answer before reading the whole body (S3's 404 NoSuchBucket, 403, 400) and
                # close; its answer is what the caller needs, so read it if it came.
                cut_short = exc
            status_line = conn.reader.readline(_MAX_LINE + 1)
            if not status_line:
                if cut_short is not None:
                    raise cut_short
                raise ConnectionResetError(errno.ECONNRESET, "the server closed the connection without answering")
            status, reason = _parse_status(status_line)
            while 100 <= status < 200:  # interim answers (100 Continue sent unasked): skip to the real one
                _read_headers(conn.reader)
                status_line = conn.reader.readline(_MAX_LINE + 1)
                status, reason = _parse_status(status_line)
            headers = _read_headers(conn.reader)
            data, whole = _read_body(conn.reader, method, status, headers)
        except TimeoutError as exc:
            raise WireError("read timed out", exc) from exc
        except OSError as exc:
            if cut_short is not None and exc is not cut_short:
                raise WireError(_oserror_name(cut_short), cut_short) from exc
            raise WireError(_oserror_name(exc), exc) from exc
        keep = cut_short is None and whole and "close" not in headers.get("Connection", "").lower()
        return Reply(status, reason, headers, data), keep


def proxy_for(scheme: str, host: str) -> str | None:
    """The proxy that requests to ``scheme://host`` go through per the environment (``https_proxy`` or
    ``http_proxy``, and ``no_proxy``, as ``urllib.request`` reads them), or None for a direct connection."""
    if not any(name.lower() == f"{scheme}_proxy" for name in os.environ):
        return None  # the common case, without importing urllib.request (~6 ms)
    import urllib.request

    proxy = urllib.request.getproxies().get(scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        return str(proxy)
    return None


def _alive(conn: _Connection) -> bool:
    """Whether an idle connection can carry a request: nothing waiting to be read on it (one the server
    closed reads as readable, at its end)."""
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _oserror_name(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _parse_status(line: bytes) -> tuple[int, str]:
    if len(line) > _MAX_LINE:
        raise WireError("status line too long")
    parts = line.rstrip(b"\r\n").split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise WireError(f"malformed status line {line[:80]!r}")
    return int(parts[1]), parts[2].decode("latin-1") if len(parts) > 2 else ""


def _read_headers(reader: Any) -> Headers:
    pairs: list[tuple[str, str]] = []
    while True:
        line = reader.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise WireError("header line too long")
        if not line:
            raise WireError("the answer ended inside its headers")
        if line in (b"\r\n", b"\n"):
            return Headers(pairs)
        name, sep, value = line.partition(b":")
        if not sep:
            raise WireError(f"malformed header line {line[:80]!r}")
        pairs.append((name.strip().decode("latin-1"), value.strip().decode("latin-1")))
        if len(pairs) > _MAX_HEADERS:
            raise WireError("too many headers")


def _read_body(reader: Any, method: str, status: int, headers: Headers) -> tuple[bytes, bool]:
    """(the body, whether the connection stays usable after it)."""
    if method == "HEAD" or status in _NO_BODY_STATUS:
        return b"", True
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        return _read_chunked(reader), True
    length = headers.get("Content-Length")
    if length is not None:
        try:
            n = int(length)
        except ValueError:
            raise WireError(f"malformed Content-Length {length[:40]!r}") from None
        if n < 0:
            raise WireError(f"malformed Content-Length {length[:40]!r}")
        data = reader.read(n)
        if len(data) != n:
            raise WireError(f"the body ended after {len(data)} of {n} bytes")
        return data, True
    return reader.read(), False  # delimited by the end of the connection


def _read_chunked(reader: Any) -> bytes:
    parts = []
    while True:
        line = reader.readline(_MAX_LINE + 1)
        if not line:
            raise WireError("the chunked body ended early")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise WireError(f"malformed chunk size {line[:40]!r}") from None
        if size == 0:
            break
        chunk = reader.read(size)
        if len(chunk) != size or reader.read(2) != b"\r\n":
            raise WireError("the chunked body ended early")
        parts.append(chunk)
    while True:  # trailer fields, up to the blank line
        line = reader.readline(_MAX_LINE + 1)
        if not line:
            raise WireError("the chunked body ended early")
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
