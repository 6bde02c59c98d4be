"""Look at one running process from outside: its trace ring if it is traced, its OS and GPU figures always.

Reading a ring is a few ``struct`` reads of shared memory, so a snapshot costs the traced process nothing.
Python stacks come from the process itself: a traced process has ``faulthandler`` registered on
``STACKS_SIGNAL`` and dumps every thread's stack into ``<ring dir>/<pid>.stacks``, which works even while
its main thread is stuck in native code holding the GIL (a Python-level handler would never run). A process
is signalled only once it is shown to be a traced process of the ring directory's owner (``stacks.py``: the
default action of that signal is to terminate it); the stacks of any other come from ``py-spy dump`` when
py-spy is installed.

This module must stay cheap to import: no torch, so the first snapshot appears in a fraction of a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError, NotFoundError, UsageError
from lingctl.timer.ring import NO_GROUP, Header, Kind, Record, RingReader, check_ring_dir, ring_dir, user_ring_dir
from lingctl.timer.steps import breakdown, kind_name, op_name

NOT_TRACED = "not traced: no step times; start it under `lingctl timer run` or call lingctl.timer.install()"
STACKS_TIMEOUT_S = 2.0
STALE_HEARTBEAT_S = 1.0  # the tracer beats every 0.1 s; a second of silence means its thread cannot run


def find_ring(pid: int, create_time: float | None = None, uid: int | None = None) -> Path | None:
    """The ring of process ``pid`` if it is traced: ours, or (for root) the one in its owner's ring dir.

    A ring left by an earlier process with the same pid is ignored (its start time differs). A ring directory
    that is not private to its user is refused (``AccessDeniedError``): what is in it may have been planted.
    """
    candidates: list[tuple[Path, int | None]] = [(ring_dir(), None)]
    if uid is not None and uid != os.getuid():
        candidates.append((user_ring_dir(uid), uid))
    for directory, owner in candidates:
        if not check_ring_dir(directory, owner):
            continue
        path = directory / f"{pid}.ring"
        try:
            reader = RingReader(path, owner=owner)
        except (OSError, ValueError):
            continue
        try:
            h = reader.header()
        finally:
            reader.close()
        if h.pid == pid and (create_time is None or abs(h.create_time - create_time) < 0.01):
            return path
    return None


def ask_for_stacks(pid: int, ring: Path, timeout: float = STACKS_TIMEOUT_S) -> tuple[str | None, str | None]:
    """(all threads' Python stacks, None) from traced process ``pid``, or (None, why not).

    The stacks file is the tracer's ``stacks_path(pid)`` beside its ring, opened as ``dump_stacks`` says. The
    process is signalled only when it is shown to be a traced process of the user who owns the ring
    directory (``stacks.py``): a ring names its pid, and a ring is data that its owner, not necessarily the
    process's, wrote."""
    from lingctl.timer.stacks import NotProvenTraced, dump_stacks

    owner = None
    try:
        owner = os.lstat(ring.parent).st_uid
        text = dump_stacks(pid, ring.parent / f"{pid}.stacks", owner=owner, timeout=timeout)
    except NotProvenTraced as err:
        return None, (
            f"not requested: process {pid} could not be shown to be a traced process of the ring's owner "
            f"(uid {owner}): {err}"
        )
    except (FileNotFoundError, ProcessLookupError):
        return None, "not requested: the process has exited or is no longer traced"
    except OSError as exc:
        return None, f"not requested: {exc.strerror or exc}"
    if text is None:
        return None, f"no stack dump from the process within {timeout:.0f} s"
    return text, None


def request_stacks(pid: int, ring: Path, timeout: float = STACKS_TIMEOUT_S) -> str | None:
    """``ask_for_stacks`` without the reason: the stacks, or None."""
    return ask_for_stacks(pid, ring, timeout)[0]


def py_spy() -> str | None:
    """The py-spy executable: on PATH, else beside this Python (installed in the same environment)."""
    found = shutil.which("py-spy")
    if found:
        return found
    local = Path(sys.prefix) / "bin" / "py-spy"
    return str(local) if local.is_file() and os.access(local, os.X_OK) else None


def py_spy_stacks(pid: int, timeout: float = 10.0) -> tuple[str | None, str | None]:
    """(stacks, None) from ``py-spy dump``, or (None, why not)."""
    exe = py_spy()
    if exe is None:
        return None, "py-spy is not installed (pip install py-spy) so stacks of an untraced process are unavailable"
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump did not answer within {timeout:.0f} s"
    if r.returncode != 0:
        reason = (r.stderr.strip() or r.stdout.strip()).splitlines()
        return None, f"py-spy dump failed: {reason[-1] if reason else f'exit {r.returncode}'}"
    return r.stdout, None


def open_process(pid: int) -> Any:
    """A ``psutil.Process`` we may inspect; one-line errors for a missing pid or someone else's process."""
    import psutil

    if pid <= 0:  # 0 and negative numbers name process groups to kill(), never one process
        raise UsageError(f"pid {pid} is not a process id (process ids are positive numbers)")
    try:
        proc = psutil.Process(pid)
        uid = proc.uids().real
        if os.getuid() != 0 and uid != os.getuid():
            raise LingctlError(f"process {pid} belongs to {_user(uid)}; attach as that user (or root)")
        proc.memory_info()  # the figures we read later: fail now, once, if they are off limits
    except psutil.NoSuchProcess:
        raise NotFoundError(f"no process with pid {pid}") from None
    except psutil.AccessDenied:
        raise access_denied(pid) from None
    return proc


def access_denied(pid: int) -> LingctlError:
    return LingctlError(f"not allowed to inspect process {pid}; attach as its user (or root)")


def _user(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name}"
    except (KeyError, ImportError):
        return f"uid {uid}"


# -- GPU (NVML) ----------------------------------------------------------------------------------------
_nvml: dict[str, Any] = {}


def gpu_facts(pid: int) -> tuple[list[dict] | None, str | None]:
    """The GPUs process ``pid`` holds memory on, through NVML; (None, why) where NVML does not initialise."""
    if "error" in _nvml:
        return None, _nvml["error"]
    try:
        import pynvml

        if "ok" not in _nvml:
            pynvml.nvmlInit()
            _nvml["ok"] = True
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            used = None
            for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                for p in fn(handle):
                    if p.pid == pid:
                        used = (used or 0) + (p.usedGpuMemory or 0)
            if used is None:
                continue
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            out.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "process_memory_bytes": used,
                    "utilization_percent": util.gpu,
                    "memory_used_bytes": mem.used,
                    "memory_total_bytes": mem.total,
                }
            )
        return out, None
    except Exception as err:  # no driver, no library, no device: GPU figures are optional
        _nvml["error"] = f"no GPU figures (NVML: {err})"
        return None, _nvml["error"]


