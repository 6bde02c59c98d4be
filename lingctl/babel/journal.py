"""The sync journal: a small sqlite file that survives ``kill -9`` at any point.

It records, per destination key, what babel last wrote there (size, source mtime, CRC64NVME, the
destination's etag/mtime), and the multipart uploads in progress with their finished parts. A re-run uses
it to skip finished objects without asking the store about each one (no per-object HEAD), and to continue
a half-done multipart upload from its finished parts. Multipart changes are committed one by one (WAL
mode); finished objects are committed in small batches by a writer thread (every 50 ms), since one commit
per small object would cost more than copying it. A crash loses at most the last batch: those objects are
found at the destination with the right size and are recognised by their mtime (one HEAD each on S3), or
copied again, never half-visible.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS done (key TEXT PRIMARY KEY, size INTEGER, src_mtime REAL, crc TEXT, dst_etag TEXT,
                                 dst_mtime REAL);
CREATE TABLE IF NOT EXISTS uploads (key TEXT PRIMARY KEY, upload_id TEXT, size INTEGER, src_mtime REAL,
                                    part_size INTEGER);
CREATE TABLE IF NOT EXISTS parts (key TEXT, upload_id TEXT, number INTEGER, etag TEXT, crc TEXT, length INTEGER,
                                  PRIMARY KEY (key, upload_id, number));
"""


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


class Journal:
    def __init__(self, path: Path | None) -> None:
        """``path`` None: an in-memory journal (a dry run that must not create anything)."""
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        target = str(self.path) if self.path is not None else ":memory:"
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._cv = threading.Condition()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="babel-journal", daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._closing, timeout=0.05)
                if self._closing and not self._pending:
                    return
            self.flush()

    def flush(self) -> None:
        with self._cv:
            rows, self._pending = self._pending, []
        if rows:
            with self._lock:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO done VALUES (?, ?, ?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._writer.join()
        self.flush()
        with self._lock:
            self._db.close()

    def done(self, key: str) -> Done | None:
        self.flush()
        with self._lock:
            row = self._db.execute("SELECT size, src_mtime, crc, dst_etag, dst_mtime FROM done WHERE key=?",
                                   (key,)).fetchone()
        return Done(*row) if row else None

    def all_done(self) -> dict[str, Done]:
        self.flush()
        with self._lock:
            rows = self._db.execute("SELECT key, size, src_mtime, crc, dst_etag, dst_mtime FROM done").fetchall()
        return {r[0]: Done(*r[1:]) for r in rows}

    def mark_done(self, key: str, rec: Done) -> None:
        with self._cv:
            self._pending.append((key, rec.size, rec.src_mtime, rec.crc, rec.dst_etag, rec.dst_mtime))
            self._cv.notify()

    def forget(self, key: str) -> None:
        self.flush()
        with self._lock:
            self._db.execute("DELETE FROM done WHERE key=?", (key,))

    # -- multipart ------------------------------------------------------------------------------------
    def upload(self, key: str) -> Upload | None:
        with self._lock:
            row = self._db.execute("SELECT upload_id, size, src_mtime, part_size FROM uploads WHERE key=?",
                                   (key,)).fetchone()
        return Upload(*row) if row else None

    def start_upload(self, key: str, up: Upload) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM parts WHERE key=?", (key,))
            self._db.execute("INSERT OR REPLACE INTO uploads VALUES (?, ?, ?, ?, ?)",
                             (key, up.upload_id, up.size, up.src_mtime, up.part_size))
            self._db.execute("COMMIT")

    def parts(self, key: str, upload_id: str) -> dict[int, tuple[str, int, int]]:
        """Finished parts: number -> (etag, crc value, length)."""
        with self._lock:
            rows = self._db.execute("SELECT number, etag, crc, length FROM parts WHERE key=? AND upload_id=?",
                                    (key, upload_id)).fetchall()
        return {r[0]: (r[1], int(r[2]), r[3]) for r in rows}

    def add_part(self, key: str, upload_id: str, number: int, etag: str, crc: int, length: int) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO parts VALUES (?, ?, ?, ?, ?, ?)",
                             (key, upload_id, number, etag, str(crc), length))  # unsigned 64-bit: text

    def end_upload(self, key: str, done: Done | None) -> None:
        """The upload completed (``done``) or was abandoned (None): drop its parts, record the object."""
        self.flush()
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM parts WHERE key=?", (key,))
            self._db.execute("DELETE FROM uploads WHERE key=?", (key,))
            if done is not None:
                self._db.execute("INSERT OR REPLACE INTO done VALUES (?, ?, ?, ?, ?, ?)",
                                 (key, done.size, done.src_mtime, done.crc, done.dst_etag, done.dst_mtime))
            self._db.execute("COMMIT")
