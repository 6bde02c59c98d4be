"""The end-to-end tour behind `make demo`: each tool adds its part as it lands.

Today: `lingctl doctor`, then a storage round trip (put, list, get, verify) through a local S3-compatible
server (`rclone serve s3`) that this script starts on 127.0.0.1 and stops again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lingctl.core.local_s3 import serve_s3


def lingctl(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "lingctl", *args]
    print(f"\n$ lingctl {' '.join(args)}", flush=True)
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0:
        sys.exit(f"demo: 'lingctl {' '.join(args)}' exited with {rc}")


def main() -> None:
    lingctl("doctor")
    with tempfile.TemporaryDirectory(prefix="lingctl-demo-") as tmp:
        with serve_s3(Path(tmp) / "s3", buckets=["demo"]) as server:
            print(f"\nlocal S3 server (rclone serve s3) at {server.endpoint}, pid {server.pid}", flush=True)
            env = {**os.environ, **server.env()}
            lingctl("doctor", "--probe", "s3://demo/roundtrip", "--probe-size", "64MiB", env=env)
    print("\ndemo finished: the S3 server is stopped and its files removed.")


if __name__ == "__main__":
    main()
