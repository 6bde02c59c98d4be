"""Atomic file writes: a temporary file beside the target, fsync, rename, fsync of the directory.

Used wherever a half-written file would be mistaken for a finished one (downloads, checkpoints, outputs):
after a crash the target holds either its previous content or the complete new content, never a prefix.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from lingctl.core.errors import os_error

# Temporary files of unfinished writes carry this marker; listings skip them.
TMP_MARKER = ".lingctl-tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: Path) -> Iterator[tuple[Path, BinaryIO]]:
    """Yield ``(tmp_path, file)``; on clean exit the file replaces ``path``, on an exception it is removed.

    Raising inside the block (a failed verification, a broken connection) leaves ``path`` untouched.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARKER}", dir=path.parent)
    except OSError as exc:
        raise os_error(exc, str(path.parent)) from exc
    tmp = Path(name)
    done = False
    try:
        with os.fdopen(fd, "wb") as f:
            yield tmp, f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        done = True
        fsync_dir(path.parent)
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    finally:
        if not done:
            tmp.unlink(missing_ok=True)
