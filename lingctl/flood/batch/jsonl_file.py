"""The append-only JSONL files that flood writes and resumes (``flood run``'s output and errors files, an
evaluation's journal), and the rules that keep a resume from writing into a file that is not its own.

A resume finds its files by name, beside a manifest that is plain data: whoever can write the directory can
copy a real manifest there (it holds no secret) and plant a link or another file under the output's name. So:

- **Open.** Never through a link (``O_NOFOLLOW``), never blocking on a FIFO (``O_NONBLOCK``), created with
  ``O_EXCL``. The file is looked at before it is opened (``lstat``) and the open file itself again
  (``fstat``, the same inode): a regular file, owned by this user, and, when it will be written, with one
  name (through a second hard link an append or a cut would change a file known under another name).
  Anything else is refused as an output lingctl did not write (``UsageError``, exit 2: the next step is to
  choose another ``-o``) before a byte is read, written or cut.
- **Prove.** The manifest records how many bytes lingctl wrote to each file and their sha256 (``Written``):
  after the first line, then at each fsync (at most every ``FSYNC_EVERY_S``) and at close, always after the
  data is on disk, so the record never claims more than the disk holds. A resume hashes the recorded bytes
  while it reads them (no second pass) and refuses a file whose bytes differ (``VerificationError``, exit 4).
- **Cut.** Only a torn last line past the recorded bytes: what a crash leaves. A file with content and no
  recorded bytes is refused whole, since lingctl cannot show that it wrote any of it.

Whole lines past the recorded bytes were written in the seconds before a crash; they are kept and counted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lingctl.core.errors import UsageError, VerificationError, os_error
from lingctl.core.jsonl import BadLine, parse_object

log = logging.getLogger(__name__)

FSYNC_EVERY_S = 2.0
# O_NONBLOCK: a FIFO at the name fails or returns at once instead of waiting for a writer; regular files
# ignore it.
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | os.O_NOCTTY
_NOT_OURS_HINT = "choose another -o, or move it away"
_UNPROVEN_HINT = "move it away (or remove it) and run again"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_BLANK: dict[str, Any] = {}  # the record of a blank line: kept, answers nothing


@dataclass(frozen=True, slots=True)
class Written:
    """What lingctl wrote to a file so far: its first ``size`` bytes, with that sha256."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256}

    @staticmethod
    def from_json(value: Any) -> Written | None:
        """The record saved in a manifest; None when there is none (a manifest is data: a malformed record is
        no record)."""
        if not isinstance(value, dict):
            return None
        size, digest = value.get("bytes"), value.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        if not isinstance(digest, str) or _SHA256_HEX.fullmatch(digest) is None:
            return None
        return Written(size, digest)

    @staticmethod
    def of(data: bytes) -> Written:
        return Written(len(data), hashlib.sha256(data).hexdigest())


# -- opening ---------------------------------------------------------------------------------------------
def _check(path: Path, st: os.stat_result, *, sole_link: bool) -> None:
    """Refuse what is not a regular file of this user (with one name, when ``sole_link``)."""
    if stat.S_ISLNK(st.st_mode):
        raise _a_link(path)
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path} is not a regular file, so lingctl did not write it", hint=_NOT_OURS_HINT)
    # The effective uid: the owner the kernel gives the files this process creates.
    if st.st_uid != os.geteuid():
        raise UsageError(
            f"{path} belongs to uid {st.st_uid}, not to uid {os.geteuid()}, so lingctl did not write it",
            hint=_NOT_OURS_HINT,
        )
    if sole_link and st.st_nlink != 1:
        raise UsageError(
            f"{path} has {st.st_nlink} hard links; lingctl writes only to a file it alone names",
            hint=_NOT_OURS_HINT,
        )


def _a_link(path: Path) -> UsageError:
    return UsageError(
        f"{path} is a symbolic link; lingctl does not write or read its outputs through links", hint=_NOT_OURS_HINT
    )


