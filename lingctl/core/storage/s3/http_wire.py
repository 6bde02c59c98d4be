"""A small HTTP/1.1 client with keep-alive connections, for S3 object requests.

Copying or verifying thousands of small objects is one request each, and on a machine whose cores are shared
with the S3 server the client's CPU per request decides the wall time. urllib3 over ``http.client`` spends
most of that CPU on machinery an S3 request does not need: ``email``-parser header parsing, a liveness poll
before every reuse, per-request timeout and URL objects. This client keeps what the wire needs:

- one ``sendall`` of the request line and headers (and the body, when small), ``TCP_NODELAY`` set;
- the answer read by ``http_answer``: status line and headers split by hand, bodies by ``Content-Length``,
  ``Transfer-Encoding: chunked``, or (without either) to the close of the connection, every one bounded in
  size (the request's ``limit``) and time (``read_timeout`` per wait, ``low_speed_limit`` per window);
- no body for HEAD, 1xx, 204 and 304 answers;
- connections kept for reuse (last in, first out) unless the server says ``Connection: close`` or the answer
  was not read to its end; at most ``maxsize`` idle ones are kept;
- an idle connection is checked before reuse (one zero-timeout ``select``): one the server closed, or that
  has unexpected bytes waiting, is dropped and the next idle one or a new one is used;
- TLS with certificate and host name checks when the origin is https;
- an ``http://`` proxy (``proxy_for``): plain requests in absolute form, https ones through a ``CONNECT``
  tunnel, so proxied requests keep every bound. (An ``https://`` proxy needs TLS inside TLS:
  ``ProxiedPool``, over urllib3.)

There are no retries: each call sends its request once, and the caller's retry policy sees every failure, as
``WireError`` (no complete answer; ``cause`` holds the operating system's error when there was one).
"""

from __future__ import annotations

import base64
import io
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from lingctl.core.storage.s3.http_answer import (
    DEFAULT_LIMIT,
    MAX_ERROR_BODY,
    TOTAL,
    AnswerTooLarge,
    ConnectError,
    Headers,
    Limit,
    Raw,
    Reply,
    TooSlow,
    WireError,
    content_length,
    parse_status,
    read_body,
    read_chunked,
    read_head,
)

__all__ = [
    "MAX_ERROR_BODY",
    "AnswerTooLarge",
    "ConnectError",
    "Headers",
    "Pool",
    "ProxiedPool",
    "Reply",
    "TooSlow",
    "WireError",
    "certificate_failure",
    "content_length",
    "handles_proxy",
    "open_pool",
    "proxy_for",
    "read_proxied",
]

_MAX_CONNECT_HEAD = 16 * 1024  # a proxy's answer to CONNECT
_ONE_SEND = 64 * 1024  # bodies up to this size go out in the same send as the headers; larger ones in pieces
_BUFFER = 65536


