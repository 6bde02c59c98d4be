"""A listing held by key: in memory while small, in an on-disk sqlite table past a threshold.

A million-object destination listing as Python objects costs a few hundred MB; past ``SPILL_AT`` entries
the index moves to a temporary sqlite file (a B-tree on the key), so memory stays flat however large the
tree is, and lookups stay O(log n).
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

SPILL_AT = 200_000

Entry = tuple[int, float, "str | None"]  # size, mtime, etag


class ListingIndex:
    def __init__(self, spill_at: int = SPILL_AT, tmp_dir: Path | None = None) -> None:
        self.spill_at = spill_at
        self.tmp_dir = tmp_dir
        self._mem: dict[str, Entry] | None = {}
        self._db: sqlite3.Connection | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.count = 0

    @property
    def spilled(self) -> bool:
        return self._db is not None

    def add_many(self, items: Iterable[tuple[str, int, float, str | None]]) -> None:
        rows = list(items)
        if self._mem is not None:
            for key, size, mtime, etag in rows:
                self._mem[key] = (size, mtime, etag)
            if len(self._mem) > self.spill_at:
                self._spill()
        else:
            assert self._db is not None
            self._db.executemany("INSERT OR REPLACE INTO idx VALUES (?, ?, ?, ?)", rows)
        self.count = len(self._mem) if self._mem is not None else self._db_count()

    def _db_count(self) -> int:
        assert self._db is not None
        return self._db.execute("SELECT COUNT(*) FROM idx").fetchone()[0]

    def _spill(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="lingctl-babel-index-", dir=self.tmp_dir)
        self._db = sqlite3.connect(Path(self._tmp.name) / "index.sqlite", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE idx (key TEXT PRIMARY KEY, size INTEGER, mtime REAL, etag TEXT) WITHOUT ROWID")
        assert self._mem is not None
        self._db.executemany("INSERT INTO idx VALUES (?, ?, ?, ?)", ((k, *v) for k, v in self._mem.items()))
        self._mem = None

    def get(self, key: str) -> Entry | None:
        if self._mem is not None:
            return self._mem.get(key)
        assert self._db is not None
        row = self._db.execute("SELECT size, mtime, etag FROM idx WHERE key=?", (key,)).fetchone()
        return (row[0], row[1], row[2]) if row else None

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def items(self) -> Iterator[tuple[str, Entry]]:
        if self._mem is not None:
            yield from sorted(self._mem.items())
            return
        assert self._db is not None
        for key, size, mtime, etag in self._db.execute("SELECT key, size, mtime, etag FROM idx ORDER BY key"):
            yield key, (size, mtime, etag)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
        if self._tmp is not None:
            self._tmp.cleanup()
