"""One HTTP/1.1 answer read from a connection, bounded in size and time whatever the server sends.

The server may be broken, hostile, or a man in the middle on plain http; nothing it sends may cost more
memory than the request can need, or keep a request going for ever:

- **size**: each request says how many body bytes it can need (``limit``: the range asked for, the object's
  known size, a few MiB for XML); error answers (status 300 and up) get at most ``MAX_ERROR_BODY``. A body
  declared larger is refused before it is read; a chunked or close-delimited one is counted as it arrives and
  refused as soon as it passes the limit (``AnswerTooLarge``). The head is at most ``_MAX_HEAD`` bytes
  (S3's are a few KiB) in lines of at most ``_MAX_LINE``; at most ``_MAX_INTERIM`` interim 1xx answers and
  ``_MAX_HEADERS`` trailer lines are read. ``Content-Length`` and chunk sizes must be plain digits: a sign,
  ``0x``, ``_`` or a conflicting duplicate is a malformed answer.
- **time**: every ``recv`` goes through ``Raw.readinto``, under the C buffered reader (so the fast paths stay
  in C): while a request is armed, an answer that brings fewer than ``need`` bytes in a window of ``window``
  seconds is cut (curl's ``--speed-limit``/``--speed-time``). The socket's own timeout bounds each wait for a
  byte. Together they bound a trickle, a head that never ends, endless trailers and endless interim answers.

Anything out of bounds is a ``WireError``; the caller then drops the connection.
"""

from __future__ import annotations

import errno
import io
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from lingctl.core.storage.url import server_words

_MAX_LINE = 65536  # longest status, header, chunk-size or trailer line accepted
_MAX_HEADERS = 200  # header lines of one answer; also the most trailer lines after a chunked body
_MAX_HEAD = 256 * 1024  # status line and headers together; S3's answers carry a few KiB
_MAX_INTERIM = 16  # 1xx answers before the real one (S3 sends at most one 100 Continue)
_NO_BODY_STATUS = (204, 304)
_HEX_RE = re.compile(rb"[0-9A-Fa-f]{1,15}")  # 15 hex digits: beyond any limit, and never negative

MAX_ERROR_BODY = 1 << 20  # an error answer's body (S3's error XML is under 1 KiB)
DEFAULT_LIMIT = 1 << 20  # the body limit of a request that names none
_monotonic = time.monotonic  # looked up once: it runs on every recv
TOTAL = 1 << 62  # as ``Raw.need``: no rate, only a bound on the whole answer's time
# A request's body limit: bytes, or a function of the answer's status and headers (a ranged GET may get
# the whole object from a server that ignores Range, and needs another bound for that answer).
Limit = int | Callable[[int, "Headers"], int]


