"""The sync journal: a small sqlite file that survives ``kill -9`` at any point.

It records, per destination key, what babel last wrote there (size, source mtime, CRC64NVME, the
destination's etag/mtime), and the multipart uploads in progress with their finished parts. A re-run uses
it to skip finished objects without asking the store about each one (no per-object HEAD), and to continue
a half-done multipart upload from its finished parts. Multipart changes are committed one by one (WAL
mode); finished objects are committed in small batches by a writer thread (every 50 ms), since one commit
per small object would cost more than copying it. A crash loses at most the last batch: those objects are
found at the destination with the right size and are recognised by their mtime (one HEAD each on S3), or
copied again, never half-visible.

The journal also remembers which runs are in progress: ``begin_run`` records this process, ``end_run``
removes it, so a later run knows when an earlier one was killed and may have left temporary files.

sqlite failures become lingctl errors: "database or disk is full" a ``DiskFullError`` (exit 1, one line);
others a ``LingctlError`` naming the journal. The writer thread keeps its failure and the caller's next
journal call raises it, so a full disk never ends in a thread's traceback.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lingctl.core.atomic import FOREIGN_STALE_S, host_tag, pid_alive
from lingctl.core.errors import DiskFullError, LingctlError, os_error

T = TypeVar("T")
_SQLITE_FULL = 13

_SCHEMA = """
CREATE TABLE IF NOT EXISTS done (key TEXT PRIMARY KEY, size INTEGER, src_mtime REAL, crc TEXT, dst_etag TEXT,
                                 dst_mtime REAL);
CREATE TABLE IF NOT EXISTS uploads (key TEXT PRIMARY KEY, upload_id TEXT, size INTEGER, src_mtime REAL,
                                    part_size INTEGER);
CREATE TABLE IF NOT EXISTS parts (key TEXT, upload_id TEXT, number INTEGER, etag TEXT, crc TEXT, length INTEGER,
                                  PRIMARY KEY (key, upload_id, number));