class _Connection:
    __slots__ = ("raw", "reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.raw = Raw(sock)
        self.reader = io.BufferedReader(self.raw, _BUFFER)

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()


class Pool:
    """Keep-alive connections to one origin (``host:port``, TLS when ``https``), shared by many threads:
    each request takes an idle connection or opens one, and gives it back when the answer was read whole.

    ``connect_timeout`` bounds a connect (and the proxy's ``CONNECT``), ``read_timeout`` every wait for a
    byte (and the TLS handshake), ``low_speed_limit`` (bytes/s, 0: off) the average rate of an answer over
    each ``read_timeout`` window. ``proxy``: an ``http://[user:password@]host:port`` proxy, or None."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        https: bool = False,
        connect_timeout: float | None = 10.0,
        read_timeout: float | None = 60.0,
        low_speed_limit: int = 1024,
        maxsize: int = 16,
        ca_certs: str | None = None,
        proxy: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.https = https
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.low_speed_limit = low_speed_limit
        self.maxsize = maxsize
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        if https:
            self._tls = ssl.create_default_context(cafile=ca_certs)
        window = read_timeout if read_timeout and low_speed_limit > 0 else 0.0
        self._pace = (window, int(low_speed_limit * window))  # the low-speed rule (``Raw``)
        self._proxy: tuple[str, int, str | None] | None = _parse_proxy(proxy) if proxy else None
        # Through an http proxy a plain request names the whole URL; an https one goes through a tunnel.
        self._absolute = f"http://{_authority(host, port, 80)}" if self._proxy and not https else ""

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | bytearray | memoryview | None = None,
        *,
        limit: Limit = DEFAULT_LIMIT,
        slow_answer_s: float | None = None,
    ) -> Reply:
        """Send one request and read its whole answer. ``headers`` must include ``Host`` when the server
        needs it and ``Content-Length`` for a body; they are sent as given, in order. ``limit``: the most
        body bytes this request can need (a function of status and headers when that depends on the answer);
        a larger body is ``AnswerTooLarge``. ``slow_answer_s``: for an answer that may rightly trickle (S3
        keeps a long CompleteMultipartUpload alive by sending a space now and then), a bound on its whole
        time in place of the low-speed rule."""
        lines = [f"{method} {self._absolute}{target} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if self._proxy is not None and self._proxy[2] is not None and not self.https:
            lines.append(f"Proxy-Authorization: {self._proxy[2]}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn = self._take()
        try:
            pace = self._pace if slow_answer_s is None else (slow_answer_s, TOTAL)
            reply, keep = self._exchange(conn, method, head, body, limit, pace)
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
        where = (self._proxy[0], self._proxy[1]) if self._proxy is not None else (self.host, self.port)
        try:
            sock = socket.create_connection(where, timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise ConnectError("connect timed out", exc) from exc
        except OSError as exc:
            raise ConnectError("cannot connect", exc) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._proxy is not None and self.https:
                self._tunnel(sock)
            sock.settimeout(self.read_timeout)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except OSError as exc:  # ssl.SSLError is an OSError
            sock.close()
            if isinstance(exc, ssl.SSLCertVerificationError):
                raise ConnectError(f"TLS certificate verification failed: {exc.verify_message}", exc) from exc
            raise ConnectError(
                "TLS handshake failed" if isinstance(exc, ssl.SSLError) else "cannot connect", exc
            ) from exc
        except BaseException:
            sock.close()
            raise
        return _Connection(sock)

    def _tunnel(self, sock: socket.socket) -> None:
        """Ask the proxy for a tunnel to the origin (``CONNECT``), within the connect timeout; TLS to the
        origin then runs inside it, so the proxy sees neither the requests nor the certificate check."""
        assert self._proxy is not None
        authority = _authority(self.host, self.port, 443)
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if self._proxy[2] is not None:
            lines.append(f"Proxy-Authorization: {self._proxy[2]}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        # Read byte-wise up to the blank line: the TLS handshake that follows must find nothing buffered.
        head = bytearray()
        deadline = time.monotonic() + (self.connect_timeout or 60.0)
        while not head.endswith(b"\n\r\n") and not head.endswith(b"\n\n"):
            if len(head) > _MAX_CONNECT_HEAD or time.monotonic() > deadline:
                raise ConnectError("the proxy's answer to CONNECT is too long or too slow")
            byte = sock.recv(1)
            if not byte:
                raise ConnectError("the proxy closed the connection during CONNECT")
            head += byte
        status, _ = parse_status(bytes(head.split(b"\n", 1)[0]) + b"\n")
        if not 200 <= status < 300:
            raise ConnectError(f"the proxy refused the tunnel to {authority} (HTTP {status})")

    def _leftover(self, conn: _Connection) -> bool:
        """Whether bytes beyond the answer are already buffered (a body sent with a HEAD or 204 answer, or
        junk): the next answer read on this connection would start with them. A zero-timeout peek returns
        buffered bytes without waiting and nothing when the socket has nothing more."""
        conn.sock.settimeout(0.0)
        conn.raw.window = 0.0
        try:
            return bool(conn.reader.peek(1))
        except (OSError, ValueError):  # TLS answers "want read" instead of "would block": nothing waiting
            return False
        finally:
            conn.sock.settimeout(self.read_timeout)

    # -- one exchange -----------------------------------------------------------------------------------
    def _exchange(
        self,
        conn: _Connection,
        method: str,
        head: bytes,
        body: bytes | bytearray | memoryview | None,
        limit: Limit,
        pace: tuple[float, int],
    ) -> tuple[Reply, bool]:
        """(the answer, whether the connection may be reused)."""
        cut_short: OSError | None = None
        try:
            try:
                if body is None:
                    conn.sock.sendall(head)
                else:
                    _send_with_body(conn.sock, head, body)
            except (BrokenPipeError, ConnectionResetError) as exc:
                # A server may answer before reading the whole body (S3's 404 NoSuchBucket, 403, 400) and
                # close; its answer is what the caller needs, so read it if it came.
                cut_short = exc
            # The low-speed window starts once the request is out: a slow upload is not a slow answer.
            raw = conn.raw  # armed here rather than by a method: this runs for every request
            raw.window, raw.need = pace
            raw.start, raw.got = time.monotonic(), 0
            status, reason, headers = read_head(conn.reader, cut_short)
            if status >= 300:
                cap = MAX_ERROR_BODY
            else:
                cap = limit if isinstance(limit, int) else limit(status, headers)
            data, whole = read_body(conn.reader, method, status, headers, cap)
        except TimeoutError as exc:
            raise WireError("read timed out", exc) from exc
        except OSError as exc:
            if cut_short is not None and exc is not cut_short:
                raise WireError(_oserror_name(cut_short), cut_short) from exc
            raise WireError(_oserror_name(exc), exc) from exc
        keep = cut_short is None and whole and "close" not in headers.get("Connection", "").lower()
        return Reply(status, reason, headers, data), keep


class ProxiedPool:
    """``Pool``'s interface over urllib3, for an ``https://`` proxy (TLS to the proxy, and inside it TLS to
    the origin), which ``Pool`` does not speak. Bodies keep their limits (``read_proxied``); what urllib3
    and ``http.client`` bound themselves, and what they do not, is in docs/storage.md."""

    def __init__(
        self,
        origin: str,
        proxy: str,
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
        maxsize: int,
        ca_certs: str | None,
    ) -> None:
        import urllib3

        timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self._manager = urllib3.ProxyManager(proxy, num_pools=1, maxsize=maxsize, timeout=timeout, ca_certs=ca_certs)
        self._origin = origin
        # An http origin goes through the proxy as an absolute URL; an https one through a tunnel, on the
        # pool itself with a path target (urllib3's URL parser would drop "." and ".." key segments).
        self._absolute = origin.startswith("http://")
        self._pool = self._manager.connection_from_url(origin)

    def close(self) -> None:
        self._manager.clear()

    def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | bytearray | memoryview | None = None,
        *,
        limit: Limit = DEFAULT_LIMIT,
        slow_answer_s: float | None = None,
    ) -> Reply:
        import urllib3

        options: dict[str, Any] = {"body": body, "headers": dict(headers), "retries": False, "redirect": False}
        options.update(decode_content=False, preload_content=False)
        try:
            if self._absolute:
                resp = self._manager.urlopen(method, self._origin + target, **options)
            else:
                resp = self._pool.urlopen(method, target, assert_same_host=False, **options)
            return read_proxied(resp, limit)
        except urllib3.exceptions.HTTPError as exc:
            connect = (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError)
            kind = ConnectError if isinstance(exc, (*connect, urllib3.exceptions.ProxyError)) else WireError
            raise kind(_describe_urllib3(exc), exc) from exc


def open_pool(
    origin: str,
    *,
    connect_timeout: float | None,
    read_timeout: float | None,
    low_speed_limit: int,
    maxsize: int,
    ca_certs: str | None,
) -> Pool | ProxiedPool:
    """A pool for ``origin`` (``scheme://host[:port]``): direct, or through the proxy the environment names
    for it (``proxy_for``); urllib3's only for an ``https://`` proxy."""
    parts = urlsplit(origin)
    https = parts.scheme == "https"
    proxy = proxy_for(parts.scheme, parts.hostname or "")
    if proxy and not handles_proxy(proxy):
        return ProxiedPool(
            origin,
            proxy,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            maxsize=maxsize,
            ca_certs=ca_certs,
        )
    return Pool(
        parts.hostname or "",
        parts.port or (443 if https else 80),
        https=https,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        low_speed_limit=low_speed_limit,
        maxsize=maxsize,
        ca_certs=ca_certs,
        proxy=proxy,
    )


def _describe_urllib3(exc: Exception) -> str:
    """What went wrong in words, without the URL: urllib3's error class and the operating system's reason,
    e.g. "ProtocolError (Connection reset by peer)"."""
    cause = next((a for a in exc.args if isinstance(a, BaseException)), None) or exc.__cause__ or exc.__context__
    if isinstance(cause, OSError) and cause.strerror:
        return f"{type(exc).__name__} ({cause.strerror})"
    return f"{type(exc).__name__} ({type(cause).__name__})" if cause is not None else type(exc).__name__


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


def handles_proxy(proxy: str) -> bool:
    """Whether ``Pool`` can go through this proxy: an ``http://`` one (or one given without a scheme, which
    means http). An ``https://`` proxy needs TLS inside TLS, which ``ProxiedPool`` leaves to urllib3."""
    scheme = proxy.partition("://")[0].lower() if "://" in proxy else "http"
    return scheme == "http"


def certificate_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind ``exc`` (this module's, urllib3's or botocore's
    wrapping of it), or None: a failure that retrying cannot fix."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen or len(seen) > 20:
            continue
        if isinstance(e, ssl.SSLCertVerificationError):
            return e
        seen.add(id(e))
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None), getattr(e, "reason", None), *e.args]
        todo += list(getattr(e, "kwargs", {}).values())  # botocore keeps the wrapped error in kwargs
    return None


