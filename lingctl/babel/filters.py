"""Which keys a run handles: --files-from lists, --include / --exclude globs and --shard I/N.

Globs follow rclone's reading: ``*`` matches within one path segment, ``**`` across segments, ``?`` one
character; a pattern starting with ``/`` is anchored at the root, any other matches a trailing part of the
key at a segment boundary (``*.tmp`` matches ``a/b/c.tmp``). A key is excluded if any --exclude matches;
with --include given, it must also match one of them. With --files-from, it must also be one of the file's
names (rclone's reading: one path per line relative to the source, surrounding spaces stripped, blank lines
and lines starting with ``#`` or ``;`` skipped, a leading ``/`` meaning the source's root).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from lingctl.core.errors import UsageError, os_error
from lingctl.core.names import printable


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    anchored = pattern.startswith("/")
    body = pattern.lstrip("/")
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if body.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = body.find("]", i + 1)
            if end < 0:
                raise UsageError(f"invalid glob {pattern!r}: unclosed '['")
            out.append("[" + body[i + 1 : end].replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    prefix = "^" if anchored else "^(?:.*/)?"
    return re.compile(prefix + "".join(out) + "$")


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise UsageError(f"invalid --shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    return int(m.group(1)), int(m.group(2))


def read_files_from(path: Path) -> frozenset[str]:
    """The keys a --files-from file names; a UsageError naming FILE:LINE for a name that is not a plain path
    below the source (``..``, empty segments, control characters)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise os_error(exc, f"--files-from {path}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--files-from {path}: not UTF-8 text") from None
    keys = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key = line.lstrip("/")
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts) or any(ord(c) < 32 for c in key):
            raise UsageError(f"--files-from {path}:{number}: {printable(line)!r} is not a path below the source")
        keys.add(key)
    return frozenset(keys)


@dataclass(slots=True)
class KeyFilter:
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    shard: tuple[int, int] = (0, 1)
    only: frozenset[str] | None = None  # --files-from: these keys and no others
    _inc: list[re.Pattern[str]] = field(init=False, default_factory=list, repr=False)
    _exc: list[re.Pattern[str]] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._inc = [glob_to_regex(p) for p in self.include]
        self._exc = [glob_to_regex(p) for p in self.exclude]

    def in_shard(self, key: str) -> bool:
        index, count = self.shard
        if count == 1:
            return True
        # A stable hash: every machine of a scaled-out run agrees on the split without talking.
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % count == index

    def __call__(self, key: str) -> bool:
        if self.only is not None and key not in self.only:
            return False
        if any(r.match(key) for r in self._exc):
            return False
        if self._inc and not any(r.match(key) for r in self._inc):
            return False
        return self.in_shard(key)