CREATE TABLE IF NOT EXISTS state (name TEXT PRIMARY KEY, value TEXT);
"""
_RUN = "run:"  # state rows "run:<host>:<pid>" -> start time, one per run in progress


@dataclass(slots=True)
class Done:
    size: int
    src_mtime: float
    crc: str | None
    dst_etag: str | None
    dst_mtime: float | None


@dataclass(slots=True)
class Upload:
    upload_id: str
    size: int
    src_mtime: float
    part_size: int
    src_etag: str | None = None  # the source version's ETag (S3 sources): parts of another are not reused


def sqlite_error(exc: sqlite3.Error, path: Path | None) -> LingctlError:
    """The user-facing kind of a sqlite failure on the journal at ``path``."""
    what = f"sync journal {path or '(in memory)'}"
    if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or "database or disk is full" in str(exc):
        return DiskFullError(
            f"{what}: database or disk is full", hint="free space and run the same command again; finished work is kept"
        )
    return LingctlError(
        f"{what}: {exc}",
        hint="check the free space and permissions of its directory; if the file is damaged, "
        "remove it (the next run re-checks the destination)",
    )


class Journal:
    def __init__(self, path: Path | None) -> None:
        """``path`` None: an in-memory journal (a dry run that must not create anything)."""
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise os_error(exc, str(self.path.parent)) from exc
        target = str(self.path) if self.path is not None else ":memory:"
        self._lock = threading.Lock()
        self._error: LingctlError | None = None  # the writer thread's failure, raised by the next call
        try:
            self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(uploads)")}
            if "src_etag" not in columns:  # journals written before the column existed
                self._db.execute("ALTER TABLE uploads ADD COLUMN src_etag TEXT")
        except sqlite3.Error as exc:
            raise sqlite_error(exc, self.path) from exc
        self._pending: list[tuple] = []
        self._cv = threading.Condition()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="babel-journal", daemon=True)
        self._writer.start()

    def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(db)`` under the lock, sqlite errors translated (a failed transaction is rolled back)."""
        with self._lock:
            try:
                return fn(self._db)
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise sqlite_error(exc, self.path) from exc

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._closing, timeout=0.05)
                if self._closing and not self._pending:
                    return
            try:
                self.flush()
            except LingctlError as exc:
                with self._cv:
                    self._error = self._error or exc
                    self._pending = []
                return

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        with self._cv:
            rows, self._pending = self._pending, []
        if rows:

            def write(db: sqlite3.Connection) -> None:
                db.execute("BEGIN")
                db.executemany("INSERT OR REPLACE INTO done VALUES (?, ?, ?, ?, ?, ?)", rows)
                db.execute("COMMIT")

            self._run(write)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._writer.join()
        try:
            self._raise_pending()
            self.flush()
        finally:
            with self._lock:
                self._db.close()

    # -- runs -------------------------------------------------------------------------------------------
    def begin_run(self) -> bool:
        """Record this run; True when another run is recorded: one that did not end (killed, crashed, a
        full disk) or one still going. Records of runs known to be over are dropped."""
        me, host, now = self._run_name(), host_tag(), time.time()

        def swap(db: sqlite3.Connection) -> bool:
            others = db.execute("SELECT name, value FROM state WHERE name LIKE 'run:%' AND name != ?", (me,)).fetchall()
            db.execute("BEGIN")
            for name, started in others:
                _, run_host, pid = name.split(":", 2)
                over = (not pid_alive(int(pid))) if run_host == host else now - float(started) > FOREIGN_STALE_S
                if over:
                    db.execute("DELETE FROM state WHERE name=?", (name,))
            db.execute("INSERT OR REPLACE INTO state VALUES (?, ?)", (me, repr(now)))
            db.execute("COMMIT")
            return bool(others)

        return self._run(swap)

    def end_run(self) -> None:
        self._run(lambda db: db.execute("DELETE FROM state WHERE name=?", (self._run_name(),)))

    @staticmethod
    def _run_name() -> str:
        return f"{_RUN}{host_tag()}:{os.getpid()}"

    # -- finished objects -------------------------------------------------------------------------------
    def done(self, key: str) -> Done | None:
        self._raise_pending()
        self.flush()
        row = self._run(
            lambda db: db.execute(
                "SELECT size, src_mtime, crc, dst_etag, dst_mtime FROM done WHERE key=?", (key,)
            ).fetchone()
        )
        return Done(*row) if row else None

    def all_done(self) -> dict[str, Done]:
        self._raise_pending()
        self.flush()
        rows = self._run(
            lambda db: db.execute("SELECT key, size, src_mtime, crc, dst_etag, dst_mtime FROM done").fetchall()
        )
        return {r[0]: Done(*r[1:]) for r in rows}

    def mark_done(self, key: str, rec: Done) -> None:
        self._raise_pending()
        with self._cv:
            self._pending.append((key, rec.size, rec.src_mtime, rec.crc, rec.dst_etag, rec.dst_mtime))
            self._cv.notify()

    def forget(self, key: str) -> None:
        self._raise_pending()
        self.flush()
        self._run(lambda db: db.execute("DELETE FROM done WHERE key=?", (key,)))

    # -- multipart ------------------------------------------------------------------------------------
    def upload(self, key: str) -> Upload | None:
        row = self._run(
            lambda db: db.execute(
                "SELECT upload_id, size, src_mtime, part_size, src_etag FROM uploads WHERE key=?", (key,)
            ).fetchone()
        )
        return Upload(*row) if row else None

    def start_upload(self, key: str, up: Upload) -> None:
        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN")
            db.execute("DELETE FROM parts WHERE key=?", (key,))
            db.execute(
                "INSERT OR REPLACE INTO uploads VALUES (?, ?, ?, ?, ?, ?)",
                (key, up.upload_id, up.size, up.src_mtime, up.part_size, up.src_etag),
            )
            db.execute("COMMIT")

        self._run(write)

    def parts(self, key: str, upload_id: str) -> dict[int, tuple[str, int, int]]:
        """Finished parts: number -> (etag, crc value, length)."""
        rows = self._run(
            lambda db: db.execute(
                "SELECT number, etag, crc, length FROM parts WHERE key=? AND upload_id=?", (key, upload_id)
            ).fetchall()
        )
        return {r[0]: (r[1], int(r[2]), r[3]) for r in rows}

    def add_part(self, key: str, upload_id: str, number: int, etag: str, crc: int, length: int) -> None:
        self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO parts VALUES (?, ?, ?, ?, ?, ?)",
                (key, upload_id, number, etag, str(crc), length),
            )
        )  # unsigned 64-bit: text

    def end_upload(self, key: str, done: Done | None) -> None:
        """The upload completed (``done``) or was abandoned (None): drop its parts, record the object."""
        self._raise_pending()
        self.flush()

        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN")
            db.execute("DELETE FROM parts WHERE key=?", (key,))
            db.execute("DELETE FROM uploads WHERE key=?", (key,))
            if done is not None:
                db.execute(
                    "INSERT OR REPLACE INTO done VALUES (?, ?, ?, ?, ?, ?)",
                    (key, done.size, done.src_mtime, done.crc, done.dst_etag, done.dst_mtime),
                )
            db.execute("COMMIT")

        self._run(write)
