"""Per-request cost of S3 object requests: boto3's client vs lingctl's signed HTTP client.

Starts one ``rclone serve s3`` on 127.0.0.1 (``lingctl.core.local_s3.serve_s3``) and sends, from 16 threads,
N PUTs of 16 KiB objects (CRC64NVME header and two metadata entries, as a copy sends them) and then N GETs
of them, through each client in turn:

- ``boto3``: ``make_client`` with one attempt per request and no ``Expect: 100-continue`` (as the S3 store
  configures it);
- ``signed-http``: ``SignedS3Client`` as it signs by default (``UNSIGNED-PAYLOAD``, since the PUTs carry a
  CRC64NVME header), and ``sha256-payload``: the same with the body's SHA-256 in the signature.

Rounds interleave the clients, the order rotating, and figures are medians. CPU is this process's (all
threads, user + system from ``getrusage``; on loopback the kernel's TCP work is system time), server CPU
comes from /proc. With ``--rclone``, ``rclone copy`` of the same N files up (and back down) is timed for
reference; its figures include process start-up, listing both sides and, on upload, a HEAD after each PUT.

    .venv/bin/python bench/s3_request_cost.py [--objects 2000] [--rounds 3] [--threads 16] [--rclone] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lingctl.core.checksum import crc64_bytes
from lingctl.core.local_s3 import find_rclone, serve_s3
from lingctl.core.storage.s3.client import S3Options, make_client
from lingctl.core.storage.s3.signed_http import SignedS3Client

BUCKET = "cost"
SIZE = 16 << 10
_TICK = os.sysconf("SC_CLK_TCK")


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _boto3_client(endpoint: str) -> tuple[Any, Any]:
    import botocore.handlers

    client = make_client(S3Options(endpoint_url=endpoint), attempts=1)
    client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)

    def put(key: str, body: bytes, meta: dict[str, str], crc: str) -> None:
        client.put_object(Bucket=BUCKET, Key=key, Body=body, ChecksumCRC64NVME=crc, Metadata=meta)

    def get(key: str) -> bytes:
        return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    return put, get


def _signed_client(endpoint: str, threads: int, sign_payload: bool | None) -> tuple[Any, Any]:
    client = SignedS3Client(
        S3Options(endpoint_url=endpoint), BUCKET, max_connections=threads, sign_payload=sign_payload
    )

    def put(key: str, body: bytes, meta: dict[str, str], crc: str) -> None:
        client.put(key, body, metadata=meta, checksum_crc64nvme_b64=crc)

    def get(key: str) -> bytes:
        return client.get(key)[0]

    return put, get


def _timed(pool: ThreadPoolExecutor, fn: Any, args: list[tuple], server_pid: int) -> dict[str, float]:
    before, server, wall = resource.getrusage(resource.RUSAGE_SELF), _server_cpu(server_pid), time.perf_counter()
    for _ in pool.map(lambda a: fn(*a), args):
        pass
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"wall": wall, "cpu": user + system, "sys": system, "server_cpu": _server_cpu(server_pid) - server}


def _rclone(args: list[str], env: dict[str, str]) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{args[1]} failed: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}")
    return {"wall": time.perf_counter() - start, "cpu": usage.ru_utime + usage.ru_stime, "sys": usage.ru_stime}


def _versions() -> str:
    import boto3
    import botocore
    import urllib3

    rclone = find_rclone()
    server = (
        subprocess.run([rclone, "version"], capture_output=True, text=True).stdout.split("\n")[0]
        if rclone
        else "rclone ?"
    )
    return (
        f"Python {sys.version.split()[0]}, boto3 {boto3.__version__}, botocore {botocore.__version__}, "
        f"urllib3 {urllib3.__version__}, {server}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--rclone", action="store_true", help="also time rclone copy of the same files")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    block = os.urandom(SIZE + a.objects)
    bodies = [block[i : i + SIZE] for i in range(a.objects)]  # all different, cheap to make
    crcs = [crc64_bytes(b).b64() for b in bodies]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="s3-cost-") as tmp, serve_s3(Path(tmp) / "root", [BUCKET]) as server:
        os.environ.update(server.env())
        clients = {
            "boto3": _boto3_client(server.endpoint),
            "signed-http": _signed_client(server.endpoint, a.threads, None),
            "sha256-payload": _signed_client(server.endpoint, a.threads, True),
        }
        names = list(clients)
        with ThreadPoolExecutor(a.threads) as pool:
            for r in range(a.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    put, get = clients[name]
                    keys = [f"{name}/{r}/obj-{i:05d}" for i in range(a.objects)]
                    # Untimed: opens connections, and creates the directory, which rclone serve s3 can fail
                    # to do under concurrent PUTs (InternalError "Dir.Rename error"), for either client.
                    put(f"{name}/{r}/warm", bodies[0], {}, crcs[0])
                    meta = {"mtime": "1700000000.25", "lingctl-crc64nvme": crcs[0]}
                    row = results.setdefault(name, {"put": [], "get": []})
                    row["put"].append(
                        _timed(
                            pool,
                            put,
                            [(k, b, {**meta, "lingctl-crc64nvme": c}, c) for k, b, c in zip(keys, bodies, crcs)],
                            server.pid,
                        )
                    )
                    row["get"].append(_timed(pool, get, [(k,) for k in keys], server.pid))
        if a.rclone:
            rclone = find_rclone()
            assert rclone is not None
            src = Path(tmp) / "src"
            src.mkdir()
            for i, body in enumerate(bodies):
                (src / f"obj-{i:05d}").write_bytes(body)
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("RCLONE_")},
                "RCLONE_CONFIG_B_TYPE": "s3",
                "RCLONE_CONFIG_B_PROVIDER": "Other",
                "RCLONE_CONFIG_B_ENDPOINT": server.endpoint,
                "RCLONE_CONFIG_B_REGION": server.region,
                "RCLONE_CONFIG_B_ACCESS_KEY_ID": server.access_key,
                "RCLONE_CONFIG_B_SECRET_ACCESS_KEY": server.secret_key,
                "RCLONE_CONFIG_B_FORCE_PATH_STYLE": "true",
                "RCLONE_CONFIG_B_NO_CHECK_BUCKET": "true",
            }
            flags = ["--transfers", str(a.threads), "--checkers", str(a.threads)]
            row = results.setdefault("rclone copy", {"put": [], "get": []})
            for r in range(a.rounds):
                row["put"].append(_rclone([rclone, "copy", *flags, str(src), f"b:{BUCKET}/rclone/{r}"], env))
                row["get"].append(
                    _rclone([rclone, "copy", *flags, f"b:{BUCKET}/rclone/{r}", str(Path(tmp) / f"down-{r}")], env)
                )
    summary = {
        name: {
            op: {k: statistics.median(run[k] for run in runs) * 1e6 / a.objects for k in runs[0]}
            for op, runs in ops.items()
        }
        for name, ops in results.items()
    }
    if a.json:
        print(
            json.dumps(
                {
                    "objects": a.objects,
                    "size": SIZE,
                    "threads": a.threads,
                    "versions": _versions(),
                    "us_per_request": summary,
                }
            )
        )
        return
    print(
        f"{a.objects} x {SIZE >> 10} KiB, {a.threads} threads, median of {a.rounds}; microseconds per request; "
        f"{_versions()}"
    )
    base = summary["boto3"]
    for op in ("put", "get"):
        for name, ops in summary.items():
            s = ops[op]
            ratio = f"cpu {s['cpu'] / base[op]['cpu']:.2f}x  wall {s['wall'] / base[op]['wall']:.2f}x of boto3"
            server_cpu = f"  server cpu {s['server_cpu']:7.0f}" if "server_cpu" in s else ""
            print(
                f"{op:3} {name:17} wall {s['wall']:7.0f}  cpu {s['cpu']:7.0f} (sys {s['sys']:4.0f}){server_cpu}   "
                f"{ratio}"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
