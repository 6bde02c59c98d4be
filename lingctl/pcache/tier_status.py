"""What state each checkpoint of the flash tier is in: its marker, its recorded uploads, its remote copy.

States, in the order they are decided:

- ``durable``: the remote holds ``pcache.json`` and every file it lists, with the listed sizes (and CRCs,
  where the store records them). Nothing else matters once this is true.
- ``upload-failed``: an upload recorded an error, or stopped without finishing (its process is gone), or
  the remote has a marker whose files do not match.
- ``uploading``: an upload is running, or this node's ranks sent their files and the coordinator has not
  sent the marker yet.
- ``incomplete``: no marker locally (a save that did not finish). Only the coordinator's node holds the
  marker, so other nodes show their copy as ``incomplete`` until it is uploaded.
- ``local-only``: complete locally, not uploaded.
- ``unreadable``: the local ``pcache.json`` cannot be judged: it is damaged, holds unsafe names, or was
  written by a newer lingctl (the problem says which). Decided in place of ``incomplete``/``local-only``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.atomic import TMP_MARKER, atomic_write
from lingctl.core.cache import cache_root
from lingctl.core.errors import LingctlError, NotFoundError, VerificationError, os_error
from lingctl.core.private_dir import ensure_private_dir
from lingctl.core.storage import ObjectStore, S3Options, open_store, parse_url
from lingctl.pcache.marker import MARKER, is_data_file, parse_marker, read_marker

log = logging.getLogger(__name__)

STATE_DIR = ".pcache"  # where older releases kept progress, beside the checkpoint; read for compatibility
# The state directory may be readable by others (it names checkpoints), never writable: see ensure_state_dir.
_WRITE_BY_OTHERS = 0o022
STATES = ("incomplete", "local-only", "uploading", "durable", "upload-failed", "unreadable")
MAX_DEPTH = 3  # how far below the given path checkpoints are looked for: <root>/<run>/<step>/... is typical


# -- recorded progress --------------------------------------------------------------------------------------


def state_dir(local_dir: Path) -> Path:
    """Where progress of ``local_dir`` is recorded: in lingctl's cache directory, keyed by the checkpoint's
    real path, never beside or inside it (a run directory holds only what the run wrote, so a sync of it
    copies no tool state)."""
    real = os.path.realpath(os.path.abspath(local_dir))
    return cache_root() / "pcache" / "state" / hashlib.sha256(real.encode()).hexdigest()[:16]


def ensure_state_dir(local_dir: Path) -> Path:
    """``state_dir(local_dir)``, created: the cache directory and every directory below it must belong to
    this user and be writable by nobody else (created 0700), since others could plant links in them."""
    root = cache_root()
    state = state_dir(local_dir)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, str(root.parent)) from exc
    chain = [root]
    for part in state.relative_to(root).parts:
        chain.append(chain[-1] / part)
    for directory in chain:  # each one checked protects the next: nobody else can replace entries in it
        ensure_private_dir(directory, deny=_WRITE_BY_OTHERS)
    return state


def _legacy_state_dir(local_dir: Path) -> Path:
    """Where older releases recorded progress: ``<parent>/.pcache/<name>``; still read, never written."""
    local_dir = Path(local_dir).absolute()
    return local_dir.parent / STATE_DIR / local_dir.name


def _state_path(local_dir: Path, rank: int | None) -> Path:
    return ensure_state_dir(local_dir) / f"upload-{'all' if rank is None else f'rank{rank}'}.json"


def record(local_dir: Path, rank: int | None, remote: str, phase: str, **extra: Any) -> None:
    state = {
        "remote": remote,
        "rank": rank,
        "phase": phase,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "updated_unix": time.time(),
        "local_dir": str(Path(local_dir).absolute()),
        **extra,
    }
    try:
        with atomic_write(_state_path(local_dir, rank)) as (_, f):
            f.write(json.dumps(state).encode())
    except LingctlError as exc:  # progress notes are advisory: losing one must not fail the upload itself
        log.warning("could not record upload progress of %s: %s", local_dir, exc)


def records(local_dir: Path) -> list[dict[str, Any]]:
    """Every recorded upload of ``local_dir`` (one per uploading process), newest first."""
    out = []
    paths = [*state_dir(local_dir).glob("upload-*.json"), *_legacy_state_dir(local_dir).glob("upload-*.json")]
    for path in paths:
        try:
            rec = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError):
            continue  # a note being replaced right now; the next look will see it
        # Notes are advisory: one that is not what record() writes is skipped, never trusted.
        if (
            isinstance(rec, dict)
            and isinstance(rec.get("remote"), str)
            and isinstance(rec.get("updated_unix", 0), (int, float))
        ):
            out.append(rec)
    return sorted(out, key=lambda r: r.get("updated_unix", 0), reverse=True)


def recorded_remote(local_dir: Path) -> str | None:
    """The destination the last upload of ``local_dir`` was sent to, if any."""
    found = records(local_dir)
    return found[0]["remote"] if found else None


# -- remote checks ------------------------------------------------------------------------------------------


def remote_sizes(store: ObjectStore) -> dict[str, int]:
    return {info.key: info.size for info in store.list("", recursive=False) if not info.is_dir}


def remote_problems(store: ObjectStore, files: dict[str, dict], sizes: dict[str, int]) -> list[str]:
    """What keeps ``files`` (name -> size, crc64nvme) at ``store`` from matching the marker.

    CRCs are compared only where the store keeps one per object (S3: one HEAD each); a shared filesystem keeps
    none, and computing them would read the whole checkpoint back (``babel verify --mode full`` does that).
    """
    problems = []
    for name, want in sorted(files.items()):
        have = sizes.get(name)
        if have is None:
            problems.append(f"{name}: missing at the remote")
        elif have != want["size"]:
            problems.append(f"{name}: {have} bytes at the remote, expected {want['size']}")
    if problems or not store.records_checksums:
        return problems
    names = sorted(n for n, f in files.items() if f.get("crc64nvme"))
    with ThreadPoolExecutor(16, thread_name_prefix="pcache-head") as pool:
        for name, got in zip(names, pool.map(store.checksum, names)):
            if got is not None and got != files[name]["crc64nvme"]:
                problems.append(f"{name}: checksum {got} at the remote, expected {files[name]['crc64nvme']}")
    return problems


# -- status -------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class CheckpointStatus:
    name: str  # relative to the path given to status(); the directory's own name when it is the checkpoint
    local_dir: Path
    remote: str | None
    state: str  # one of STATES
    files: int  # files of the checkpoint on this node
    bytes: int
    uploaded_bytes: int  # of those bytes, what the remote holds with the same sizes
    problems: list[str] = field(default_factory=list)


def is_checkpoint(directory: Path) -> bool:
    try:
        with os.scandir(directory) as it:
            return any(e.name == MARKER or is_data_file(e.name) for e in it)
    except OSError:
        return False


def find_checkpoints(path: Path, depth: int = MAX_DEPTH) -> list[Path]:
    """Checkpoint directories at or below ``path`` (not below a checkpoint), in name order; hidden
    directories (recorded progress, babel journals) are skipped."""
    if is_checkpoint(path):
        return [path]
    if depth == 0:
        return []
    found: list[Path] = []
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
            found += find_checkpoints(Path(entry.path), depth - 1)
    return found


def status(path: Path, remote_url: str | None = None, s3: S3Options | None = None) -> list[CheckpointStatus]:
    """The state of every checkpoint at or below ``path`` (up to three levels down).

    ``remote_url`` is where ``path`` is uploaded to (a checkpoint below it goes to the same relative path
    there); without it, each checkpoint's remote is the one its last upload recorded.
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise NotFoundError(f"directory {path} does not exist")
    root = parse_url(remote_url) if remote_url else None
    out = []
    for directory in find_checkpoints(path):
        rel = directory.relative_to(path).as_posix()
        name = directory.name if rel == "." else rel
        remote = None if root is None else str(root if rel == "." else root.join(rel))
        out.append(checkpoint_status(directory, name=name, remote=remote, s3=s3))
    return out


