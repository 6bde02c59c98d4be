"""Checkpoint directories laid out as the pcache writer leaves them, for the flash-tier tests."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from lingctl.core.checksum import crc64_bytes

MARKER = "pcache.json"


def _entry(data: bytes) -> dict:
    return {"size": len(data), "crc64nvme": crc64_bytes(data).tagged()}


def make_checkpoint(
    directory: Path, ranks: int = 2, sizes: Sequence[int | None] | None = None, *, marker: bool = True
) -> dict[str, bytes]:
    """Write a checkpoint of ``ranks`` ranks into ``directory``; return name -> bytes of every file.

    ``sizes[r]`` is the size of rank r's data file (None: that rank writes no data file, only its sidecar).
    Data and ``.metadata`` are random bytes; sidecars and the marker carry their true sizes and CRCs.
    ``marker=False`` leaves the directory as a save that crashed before its commit.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sizes = list(sizes) if sizes is not None else [40_000 + 1_000 * r for r in range(ranks)]
    files: dict[str, bytes] = {}
    for rank, size in enumerate(sizes):
        own = {}
        if size is not None:
            own[f"__{rank}_0.distcp"] = os.urandom(size)
        sidecar = {"rank": rank, "files": {name: _entry(data) for name, data in own.items()}}
        own[f"__{rank}.pcache.json"] = json.dumps(sidecar).encode()
        files.update(own)
    files[".metadata"] = os.urandom(3_000)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    if marker:
        doc = {
            "format": "lingctl-pcache",
            "version": 1,
            "world_size": len(sizes),
            "created_unix": time.time(),
            "files": {name: _entry(data) for name, data in sorted(files.items())},
        }
        files[MARKER] = json.dumps(doc).encode()
        (directory / MARKER).write_bytes(files[MARKER])
    return files


def split_node(directory: Path, node_dir: Path, ranks: Sequence[int]) -> None:
    """Move the files of ``ranks`` from ``directory`` to ``node_dir``, as another node's cache would hold them."""
    node_dir.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        for path in directory.glob(f"__{rank}[._]*"):
            shutil.move(path, node_dir / path.name)


def flip_byte(path: Path, offset: int = 100) -> None:
    """Damage one byte in place, keeping the file's size and modification time (as bit rot would)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