# -- snapshots -----------------------------------------------------------------------------------------
class Attacher:
    """Repeated snapshots of one process, keeping what the next one can reuse: the psutil handle (so CPU %
    covers the time since the previous snapshot) and the ring's records read so far."""

    def __init__(self, pid: int, *, window_steps: int = 20) -> None:
        self.pid = pid
        self.window_steps = window_steps
        self.proc = open_process(pid)
        self.proc.cpu_percent(None)  # starts the CPU-time interval the next reading covers
        self.ring_file = find_ring(pid, self.proc.create_time(), self.proc.uids().real)
        self.reader = RingReader(self.ring_file) if self.ring_file is not None else None
        self.records: deque[Record] = deque(maxlen=self.reader.header().capacity if self.reader else 1)
        self._next = 0

    @property
    def traced(self) -> bool:
        return self.reader is not None

    def snapshot(self, *, stacks: bool = False) -> dict:
        import psutil

        try:
            with self.proc.oneshot():
                mem = self.proc.memory_info()
                process = {
                    "cmdline": self.proc.cmdline(),
                    "status": self.proc.status(),
                    "cpu_percent": self.proc.cpu_percent(None),
                    "rss_bytes": mem.rss,
                    "threads": self.proc.num_threads(),
                    "user": self.proc.username(),
                }
        except psutil.NoSuchProcess:
            raise NotFoundError(f"process {self.pid} exited") from None
        except psutil.AccessDenied:
            raise access_denied(self.pid) from None
        gpus, gpu_note = gpu_facts(self.pid)
        snap: dict[str, Any] = {
            "pid": self.pid,
            "traced": self.traced,
            "note": None if self.traced else NOT_TRACED,
            "time": time.time(),
            "process": process,
            "gpus": gpus,
            "gpu_note": gpu_note,
            "trace": self._trace() if self.reader is not None else None,
            "stacks": None,
            "stacks_source": None,
            "stacks_note": None,
        }
        if stacks:
            self._stacks(snap)
        return snap

    def _trace(self) -> dict:
        assert self.reader is not None
        h = self.reader.header()
        new, self._next = self.reader.records(self._next)
        self.records.extend(new)
        stats = breakdown(self.records, self.window_steps)
        names = {g.index: g.name for g in h.groups}
        return {**header_facts(h, time.monotonic_ns()), "breakdown": stats.to_json(names)}

    def _stacks(self, snap: dict) -> None:
        note = None
        if self.ring_file is not None:
            text, note = ask_for_stacks(self.pid, self.ring_file)
            if text is not None:
                snap.update(stacks=text, stacks_source="faulthandler")
                return
        text, why = py_spy_stacks(self.pid)
        if text is not None:
            snap.update(stacks=text, stacks_source="py-spy")
        snap["stacks_note"] = "; ".join(n for n in (note, why) if n) or None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def snapshot(pid: int, *, stacks: bool = False, window_steps: int = 20) -> dict:
    """One look at process ``pid``: trace state and step breakdown when traced, OS/GPU figures, and (``stacks``)
    its Python stacks. Raises ``NotFoundError`` for a missing pid, ``LingctlError`` for another user's process."""
    a = Attacher(pid, window_steps=window_steps)
    try:
        time.sleep(0.1)  # CPU % needs an interval
        return a.snapshot(stacks=stacks)
    finally:
        a.close()