def lstat_own(path: Path, *, sole_link: bool = False) -> os.stat_result | None:
    """What is at ``path`` (a link is not followed): None when nothing is; refused unless it is a regular file
    of this user."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    _check(path, st, sole_link=sole_link)
    return st


def has_content(path: Path) -> bool:
    """A non-empty file of this user is at ``path``; a link or anything else there is refused."""
    st = lstat_own(path)
    return st is not None and st.st_size > 0


def open_own(path: Path, flags: int, *, sole_link: bool) -> int | None:
    """A descriptor of the regular file of this user at ``path`` (see ``_check``), None when nothing is there.
    Never follows a link, never creates, never truncates."""
    before = lstat_own(path, sole_link=sole_link)
    if before is None:
        return None
    try:
        fd = os.open(path, flags | _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link put there since the lstat
            raise _a_link(path) from None
        raise os_error(exc, str(path)) from exc
    try:
        st = os.fstat(fd)
        _check(path, st, sole_link=sole_link)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise UsageError(f"{path} was replaced while lingctl opened it", hint="run the same command again")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_own(path: Path) -> bytes | None:
    """The bytes of the regular file of this user at ``path`` (a manifest, a marker); None when absent."""
    fd = open_own(path, os.O_RDONLY, sole_link=False)
    if fd is None:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError as exc:
        raise os_error(exc, str(path)) from exc


def _create(path: Path) -> int | None:
    """A new file at ``path`` (mode 0666 less the umask, as ``open(path, "a")`` makes), None when anything,
    a link included, is already there."""
    try:
        return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o666)
    except FileExistsError:
        return None
    except OSError as exc:
        raise os_error(exc, str(path)) from exc


# -- reading ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Scan:
    kept: int  # bytes of complete records (and blank lines) from the start
    torn: int  # bytes of the torn last line after them
    sha: Any  # hashlib sha256 of the kept bytes


def _scan(
    f: IO[bytes],
    path: Path,
    size: int,
    on_record: Callable[[dict[str, Any]], None],
    *,
    valid: Callable[[dict[str, Any]], bool],
    hint: str,
    proof: Written | None,
    require_proof: bool,
) -> _Scan:
    """Pass every complete record to ``on_record``, checking the first ``proof.size`` bytes against the proof.
    A bad line before the last is damage, not a crash: VerificationError."""
    proven = proof.size if proof is not None else 0
    if require_proof and size > 0 and proven == 0:
        raise UsageError(
            f"{path} holds {size} bytes, and its manifest records none that lingctl wrote there", hint=_UNPROVEN_HINT
        )
    if proven > size:
        raise VerificationError(f"{path} has {size} bytes; lingctl wrote {proven} there", hint=_UNPROVEN_HINT)
    sha = hashlib.sha256()
    checked = proven == 0
    good_end = end = 0
    bad_line = 0  # number of an unreadable line; fatal unless it is the last one
    for number, raw in enumerate(f, start=1):
        if bad_line:
            raise VerificationError(
                f"{path}: line {bad_line} is not a complete JSON record, so the requests it answered are unknown",
                hint=hint,
            )
        start, end = end, end + len(raw)
        record = _record(raw)
        if record is None or (record is not _BLANK and not valid(record)):
            bad_line = number
            continue
        if not checked and end >= proven:
            sha.update(raw[: proven - start])
            _verify(path, proof, sha.hexdigest())
            sha.update(raw[proven - start :])
            checked = True
        else:
            sha.update(raw)
        good_end = end
        if record is not _BLANK:
            on_record(record)
    if not checked:  # a bad line inside the recorded bytes: they are not the lines lingctl wrote
        _verify(path, proof, None)
    return _Scan(kept=good_end, torn=end - good_end, sha=sha)


def _verify(path: Path, proof: Written | None, found: str | None) -> None:
    assert proof is not None
    if found != proof.sha256:
        raise VerificationError(
            f"{path}: its first {proof.size} bytes are not what lingctl wrote there (sha256 {proof.sha256[:16]}… "
            f"recorded, {found[:16] + '…' if found else 'an unreadable line'} found)",
            hint=_UNPROVEN_HINT,
        )


def _record(raw: bytes) -> dict[str, Any] | None:
    """A complete line's record, ``_BLANK`` for a blank line, None for a torn or unreadable one."""
    if not raw.endswith(b"\n"):
        return None  # every record is written with its newline in one write: no newline, not finished
    if raw.isspace():
        return _BLANK
    try:
        return parse_object(raw)
    except BadLine:
        return None


