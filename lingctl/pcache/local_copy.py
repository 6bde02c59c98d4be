"""Reading from the flash tier: the node-local copy of a checkpoint, where it lives, how it is brought up to
date from the remote, and which verified copy a reader gets.

A reader never sees an unverified byte: the local copy is used when it is complete and every file matches its
marker; otherwise only the missing or damaged files are fetched, each is checked against the remote marker,
and the marker is written last, so an interrupted fetch leaves a directory that reads as incomplete.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from lingctl.core.atomic import atomic_write, tmp_path
from lingctl.core.cache import cache_dir as lingctl_cache_dir
from lingctl.core.errors import NotFoundError, UsageError, VerificationError, os_error
from lingctl.core.storage import S3Options, StoreURL, open_store, parse_url
from lingctl.pcache.marker import (
    MARKER,
    METADATA,
    bad_files,
    check_file_name,
    file_problems,
    parse_marker,
    read_marker,
    verify_local,
)
from lingctl.pcache.transfer import journal_dir, sync_files

# The flash tier logs under one name, reads as uploads: which copy a read used is what `-v` is asked for.
log = logging.getLogger("lingctl.pcache.tier")


def default_cache_dir() -> Path:
    return lingctl_cache_dir("pcache")


def cache_path(url: str, cache_dir: Path | str | None) -> Path:
    """The node-local directory that mirrors the checkpoint at ``url``: ``s3://bucket/key`` ->
    ``CACHE/bucket/key``; a path (a shared filesystem) -> ``CACHE/<the path without its leading />``."""
    parsed = parse_url(url)
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if parsed.is_s3:
        return base / parsed.bucket / parsed.prefix.strip("/")
    return base / parsed.path.absolute().relative_to("/")


def fetch(remote_url: str, local_dir: Path, s3: S3Options | None = None, *, jobs: int = 8) -> Path:
    """Bring the checkpoint at ``remote_url`` into ``local_dir``: only files missing or failing verification
    are copied, each is checked against the remote marker, and the marker is written last."""
    local_dir = Path(local_dir).absolute()
    s3 = s3 or S3Options()
    remote = parse_url(remote_url)
    store = open_store(remote, s3)
    try:
        raw = store.read(MARKER)
    except NotFoundError:
        raise NotFoundError(
            f"{remote}: no {MARKER}, so not a complete checkpoint",
            hint="its upload may not have finished; check 'lingctl pcache status'",
        ) from None
    files = parse_marker(raw, f"{remote}/{MARKER}")["files"]
    stale = sorted(bad_files(local_dir, files, files, "full"))
    aside: list[Path] = []
    try:
        if stale:
            _replace(remote, local_dir, s3, files, stale, aside, jobs=jobs)
        local_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(local_dir / MARKER) as (_, f):
            f.write(raw)
    finally:
        for path in aside:
            path.unlink(missing_ok=True)
    log.info("fetched %d of %d file(s) of %s into %s", len(stale), len(files), remote, local_dir)
    return local_dir


def _replace(
    remote: StoreURL,
    local_dir: Path,
    s3: S3Options,
    files: dict[str, dict],
    stale: list[str],
    aside: list[Path],
    *,
    jobs: int,
) -> None:
    """Fetch the ``stale`` files anew and check them against the remote marker's ``files``."""
    # Until every file is right, the local directory must not look complete: marker first, then the rest.
    # Moved aside, not overwritten in place (babel skips a file of the same size and mtime), under lingctl's
    # temporary names, which no listing shows; removed once the replacements are in, so a replacement is
    # always a new file (a new inode), never the old one's reused number. The names were checked by
    # parse_marker (one plain segment each); checked again where joined.
    for name in [MARKER, *stale]:
        _move_aside(local_dir / check_file_name(name, f"{remote}/{MARKER}: file"), aside)
    # babel's own check would compare against the bytes it just read; the marker's CRCs, checked next, are
    # the ones the writer recorded, so they also catch an object damaged at the remote.
    journal = journal_dir(local_dir, "fetch", remote)
    sync_files(remote, parse_url(str(local_dir)), s3, stale, journal=journal, verify="none", jobs=jobs)
    shutil.rmtree(journal, ignore_errors=True)
    problems = file_problems(local_dir, files, stale, "full")
    if problems:
        raise VerificationError(
            f"{remote}: fetched copy of {problems[0]}",
            hint="the remote copy is damaged; upload it again from a verified local copy",
        )


def _move_aside(path: Path, aside: list[Path]) -> None:
    """Rename ``path`` (if present) to a temporary name beside it, recorded in ``aside``."""
    tmp = tmp_path(path)
    try:
        os.rename(path, tmp)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    aside.append(tmp)


def resolve_for_read(url: str, *, cache_dir: Path | None, s3: S3Options | None = None, exact: bool = False) -> Path:
    """The local directory to read the checkpoint at ``url`` from.

    Whatever is returned has been verified in full: every file its marker lists (``.metadata`` among them)
    has the recorded size and CRC64NVME. A local path is read in place (it must hold its marker; every byte
    is read once to check it). For s3:// the copy at ``cache_path(url, cache_dir)`` (``exact``: at
    ``cache_dir`` itself) is used when it is complete and verifies against its own marker (no request to the
    remote); otherwise the missing or damaged files are fetched into it and checked against the remote
    marker. ``cache_dir`` None: ``$LINGCTL_CACHE_DIR/pcache``.
    """
    parsed = parse_url(url)
    if not parsed.is_s3:
        return _checked_in_place(parsed.path.absolute())
    if not parsed.prefix:
        raise UsageError(f"{url} names a bucket, not a checkpoint", hint="give s3://bucket/path/to/checkpoint")
    local = Path(cache_dir) if exact and cache_dir is not None else cache_path(url, cache_dir)
    try:
        problems = _read_problems(local) if local.is_dir() else ["no local copy"]
    except (VerificationError, UsageError) as exc:  # a damaged or unsafe marker: the fetch below replaces it
        problems = [str(exc)]
    if not problems:
        log.info("reading %s from its local copy %s", url, local)
        return local
    log.info("local copy %s of %s not usable (%s): fetching", local, url, problems[0])
    fetch(url, local, s3)
    problems = _read_problems(local)
    if problems:
        raise VerificationError(
            f"{url}: {problems[0]}; refusing to load it", hint="the remote checkpoint is not one lingctl saved whole"
        )
    log.info("reading %s from %s (fetched)", url, local)
    return local


def _checked_in_place(path: Path) -> Path:
    """A local or shared-filesystem checkpoint, read where it is once every file verifies."""
    if not path.is_dir():
        raise NotFoundError(f"checkpoint directory {path} does not exist")
    if read_marker(path) is None:
        raise VerificationError(
            f"{path}: incomplete checkpoint (no {MARKER})", hint="the save did not finish; read an earlier step"
        )
    problems = _read_problems(path)
    if problems:
        raise VerificationError(
            f"{path}: {problems[0]} ({len(problems)} problem(s)); refusing to load it",
            hint="the checkpoint is damaged or was changed after it was saved; read an earlier step",
        )
    return path


def _read_problems(local_dir: Path) -> list[str]:
    """``verify_local`` in full, plus what a reader needs beyond it: the marker lists ``.metadata``."""
    problems = verify_local(local_dir, mode="full")
    marker = read_marker(local_dir)
    if marker is not None and METADATA not in marker["files"]:
        problems.insert(0, f"{METADATA}: not listed in {MARKER}")
    return problems