def inside(h: Header, now_ns: int) -> dict | None:
    """What the process's main thread is inside now, and for how long."""
    if h.cur_kind == 0:
        return None
    names = {g.index: g.name for g in h.groups}
    comm = h.cur_kind in (Kind.COLLECTIVE, Kind.P2P)
    return {
        "kind": kind_name(h.cur_kind),
        "op": op_name(h.cur_op) if comm else None,
        "group": names.get(h.cur_group, str(h.cur_group)) if comm and h.cur_group != NO_GROUP else None,
        "seq": h.cur_seq if comm else None,
        "for_s": max(0, now_ns - h.cur_since_ns) / 1e9,
    }


def describe_inside(i: dict | None) -> str:
    """``inside``'s answer as a phrase: a diagnosis keeps it as each rank's ``where`` (its JSON too), so it
    stays with the data rather than with the rendering."""
    if i is None:
        return "not inside a traced call"
    if i["op"] is not None:
        where = f"{i['op']} #{i['seq']}" + (f" of group {i['group']}" if i["group"] is not None else "")
    else:
        where = i["kind"]
    return f"in {where} for {i['for_s']:.1f} s"


def header_facts(h: Header, now_ns: int) -> dict:
    """The live state a ring header holds, as plain values (ages in seconds on the process's clock)."""
    return {
        "rank": h.rank,
        "world": h.world,
        "local_rank": h.local_rank,
        "step": h.step,
        "enabled": h.enabled,
        "argv": h.argv,
        "heartbeat_age_s": max(0, now_ns - h.heartbeat_ns) / 1e9,
        "step_elapsed_s": max(0, now_ns - h.step_start_ns) / 1e9 if h.step_start_ns else None,
        "inside": inside(h, now_ns),
        "groups": [
            {
                "name": g.name,
                "size": g.size,
                "started_seq": g.started_seq,
                "completed_seq": g.completed_seq,
                "in_flight": g.in_flight,
                "last_op": op_name(g.last_op),
            }
            for g in h.groups
        ],
    }