def read_jsonl(
    path: Path,
    on_record: Callable[[dict[str, Any]], None],
    *,
    valid: Callable[[dict[str, Any]], bool] = lambda record: True,
    hint: str,
    proof: Written | None,
    require_proof: bool,
    torn_is_damage: bool,
) -> int:
    """Read a file lingctl wrote without changing it: its records to ``on_record``; the bytes of a torn last
    line (VerificationError when ``torn_is_damage``: a file written whole has none). 0 when it is absent."""
    fd = open_own(path, os.O_RDONLY, sole_link=False)
    if fd is None:
        return 0
    try:
        with os.fdopen(fd, "rb") as f:
            scan = _scan(
                f,
                path,
                os.fstat(f.fileno()).st_size,
                on_record,
                valid=valid,
                hint=hint,
                proof=proof,
                require_proof=require_proof,
            )
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    if scan.torn and torn_is_damage:
        raise VerificationError(f"{path}: its last line is not a complete JSON record", hint=hint)
    return scan.torn


# -- writing ---------------------------------------------------------------------------------------------
class JsonlSink:
    """One append-only JSONL file of lingctl's. ``on_sync`` receives what the file durably holds after each
    fsync, for the manifest."""

    def __init__(
        self,
        path: Path,
        fd: int,
        scan: _Scan,
        *,
        recorded: int,
        on_sync: Callable[[Written], None] | None,
    ) -> None:
        self.path = path
        self.torn = scan.torn
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)  # the file this sink wrote, whatever its name points to later
        self._f = os.fdopen(fd, "ab")
        self._size = scan.kept
        self._sha = scan.sha
        self._recorded = recorded
        self._on_sync = on_sync
        self._synced = time.monotonic()

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        proof: Written | None,
        on_record: Callable[[dict[str, Any]], None] = lambda record: None,
        valid: Callable[[dict[str, Any]], bool] = lambda record: True,
        hint: str = "",
        on_sync: Callable[[Written], None] | None = None,
    ) -> JsonlSink:
        """Create ``path``, or continue the file of lingctl's there: its records go to ``on_record``, a torn last
        line past the proven bytes is cut, and appends follow."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, str(path.parent)) from exc
        fd = _create(path)
        if fd is None:
            fd = open_own(path, os.O_RDWR | os.O_APPEND, sole_link=True)
            if fd is None:  # removed between the two calls
                fd = _create(path)
                if fd is None:
                    raise UsageError(f"{path} keeps changing while lingctl opens it", hint="run the same command again")
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                # A new or empty file holds nothing to protect: what an earlier run wrote there is gone.
                proof = None
            with open(fd, "rb", closefd=False) as f:
                scan = _scan(
                    f,
                    path,
                    size,
                    on_record,
                    valid=valid,
                    hint=hint,
                    proof=proof,
                    require_proof=True,
                )
            if scan.torn:
                os.ftruncate(fd, scan.kept)
                os.fsync(fd)
                log.warning("%s: cut %d bytes of a torn last line", path, scan.torn)
            sink = cls(path, fd, scan, recorded=proof.size if proof is not None else 0, on_sync=on_sync)
        except OSError as exc:
            os.close(fd)
            raise os_error(exc, str(path)) from exc
        except BaseException:
            os.close(fd)
            raise
        if scan.kept != sink._recorded:  # lines of the crash window, or a cut: record what the file now holds
            try:
                sink.sync()
            except BaseException:
                sink._f.close()
                raise
        return sink

    def write(self, record: dict[str, Any]) -> None:
        data = dumps_line(record)
        try:
            self._f.write(data)
            self._f.flush()
        except OSError as exc:
            raise os_error(exc, str(self.path)) from exc
        self._size += len(data)
        self._sha.update(data)
        # The first line at once: until its record exists the file has no proof, and a resume would refuse it.
        if self._recorded == 0 or time.monotonic() - self._synced >= FSYNC_EVERY_S:
            self.sync()

    def sync(self) -> None:
        """fsync, then tell ``on_sync`` what the file holds (never before the bytes are on disk)."""
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as exc:
            raise os_error(exc, str(self.path)) from exc
        self._synced = time.monotonic()
        if self._size != self._recorded and self._on_sync is not None:
            self._on_sync(Written(self._size, self._sha.hexdigest()))
        self._recorded = self._size

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self.sync()
        finally:
            self._f.close()


def dumps_line(record: dict[str, Any]) -> bytes:
    """One JSONL line, UTF-8."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (a custom_id written as "\ud800" in the batch) has no UTF-8 form; escapes do.
        return (json.dumps(record) + "\n").encode("ascii")