class WireError(Exception):
    """No complete answer: refused, reset, timed out, a malformed answer, or a body cut short."""

    def __init__(self, what: str, cause: BaseException | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.cause = cause


class ConnectError(WireError):
    """No connection to send the request on: refused, unreachable, timed out, or TLS (or a proxy tunnel)
    could not be set up. Nothing was sent."""


class AnswerTooLarge(WireError):
    """The answer declared, or sent, a body larger than the request can need; nothing more of it is read."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(what)
        self.limit = limit


class TooSlow(WireError):
    """The answer arrived slower than the low-speed limit over a whole window."""


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


def _shown(text: str | bytes, limit: int) -> str:
    """A piece of what the server sent, quoted for a message: redacted (a server may echo credentials
    back), then cut to ``limit`` characters."""
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    return repr(server_words(text, limit))


def content_length(value: str) -> int:
    """A ``Content-Length`` value as a number: ASCII digits only (``int()`` would also take a sign, ``_`` and
    other scripts' digits); repeated equal values (``"5, 5"``) are one, conflicting ones a ``WireError``."""
    if value.isdigit() and value.isascii() and len(value) <= 18:  # the usual case, one plain number
        return int(value)
    text = value.strip()
    if "," in text:
        values = {v.strip() for v in text.split(",")}
        if len(values) != 1:
            raise WireError(f"conflicting Content-Length values {_shown(value, 60)}")
        text = values.pop()
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise WireError(f"malformed Content-Length {_shown(value, 40)}")
    return int(text)


class Raw(io.RawIOBase):
    """The socket under a connection's buffered reader, with the low-speed rule: while armed, every ``recv``
    counts its bytes, and a window of ``window`` seconds that brought fewer than ``need`` ends the answer.
    (It replaces ``socket.SocketIO``, whose ``readinto`` is Python code too, so the check is nearly free.)"""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        # Armed for each answer by the connection's owner: at least ``need`` bytes in every ``window``
        # seconds from ``start`` (``need=TOTAL``: the answer must be over within ``window`` seconds).
        self.window = 0.0  # seconds; 0: not armed
        self.need = 0
        self.start = 0.0
        self.got = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        try:
            n = self.sock.recv_into(b)
        except BlockingIOError:
            return None  # a zero-timeout peek found nothing waiting
        if self.window:
            self.got += n
            if _monotonic() - self.start >= self.window:
                self._next_window()
        return n

    def _next_window(self) -> None:
        """A window is over: the answer brought enough in it (start the next), or it is cut."""
        now = _monotonic()
        if self.need == TOTAL:
            raise TooSlow(f"the answer took longer than {self.window:g} s")
        if self.got < self.need:
            raise TooSlow(
                f"the answer is too slow: {self.got} bytes in {now - self.start:.1f} s "
                f"(the low-speed limit is {self.need / self.window:.0f} bytes/s)"
            )
        self.start, self.got = now, 0


def parse_status(line: bytes) -> tuple[int, str]:
    if len(line) > _MAX_LINE:
        raise WireError("status line too long")
    parts = line.rstrip(b"\r\n").split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise WireError(f"malformed status line {_shown(line, 80)}")
    return int(parts[1]), parts[2].decode("latin-1") if len(parts) > 2 else ""


def read_head(reader: io.BufferedReader[Any], cut_short: OSError | None) -> tuple[int, str, Headers]:
    """The status and headers of the real answer, past at most ``_MAX_INTERIM`` 1xx answers. Each
    ``readline`` may wait for the rest of a line, but never past the idle timeout or the low-speed rule
    (``Raw``); lines, and the head as a whole, are bounded here."""
    interim = 0
    while True:
        line = reader.readline(_MAX_LINE + 1)
        if not line:
            if cut_short is not None and not interim:
                raise cut_short
            raise ConnectionResetError(errno.ECONNRESET, "the server closed the connection without answering")
        status, reason = parse_status(line)
        headers = _read_headers(reader)
        if not 100 <= status < 200:  # 1xx: interim answers (100 Continue sent unasked); the real one follows
            return status, reason, headers
        interim += 1
        if interim > _MAX_INTERIM:
            raise WireError(f"more than {_MAX_INTERIM} interim (1xx) answers")


def _read_headers(reader: io.BufferedReader[Any]) -> Headers:
    pairs: list[tuple[str, str]] = []
    size = 0
    while True:
        line = reader.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise WireError("header line too long")
        if not line:  # (a last line without its newline is taken, and this comes next)
            raise WireError("the answer ended inside its headers")
        if line in (b"\r\n", b"\n"):
            return Headers(pairs)
        name, sep, value = line.partition(b":")
        if not sep:
            raise WireError(f"malformed header line {_shown(line, 80)}")
        pairs.append((name.strip().decode("latin-1"), value.strip().decode("latin-1")))
        size += len(line)
        if size > _MAX_HEAD or len(pairs) > _MAX_HEADERS:
            raise WireError(f"the answer's headers are longer than {_MAX_HEAD} bytes or {_MAX_HEADERS} lines")


def read_body(
    reader: io.BufferedReader[Any], method: str, status: int, headers: Headers, cap: int
) -> tuple[bytes, bool]:
    """(the body, whether the connection stays usable after it), at most ``cap`` bytes of it."""
    if method == "HEAD" or status in _NO_BODY_STATUS:
        return b"", True
    coding = headers.get("Transfer-Encoding")
    if coding is not None:  # it overrides any Content-Length (RFC 9112, 6.3)
        if coding.rpartition(",")[2].strip().lower() == "chunked":
            return read_chunked(reader, cap), True
        return _read_to_close(reader, cap), False
    length = headers.get("Content-Length")
    if length is None:
        return _read_to_close(reader, cap), False
    # int() alone would take "+5", "1_0" or other scripts' digits (and refuse 5,000 of them with a
    # ValueError); the usual plain number skips the call.
    n = int(length) if length.isdigit() and length.isascii() and len(length) < 19 else content_length(length)
    if n > cap:
        raise AnswerTooLarge(f"the answer declares a body of {n} bytes, more than the {cap} this request can need", cap)
    data = reader.read(n)
    if len(data) != n:
        raise WireError(f"the body ended after {len(data)} of {n} bytes")
    return data, True


def _read_to_close(reader: io.BufferedReader[Any], cap: int) -> bytes:
    data = reader.read(cap + 1)  # up to the end of the connection, or one byte past the limit
    if len(data) > cap:
        raise AnswerTooLarge(f"the answer's body runs past the {cap} bytes this request can need", cap)
    return data


def read_chunked(reader: io.BufferedReader[Any], cap: int) -> bytes:
    parts = []
    total = 0
    while True:
        line = reader.readline(_MAX_LINE + 1)
        if not line.endswith(b"\n"):
            raise WireError("the chunked body ended early" if len(line) <= _MAX_LINE else "chunk size line too long")
        size_text = line.split(b";", 1)[0].strip()
        if _HEX_RE.fullmatch(size_text) is None:
            raise WireError(f"malformed chunk size {_shown(line, 40)}")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > cap:
            raise AnswerTooLarge(f"the chunked body runs past the {cap} bytes this request can need", cap)
        chunk = reader.read(size)
        if len(chunk) != size or reader.read(2) != b"\r\n":
            raise WireError("the chunked body ended early")
        parts.append(chunk)
    for _ in range(_MAX_HEADERS + 1):  # trailer fields, up to the blank line
        line = reader.readline(_MAX_LINE + 1)
        if not line.endswith(b"\n"):
            raise WireError("the chunked body ended early" if len(line) <= _MAX_LINE else "trailer line too long")
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
    raise WireError(f"more than {_MAX_HEADERS} trailer lines")
