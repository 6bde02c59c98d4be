"""Names that come from data (markers, journals, manifests, remote listings), checked before they touch a path.

A checkpoint marker, a sync journal or an S3 listing is data somebody else may have written. A name in it
is joined to a local directory only after ``check_relative`` has shown it cannot leave that directory:
relative, '/'-separated, no empty, '.' or '..' segments, no NUL or other control characters. Every module
that joins such a name goes through ``join_under``, so there is one rule to audit.

``printable`` is the other half: names shown on a terminal have their control characters escaped, so a key
holding ESC sequences or newlines cannot rewrite the user's screen or forge log lines.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

from lingctl.core.errors import VerificationError

# One path segment of a POSIX file system; longer names fail with ENAMETOOLONG anyway, but later.
MAX_SEGMENT_BYTES = 255
MAX_NAME_BYTES = 4096


class UnsafeNameError(VerificationError):
    """A name read from data that would escape its directory (or cannot be a file name at all).

    Exit code 4: the marker, journal or listing that holds it is not what lingctl writes, so it is treated
    like any other data that fails verification; nothing is read, written or deleted through it.
    """


def _control(ch: str) -> bool:
    code = ord(ch)
    return code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0


# Invisible characters that change how the rest of a line is shown: bidirectional overrides and isolates
# (U+202E makes "evil\u202etxt.exe" display as "evilexe.txt"), line and paragraph separators, and other
# format characters. The zero-width joiners stay: scripts such as Persian and the Indic ones need them.
_SHOWN_AS_IS = frozenset({"\u200c", "\u200d"})
_HIDDEN_CATEGORIES = frozenset({"Cf", "Zl", "Zp"})


def _escaped(ch: str) -> bool:
    if _control(ch) or 0xD800 <= ord(ch) <= 0xDFFF:
        return True
    return ch not in _SHOWN_AS_IS and unicodedata.category(ch) in _HIDDEN_CATEGORIES


def printable(text: str) -> str:
    """``text`` with control characters (ESC, newline, DEL, C1), lone surrogates and invisible format
    characters (bidirectional overrides such as U+202E, line separators) shown as escapes."""
    if text.isprintable():
        return text
    return "".join(ascii(ch)[1:-1] if _escaped(ch) else ch for ch in text)


def check_relative(name: object, *, what: str = "name") -> str:
    """``name`` when it is a safe relative path ('dir/file'), else ``UnsafeNameError`` naming ``what``."""
    if not isinstance(name, str) or not name:
        raise UnsafeNameError(f"{what}: {name!r} is not a file name")
    shown = printable(name)
    if name.startswith("/") or name.startswith("\\"):
        raise UnsafeNameError(f"{what}: '{shown}' is an absolute path; only names inside the directory are allowed")
    if any(_control(ch) for ch in name):
        raise UnsafeNameError(f"{what}: '{shown}' holds control characters")
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in name):
        raise UnsafeNameError(f"{what}: '{shown}' is not valid text (lone surrogate)")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafeNameError(f"{what}: '{shown}' has an empty, '.' or '..' segment; it could leave its directory")
    encoded = name.encode("utf-8")
    if len(encoded) > MAX_NAME_BYTES or any(len(p.encode("utf-8")) > MAX_SEGMENT_BYTES for p in parts):
        raise UnsafeNameError(f"{what}: '{shown[:80]}...' is too long for a file name")
    return name


def join_under(base: Path | str, name: object, *, what: str = "name") -> Path:
    """``base / name`` after ``check_relative``; the result is always inside ``base`` (lexically)."""
    rel = check_relative(name, what=what)
    base = Path(base)
    joined = base / rel
    # Belt and braces: the checks above already exclude every way out; this states the promise.
    if os.path.commonpath([os.path.abspath(base), os.path.abspath(joined)]) != os.path.abspath(base):
        raise UnsafeNameError(f"{what}: '{printable(rel)}' leaves {base}")
    return joined
