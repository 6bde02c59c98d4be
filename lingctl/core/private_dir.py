"""Private directories in shared places (``/dev/shm``, ``/tmp``): ours, mode 0700, and never through a link.

A predictable name in a world-writable directory can be created first by another local user. A directory
we did not create, or that others can write to, is refused rather than used: files in it could be
symlinks planted to make us truncate or create files elsewhere. Inside a directory that passed the check,
files are still opened with ``O_NOFOLLOW`` and created with ``O_EXCL``.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from lingctl.core.errors import AccessDeniedError, os_error

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def ensure_private_dir(path: Path | str, *, deny: int = 0o077) -> Path:
    """Create ``path`` (mode 0700) or check the one that is there: a real directory, owned by this user,
    with none of the ``deny`` permission bits (default: no access at all for others). Anything else is an
    ``AccessDeniedError`` naming the problem."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    check_private_dir(path, deny=deny)
    return path


def check_private_dir(path: Path | str, *, owner: int | None = None, deny: int = 0o077) -> None:
    """Refuse ``path`` unless it is a directory (not a link to one) owned by ``owner`` (default: us) with none
    of the ``deny`` bits. Root reading another user's files passes that user as ``owner``. ``deny=0o022``
    accepts a directory others may read but not change: nobody else can plant or replace entries in it."""
    path = Path(path)
    uid = os.geteuid() if owner is None else owner
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    hint = f"remove {path} (it is not lingctl's) or set TMPDIR to a directory of your own"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AccessDeniedError(
            f"{path} is not a directory (a link or a file is in its place); refusing to use it", hint=hint
        )
    if st.st_uid != uid:
        raise AccessDeniedError(f"{path} belongs to uid {st.st_uid}, not to uid {uid}; refusing to use it", hint=hint)
    if stat.S_IMODE(st.st_mode) & deny:
        raise AccessDeniedError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); refusing to use it",
            hint=f"chmod 700 {path}",
        )


def open_nofollow(path: Path | str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink at ``path`` itself (ELOOP becomes a clear refusal)."""
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AccessDeniedError(f"{path} is a symbolic link; refusing to open it") from None
        raise


def create_exclusive(path: Path | str, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """Create ``path`` anew (``O_CREAT | O_EXCL | O_NOFOLLOW``): fails if anything, a link included, is there."""
    return open_nofollow(path, flags | os.O_CREAT | os.O_EXCL, mode)
