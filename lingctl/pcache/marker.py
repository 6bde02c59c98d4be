"""The files of a pcache checkpoint directory and its commit marker, and whether a directory matches it.

A checkpoint directory holds, for each writing rank R, ``__R_0.distcp`` (DCP's data file) and
``__R.pcache.json`` (the sidecar: size and CRC64NVME of R's files); DCP's ``.metadata``; and ``pcache.json``,
the commit marker. The coordinator writes the marker last, listing every other file with its size and CRC, so
a directory without it is a save that did not finish. Every name read from a marker or a sidecar is checked to
be one plain file name of the directory before it is joined to a path.

Torch-free: the flash tier and ``pcache status`` read checkpoints without importing it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lingctl.core.checksum import crc64_file
from lingctl.core.errors import LingctlError, UsageError, VerificationError
from lingctl.core.names import UnsafeNameError, check_relative, printable

MARKER = "pcache.json"
METADATA = ".metadata"
FORMAT = "lingctl-pcache"
VERSION = 1  # the newest marker version this lingctl reads and the one it writes
DATA_SUFFIX = ".distcp"  # DCP's own (``filesystem.DEFAULT_SUFFIX``), so stock readers find the files
RANK_PREFIX = "__"  # every file a rank writes (data files, sidecars) starts with it
SIDECAR_SUFFIX = ".pcache.json"
SIDECAR_GLOB = f"{RANK_PREFIX}*{SIDECAR_SUFFIX}"
# "sampled" checks the CRC of files up to this size and only the size of larger ones: the marker records one
# CRC per whole file, which sampled ranges cannot be compared against.
SAMPLED_CRC_MAX = 8 << 20
MODES = ("none", "sampled", "full")
_DAMAGED = "the checkpoint is damaged; fetch it again or pick another step"


# -- names --------------------------------------------------------------------------------------------------


def data_prefix(rank: int) -> str:
    """The start of rank ``rank``'s data file names (DCP's storage prefix): ``__R_``."""
    return f"{RANK_PREFIX}{rank}_"


def sidecar_name(rank: int) -> str:
    return f"{RANK_PREFIX}{rank}{SIDECAR_SUFFIX}"


def is_data_file(name: str, rank: int | None = None) -> bool:
    """Whether ``name`` is a data file (of ``rank``, when given)."""
    if rank is None:
        return name.startswith(RANK_PREFIX) and name.endswith(DATA_SUFFIX)
    return re.fullmatch(rf"{re.escape(data_prefix(rank))}\d+{re.escape(DATA_SUFFIX)}", name) is not None


def check_file_name(name: object, where: str) -> str:
    """``name`` when it can be a file of a checkpoint directory (one plain segment), else ``UnsafeNameError``."""
    checked = check_relative(name, what=where)
    if "/" in checked:
        raise UnsafeNameError(f"{where}: {printable(checked)!r} is not a file of the checkpoint directory itself")
    return checked


# -- the marker and the sidecars ----------------------------------------------------------------------------


def marker_bytes(world_size: int, files: dict[str, dict[str, Any]], extra: dict[str, Any]) -> bytes:
    """The marker the coordinator commits: every file with its size and CRC, and ``extra`` (plan figures, a
    training step)."""
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world_size,
        "created_unix": time.time(),
        "files": dict(sorted(files.items())),
        **extra,
    }
    return (json.dumps(marker, indent=1) + "\n").encode()


def check_files(files: object, where: str) -> dict[str, dict]:
    """``files`` of a marker or sidecar (name -> {"size": int, "crc64nvme": str}) after checking every entry."""
    if not isinstance(files, dict):
        raise VerificationError(f"{where}: 'files' is not an object", hint=_DAMAGED)
    for name, entry in files.items():
        check_file_name(name, f"{where}: file")
        size = entry.get("size") if isinstance(entry, dict) else None
        crc = entry.get("crc64nvme") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0 or not (crc is None or isinstance(crc, str)):
            raise VerificationError(
                f"{where}: the entry of {printable(name)!r} is not {{size, crc64nvme}}", hint=_DAMAGED
            )
    return files


def parse_marker(data: bytes, where: str) -> dict[str, Any]:
    """The marker in ``data`` after checking its shape and every file name in it (``where`` names it in
    errors): ``VerificationError`` for a damaged one, ``UnsafeNameError`` for a name that could leave the
    directory, ``UsageError`` for a newer format version."""
    try:
        marker = json.loads(data)
    except (ValueError, RecursionError):
        marker = None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise VerificationError(f"{where} is not a valid {FORMAT} marker", hint=_DAMAGED)
    version = marker.get("version", 1)
    if type(version) is not int or version > VERSION:
        raise UsageError(
            f"{where} has marker version {printable(repr(version))[:40]}, newer than this lingctl reads ({VERSION})",
            hint="upgrade lingctl",
        )
    check_files(marker.get("files"), where)
    return marker


def read_marker(local_dir: Path) -> dict[str, Any] | None:
    """The commit marker of ``local_dir``, or None when it has none (an unfinished save)."""
    path = Path(local_dir) / MARKER
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LingctlError(f"{path}: {exc.strerror or exc}") from exc
    return parse_marker(data, str(path))


def sidecar_files(path: Path) -> dict[str, dict]:
    """The files a rank's sidecar lists, each name and entry checked as a marker's are."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise VerificationError(f"{path}: unreadable ({exc})", hint="the checkpoint is damaged") from None
    if not isinstance(data, dict):
        raise VerificationError(f"{path}: not a JSON object", hint="the checkpoint is damaged")
    return check_files(data.get("files", {}), str(path))


