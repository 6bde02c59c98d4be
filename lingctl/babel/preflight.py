"""Checks and set-up before a sync writes anything: the destination directory and the state directory.

Both are created here, with one-line errors naming the directory (``/proc/...``, a read-only disk, a file
in the way), rather than deep inside the sync where an ``OSError`` would surface as an internal error.
The state directory is also proven writable, so the journal cannot fail to open later.

lingctl's default state location (``$LINGCTL_CACHE_DIR`` or ``~/.cache/lingctl``, then ``babel/<hash>``;
never inside a destination) holds a journal whose names are joined to paths and whose sqlite file is written.
When that location lies in a place other users can write to (below ``/tmp``, ``/dev/shm``, a directory
of mode 0777), the cache directory and every directory below it must be ours and private
(``lingctl.core.private_dir``), or the sync is refused: another user could have created them first. Those
lingctl creates are 0700; an existing one of yours may be readable by others (0755), never writable.
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

from lingctl.babel.sync import state_dir_for
from lingctl.core.errors import LingctlError, NotFoundError, UsageError, os_error
from lingctl.core.names import printable
from lingctl.core.private_dir import check_private_dir, create_exclusive, ensure_private_dir
from lingctl.core.storage.url import StoreURL

# A cache directory others can read leaks only the names of synced objects; one they can write to lets them
# plant links where the journal will be written.
_WRITE_BY_OTHERS = 0o022


def prepare(src: StoreURL, dst: StoreURL, state_dir: Path | None, *, dry_run: bool) -> Path | None:
    """Create the state directory and a local destination (nothing in a dry run); return the state
    directory to use. Nothing is created when the source is a missing local directory: the sync reports
    that itself. The state directory is checked first, so a bad --state-dir leaves no empty destination
    behind."""
    if not src.is_s3 and not os.path.isdir(src.path):
        return state_dir
    state = state_dir_for(dst, state_dir)
    hint = (
        "give --state-dir a directory you can write to"
        if state_dir is not None
        else "pass --state-dir DIR to keep the journal elsewhere"
    )
    # lingctl's own cache location is owner-checked where others can write.
    _prepare_state(state, hint, check_shared=state_dir is None, dry_run=dry_run)
    if not dst.is_s3 and not dry_run:
        _mkdirs(dst.path, "the destination directory", hint="choose a destination you can write to")
    return state


def _prepare_state(state: Path, hint: str, *, check_shared: bool, dry_run: bool) -> None:
    if check_shared and _in_shared_place(state):
        # state_dir_for's layout is <cache root>/babel/<hash>: the cache root and all below it are lingctl's.
        cache_root = state.parents[1]
        if not dry_run:
            _mkdirs(cache_root.parent, "the cache directory", hint=hint)
        _private_chain(cache_root, state, create=not dry_run)
    if dry_run:
        if state.exists() and not state.is_dir():
            raise UsageError(f"state directory {printable(str(state))} is not a directory", hint=hint)
        return
    _mkdirs(state, "the state directory", hint=hint)
    _check_writable(state, hint)


def _mkdirs(path: Path, what: str, *, hint: str) -> None:
    shown = printable(str(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"cannot create {what} {shown}: a file is in the way", hint=hint) from None
    except OSError as exc:
        raise _as_usage(os_error(exc, f"cannot create {what} {shown}"), hint) from None


def _check_writable(state: Path, hint: str) -> None:
    """Create and remove a probe file: the only test that holds on every file system (/proc, read-only
    mounts, root without CAP_DAC_OVERRIDE) where permission bits and ``os.access`` can mislead."""
    probe = state / f".lingctl-write-test-{uuid.uuid4().hex[:8]}"
    try:
        os.close(create_exclusive(probe, os.O_WRONLY))
        os.unlink(probe)
    except OSError as exc:
        raise _as_usage(os_error(exc, f"cannot write in the state directory {printable(str(state))}"), hint) from None


def _as_usage(err: LingctlError, hint: str) -> LingctlError:
    # "No such file or directory" while creating a directory means a place that cannot hold one (/proc):
    # the option is wrong, not a missing input. Other kinds (access denied, disk full) keep their codes.
    if isinstance(err, NotFoundError):
        return UsageError(err.message, hint=hint)
    err.hint = err.hint or hint
    return err


def _in_shared_place(path: Path) -> bool:
    """Whether ``path`` or an existing ancestor is a directory other users can write to (``/tmp``)."""
    path = Path(os.path.abspath(path))
    for directory in (path, *path.parents):
        try:
            if os.stat(directory).st_mode & stat.S_IWOTH:
                return True
        except OSError:
            continue
    return False


def _private_chain(first: Path, state: Path, *, create: bool) -> None:
    """Every directory from ``first`` down to ``state`` is ours, not writable by others, and not a link;
    created 0700 when ``create``, else checked as far as it exists (a dry run creates nothing). Each one
    checked protects the next: nobody else can add, rename or replace entries in it."""
    chain = [first]
    for part in state.relative_to(first).parts:
        chain.append(chain[-1] / part)
    for directory in chain:
        if create:
            ensure_private_dir(directory, deny=_WRITE_BY_OTHERS)
        elif os.path.lexists(directory):
            check_private_dir(directory, deny=_WRITE_BY_OTHERS)
        else:
            return