def read_proxied(resp: Any, limit: Limit) -> Reply:
    """The answer of a urllib3 request sent with ``preload_content=False``, read within ``limit`` (error
    answers within ``MAX_ERROR_BODY``): a declared length over it is refused before reading, and at most
    one byte past it is read. A chunked body is decoded here, from the connection's own reader, with this
    module's checks (urllib3 would take a chunk size of -1 as "to the end of the connection"); that
    connection is then not reused. Others go back to urllib3's pool after a whole answer."""
    reuse = False
    try:
        if resp.status >= 300:
            cap = MAX_ERROR_BODY
        else:
            cap = limit if isinstance(limit, int) else limit(resp.status, resp.headers)
        coding = resp.headers.get("Transfer-Encoding")
        fp = getattr(getattr(resp, "_fp", None), "fp", None)  # http.client's reader, as urllib3 reads chunks
        if coding is not None and coding.rpartition(",")[2].strip().lower() == "chunked" and fp is not None:
            return Reply(resp.status, resp.reason or "", resp.headers, read_chunked(fp, cap))
        declared = resp.headers.get("Content-Length")
        if declared is not None and coding is None and content_length(declared) > cap:
            raise AnswerTooLarge(
                f"the answer declares a body of {declared} bytes, more than the {cap} this request can need", cap
            )
        data = resp.read(cap + 1)
        if len(data) > cap:
            raise AnswerTooLarge(f"the answer's body runs past the {cap} bytes this request can need", cap)
        reuse = True
        return Reply(resp.status, resp.reason or "", resp.headers, data)
    finally:
        if reuse:
            resp.release_conn()
        else:
            resp.close()  # never reused: the rest of the answer may still be on the wire


def _parse_proxy(url: str) -> tuple[str, int, str | None]:
    """(host, port, Proxy-Authorization value or None) of an ``http://[user:password@]host[:port]`` proxy."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme.lower() != "http" or not parts.hostname:
        raise ValueError("only http:// proxies are handled here")
    auth = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return parts.hostname, parts.port or 80, auth


def _authority(host: str, port: int, default: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == default else f"{shown}:{port}"


def _send_with_body(sock: socket.socket, head: bytes, body: bytes | bytearray | memoryview) -> None:
    view = memoryview(body).cast("B")
    if len(view) <= _ONE_SEND:
        sock.sendall(head + view)
        return
    sock.sendall(head)
    # In pieces: on a plain socket one sendall must finish within the socket timeout as a whole, which would
    # fail a large body on a slow link; per piece the timeout is an idle bound (a piece per read_timeout).
    for i in range(0, len(view), _ONE_SEND):
        sock.sendall(view[i : i + _ONE_SEND])


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