# -- checking files against what was recorded --------------------------------------------------------------


def bad_files(local_dir: Path, expected: dict[str, dict], names: Iterable[str], mode: str) -> dict[str, str]:
    """name -> what is wrong with it, for ``names`` in ``local_dir`` against ``expected`` (size, crc64nvme)."""
    if mode not in MODES:
        raise UsageError(f"verify mode must be one of {', '.join(MODES)}, got {mode!r}")
    bad: dict[str, str] = {}
    to_crc: list[tuple[str, str]] = []
    for name in sorted(names):
        want = expected.get(name)
        if want is None:
            continue  # nothing recorded to compare with (a sidecar is listed only in the marker)
        try:
            size = (local_dir / check_file_name(name, f"{local_dir}: file")).stat().st_size
        except FileNotFoundError:
            bad[name] = "missing"
            continue
        if size != want["size"]:
            bad[name] = f"{size} bytes, expected {want['size']}"
        elif want.get("crc64nvme") and (mode == "full" or (mode == "sampled" and size <= SAMPLED_CRC_MAX)):
            to_crc.append((name, want["crc64nvme"]))
    if to_crc:
        with ThreadPoolExecutor(min(4, len(to_crc)), thread_name_prefix="pcache-crc") as pool:
            crcs = pool.map(lambda item: crc64_file(local_dir / item[0]).tagged(), to_crc)
            for (name, want_crc), got in zip(to_crc, crcs):
                if got != want_crc:
                    bad[name] = f"checksum {got}, expected {want_crc}"
    return bad


def file_problems(local_dir: Path, expected: dict[str, dict], names: Iterable[str], mode: str) -> list[str]:
    return [f"{name}: {what}" for name, what in bad_files(local_dir, expected, names, mode).items()]


def verify_local(local_dir: Path, *, mode: str = "full") -> list[str]:
    """Problems that keep ``local_dir`` from being read as a checkpoint; empty when complete and verified.

    ``full`` compares every file's size and CRC64NVME with the marker; ``sampled`` compares sizes, and CRCs
    only of files up to 8 MiB (sidecars, ``.metadata``, small shards); ``none`` compares sizes only.
    """
    marker = read_marker(Path(local_dir))
    if marker is None:
        return [f"no {MARKER}: incomplete checkpoint (the save did not finish)"]
    return file_problems(Path(local_dir), marker["files"], marker["files"], mode)
