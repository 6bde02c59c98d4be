"""``--model s3://bucket/prefix``: a checkpoint directory in an object store, copied once per machine into
lingctl's cache and served from there. Other values (a local directory, a Hugging Face id) go to
``lingctl.model.hub.resolve_model_dir`` unchanged.

The copy is a babel sync of the whole prefix (sampled verification, as ``babel sync`` does by default) into
``CACHE/flood-models/<hash>/<name>``: ``<hash>`` is the first 16 hex digits of the SHA-256 of the endpoint
and the URL (one bucket name on two stores is two models), ``<name>`` the URL's last component, so the copy
keeps the checkpoint's name (answers name their model by it). Beside ``<hash>/`` are babel's journal
(``<hash>.journal/``, never inside the copy) and a lock file (``<hash>.lock``). Every call syncs again: a copy
that is up to date costs the two listings and transfers nothing, and an interrupted one is completed before
it is used.

Engines on one machine share the copy: each holds an exclusive ``flock`` on the lock file while it syncs, so
one copies and the others wait, then find nothing left to copy. A checkpoint is written once: one that is
replaced at the remote while a run on this machine reads its copy is out of scope.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lingctl.babel.sync import Syncer, SyncOptions, SyncResult
from lingctl.core.cache import cache_dir
from lingctl.core.errors import NotFoundError, UsageError, os_error
from lingctl.core.private_dir import ensure_private_dir, open_nofollow
from lingctl.core.storage import S3Options, StoreURL, check_key, parse_url
from lingctl.model.hub import resolve_model_dir

log = logging.getLogger(__name__)

CACHE = "flood-models"  # the cache subdirectory that holds the copies


@dataclass(frozen=True, slots=True)
class ModelCopy:
    """Where the node-local copy of one ``s3://`` checkpoint lives (nothing is created)."""

    url: StoreURL
    entry: Path  # CACHE/flood-models/<hash>: holds the copy and nothing else

    @classmethod
    def of(cls, url: StoreURL, s3: S3Options) -> ModelCopy:
        endpoint = s3.resolved_endpoint() or ""
        digest = hashlib.sha256(f"{endpoint}\0{url}".encode()).hexdigest()[:16]
        return cls(url=url, entry=cache_dir(CACHE) / digest)

    @property
    def path(self) -> Path:
        return self.entry / PurePosixPath(self.url.prefix).name

    @property
    def journal(self) -> Path:
        return self.entry.with_name(self.entry.name + ".journal")

    @property
    def lock(self) -> Path:
        return self.entry.with_name(self.entry.name + ".lock")


def flood_model_dir(spec: str | Path, *, option: str = "--model", s3: S3Options | None = None) -> Path:
    """The local model directory ``spec`` names: for ``s3://bucket/prefix`` this machine's copy of it, brought
    up to date first; anything else as ``resolve_model_dir`` resolves it. ``s3`` None: the AWS variables."""
    text = str(spec)
    if not text.lower().startswith("s3://"):
        return resolve_model_dir(spec, option=option)
    return fetch_model(parse_url(text), s3 or S3Options(), option=option)[0]


def fetch_model(url: StoreURL, s3: S3Options, *, option: str = "--model") -> tuple[Path, SyncResult]:
    """Sync the checkpoint at ``url`` into its copy (see the module docstring) under the machine-wide lock;
    the copy's directory and what the sync did. A failed copy raises babel's error for it, naming the first
    object that failed; a prefix with nothing under it (babel refuses to mirror one) a ``NotFoundError``."""
    if not url.prefix:
        raise UsageError(f"{option} {url} names a bucket, not a checkpoint", hint="give s3://bucket/path/to/checkpoint")
    try:
        check_key(url.prefix)  # no '.' or '..' segment: the last one names a directory of the cache
    except UsageError as exc:
        raise UsageError(f"{option} {url}: {exc.message}", hint=exc.hint) from None
    copy = ModelCopy.of(url, s3)
    _private_dirs(copy)
    fd = _locked(copy)
    try:
        result = Syncer(url, StoreURL("file", prefix=str(copy.path)), s3, _sync_options(copy)).run()
    except NotFoundError as exc:  # no bucket, or nothing under the prefix: the option that named it, first
        _forget_empty(copy)  # under the lock: another process may be about to copy into it
        raise NotFoundError(f"{option} {exc.message}", hint=exc.hint) from None
    finally:
        os.close(fd)  # releases the lock
    error = result.failure()
    if error is not None:
        raise type(error)(f"{option} {url}: copying into {copy.path} failed: {error.message}", hint=error.hint)
    log.info(
        "%s: %d file(s), %d byte(s) copied, %d already in %s",
        url,
        result.copied,
        result.copied_bytes,
        result.skipped,
        copy.path,
    )
    return copy.path, result


def _sync_options(copy: ModelCopy) -> SyncOptions:
    # delete: the copy is the prefix and nothing else (a checkpoint uploaded again as one file must not keep
    # the index of its old shards). babel deletes nothing after a failed copy, and refuses an empty prefix.
    return SyncOptions(delete=True, verify="sampled", state_dir=copy.journal)


def _private_dirs(copy: ModelCopy) -> None:
    """The cache's directories, created 0700, or refused when they are not this user's own."""
    root = copy.entry.parent
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, str(root.parent)) from exc
    for directory in (root, copy.entry, copy.journal, copy.path):
        ensure_private_dir(directory)


def _locked(copy: ModelCopy) -> int:
    """An open descriptor of the entry's lock file, holding an exclusive ``flock`` (waits for the holder)."""
    try:
        fd = open_nofollow(copy.lock, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise os_error(exc, str(copy.lock)) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process on this machine is copying it; waiting", copy.url)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:  # a filesystem without locks (ENOLCK)
        os.close(fd)
        raise os_error(exc, str(copy.lock)) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _forget_empty(copy: ModelCopy) -> None:
    """Remove what a copy of nothing left: its empty directories and its journal, unless an earlier copy is
    there. The lock file stays: removing one that another process may be waiting on would give two holders."""
    try:
        copy.path.rmdir()
        copy.entry.rmdir()
    except OSError:
        return  # holds an earlier copy, or is gone
    shutil.rmtree(copy.journal, ignore_errors=True)


__all__ = ["ModelCopy", "fetch_model", "flood_model_dir"]