def _alive(rec: dict[str, Any]) -> bool:
    """Whether the process that wrote ``rec`` may still be uploading (another host's cannot be checked)."""
    if rec.get("host") != socket.gethostname() or not rec.get("pid"):
        return True
    try:
        os.kill(int(rec["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _local_files(local_dir: Path) -> dict[str, int]:
    out = {}
    for entry in os.scandir(local_dir):
        try:
            if entry.is_file() and TMP_MARKER not in entry.name:
                out[entry.name] = entry.stat().st_size
        except FileNotFoundError:
            continue  # removed while we looked (a temporary renamed into place, a pruned checkpoint)
    return out


def checkpoint_status(
    local_dir: Path, *, name: str, remote: str | None, s3: S3Options | None = None
) -> CheckpointStatus:
    local_dir = Path(local_dir).absolute()
    unreadable = False
    problems: list[str] = []
    try:
        local = _local_files(local_dir)
    except OSError as exc:  # one directory we may not read does not end the report on the others
        local, unreadable = {}, True
        problems.append(f"cannot list {local_dir}: {exc.strerror or exc}")
    recs = records(local_dir)
    remote = remote or (recs[0]["remote"] if recs else None)
    st = CheckpointStatus(
        name=name,
        local_dir=local_dir,
        remote=remote,
        state="local-only",
        files=len(local),
        bytes=sum(local.values()),
        uploaded_bytes=0,
        problems=problems,
    )
    try:
        marker = read_marker(local_dir)
    except LingctlError as exc:  # damaged, unsafe, newer or unreadable: say so, go on with the others
        marker, unreadable = None, True
        st.problems.append(str(exc))
    remote_state = None
    if remote is not None:
        recs = [r for r in recs if r.get("remote") == remote]  # uploads elsewhere say nothing about this one
        remote_state = _remote_state(st, remote, s3, local, marker)
    st.state = _decide(st, recs, remote_state, unreadable=unreadable, complete=marker is not None)
    return st


def _remote_state(
    st: CheckpointStatus, remote: str, s3: S3Options | None, local: dict[str, int], marker: dict[str, Any] | None
) -> str:
    """What the remote holds of the checkpoint: "ok" / "bad" (a marker whose files match / do not), "absent"
    (no marker there), "unreachable" (it could not be asked). Sets ``st.uploaded_bytes``; adds problems."""
    try:
        store = open_store(remote, s3)
        sizes = remote_sizes(store)
        st.uploaded_bytes = sum(size for n, size in local.items() if sizes.get(n) == size)
        if MARKER not in sizes:
            return "absent"
        files = parse_marker(store.read(MARKER), f"{remote}/{MARKER}")["files"]
        bad = remote_problems(store, files, sizes)
        if marker is not None and marker["files"] != files:
            bad.insert(0, f"the remote {MARKER} is not this checkpoint's")
        st.problems += bad
        return "bad" if bad else "ok"
    except VerificationError as exc:  # a damaged or hostile remote marker: the remote copy is bad
        st.problems.append(str(exc))
        return "bad"
    except LingctlError as exc:
        st.problems.append(f"remote not checked: {exc}")
        return "unreachable"


def _decide(
    st: CheckpointStatus, recs: list[dict[str, Any]], remote_state: str | None, *, unreadable: bool, complete: bool
) -> str:
    """The state, in the order of the module docstring (``remote_state`` None: no remote known); adds the
    problems that explain a failed upload."""
    phases = {r.get("phase") for r in recs}
    failed = [r for r in recs if r.get("phase") == "failed"]
    dead = [r for r in recs if r.get("phase") == "uploading" and not _alive(r)]
    if remote_state == "ok" or (remote_state == "unreachable" and phases == {"durable"}):
        return "durable"
    if failed or dead:
        st.problems += [f"upload failed: {r.get('error')}" for r in failed]
        st.problems += [f"upload stopped before finishing (process {r.get('pid')} is gone)" for r in dead]
        return "upload-failed"
    if phases & {"uploading", "uploaded"}:
        return "uploading"
    if remote_state == "bad" or (remote_state == "absent" and "durable" in phases):
        if remote_state == "absent":
            st.problems.append(f"an upload finished, but the remote has no {MARKER} now")
        return "upload-failed"
    if unreadable:
        return "unreadable"
    return "local-only" if complete else "incomplete"


def raise_for_failed(rows: list[CheckpointStatus]) -> None:
    """One error for the checkpoints whose upload failed (``lingctl pcache status`` exits 1 with it), naming
    the first and the command that finishes it."""
    failed = [r for r in rows if r.state == "upload-failed"]
    if failed:
        first = failed[0]
        why = f": {first.problems[0]}" if first.problems else ""
        raise LingctlError(
            f"{len(failed)} checkpoint upload(s) failed; first: {first.name}{why}",
            hint=f"lingctl pcache upload {first.local_dir} --to {first.remote or 'URL'}",
        )
