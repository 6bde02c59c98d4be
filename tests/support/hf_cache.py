"""A real Hugging Face cache entry built from a local directory, for tests that resolve ``ORG/NAME`` ids
without network.

The layout is the one ``huggingface_hub`` writes when it downloads a model::

    HF_HOME/hub/models--ORG--NAME/
        blobs/<etag>                        file contents, named by the Hub's etag
        refs/<revision>                     the commit hash the branch or tag points at (no newline)
        snapshots/<commit>/<file>           relative symlinks: ../../blobs/<etag>

A regular git file's etag is its git blob id (sha1 of ``blob <size>\\0`` + contents); a file the Hub keeps
in LFS (weights) has its sha256 as etag.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

# Extensions the Hub's default .gitattributes sends to LFS (the ones a model directory holds).
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")


def cache_repo(hf_home: Path, repo_id: str, src: Path, *, revision: str = "main", commit: str | None = None) -> Path:
    """Put every file under ``src`` into ``hf_home``'s hub cache as ``repo_id`` at ``commit`` (default: a hash
    of the contents), point ``refs/<revision>`` at it unless ``revision`` is the commit itself, and return
    the snapshot directory. Entries already there are kept, as repeated downloads keep them."""
    files = sorted(p for p in Path(src).rglob("*") if p.is_file())
    if commit is None:
        digest = hashlib.sha1(repo_id.encode())
        for f in files:
            digest.update(f.relative_to(src).as_posix().encode() + b"\0" + _etag(f).encode())
        commit = digest.hexdigest()
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit must be 40 lowercase hex digits, got {commit!r}")
    repo = Path(hf_home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        blob = blobs / _etag(f)
        if not blob.exists():
            tmp = blob.with_name(blob.name + ".incomplete")  # the suffix huggingface_hub downloads under
            shutil.copyfile(f, tmp)
            os.replace(tmp, blob)
        link = snapshot / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    if revision != commit:
        ref = repo / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return snapshot


def _etag(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix in _LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
