"""Copies between a checkpoint directory and its remote, in either direction: one babel sync of named files.

Transfers go through babel's ``Syncer`` (multipart, retries, verification, a journal that lets a re-run
continue where an interrupted one stopped); the journal lives in the checkpoint's state directory
(``tier_status.state_dir``), never beside the checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from lingctl.babel.sync import Syncer, SyncOptions, SyncResult
from lingctl.core.errors import RetryableError, VerificationError
from lingctl.core.storage import S3Options, StoreURL
from lingctl.pcache.tier_status import ensure_state_dir


def journal_dir(local_dir: Path, kind: str, remote: StoreURL) -> Path:
    """babel's journal for one kind of transfer (``journal-rank3``, ``fetch``) of ``local_dir`` with ``remote``."""
    return ensure_state_dir(local_dir) / f"{kind}-{hashlib.sha256(str(remote).encode()).hexdigest()[:12]}"


def _glob_literal(name: str) -> str:
    """An anchored babel include pattern for ``name``: exact, except that '[' becomes '?' (a class holding
    '[' is a nested set to Python's re). Checkpoint file names hold no '['; other names are only sent when a
    whole directory is (rank None), where matching one more of its files changes nothing."""
    return "/" + "".join({"*": "[*]", "?": "[?]", "[": "?"}.get(c, c) for c in name)


def sync_files(
    src: StoreURL,
    dst: StoreURL,
    s3: S3Options,
    names: Iterable[str],
    *,
    journal: Path,
    verify: str,
    jobs: int,
    commit_last: str | None = None,
) -> SyncResult:
    """Copy ``names`` from ``src`` to ``dst`` (those already there are skipped); a failed copy raises one
    error naming the first (``VerificationError`` when a copy failed its check, else ``RetryableError``)."""
    opts = SyncOptions(
        include=[_glob_literal(n) for n in names], verify=verify, jobs=jobs, commit_last=commit_last, state_dir=journal
    )
    result = Syncer(src, dst, s3, opts).run()
    if result.failed:
        first = result.failed[0]
        kind = VerificationError if any(f.get("kind") == "verify" for f in result.failed) else RetryableError
        raise kind(
            f"{len(result.failed)} file(s) failed to copy to {dst}; first: {first['key']}: {first['error']}",
            hint="run the upload again: finished files are kept",
        )
    return result
