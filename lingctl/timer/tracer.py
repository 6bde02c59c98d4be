"""The in-process tracer: thin timing wrappers around the few calls that matter, written to the ring.

As XPUTimer in the Ling report: trace only the critical parts of a training step (collectives, point-to-point,
optimizer step, data loading, outermost forward, backward, host-device copies), reuse everything (one ring, a
fixed pool of CUDA events), and leave the rest to a background thread (heartbeat, compressed log, metadata).
A wrapper costs two clock reads and three to five ``struct.pack_into`` into the ring (the record, what the
main thread is inside, the group's progress): about 3 us around a no-op call, 7-9 us measured around real
calls on a small 2-core VM (``bench/timer_overhead.py``). The wrappers themselves live in ``targets.py``; what
they share with the tracer (the writer, the step, the "inside now" stack) in ``trace_state.py``.

Per traced call one ring record (``ring.py``): ``seq`` is the collective's sequence number in its group for
COLLECTIVE and P2P (counted here from 0; every rank calls collectives in the same order, so the numbers line up
across ranks), and the index of the current step (0-based, = steps finished before the call) for the others.
A STEP record spans from the previous step's end (or install time) to the end of this step's
``Optimizer.step``. Calls with ``async_op=True`` and ``isend``/``irecv`` are timed until launch only: the
wait happens elsewhere. GPU records (CUDA only): ``start_ns`` is when the forward or backward was launched
on the host, ``end_ns - start_ns`` the GPU time between two events recorded around it, ``value`` the kind
of the span (FORWARD or BACKWARD).

Files: the ring and ``<ring dir>/<pid>.stacks`` (Python stacks of all threads, written by ``faulthandler``
on ``STACKS_SIGNAL``, which the tracer takes over, even while the main thread is stuck in C holding the GIL;
see ``read_stacks``), and, with ``out``, ``rank-R.PID.meta.json`` and ``rank-R.PID.trace.zst`` (raw
records, one zstd frame a second; ``logs.py`` reads them). The tracer never breaks the program: an internal error disables it (wrappers
become pass-through) with one warning. Forked children (DataLoader workers) are not traced.
"""

from __future__ import annotations

import atexit
import faulthandler
import fcntl
import importlib.util
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import IO

from lingctl.core.errors import LingctlError, os_error
from lingctl.core.private_dir import create_exclusive
from lingctl.timer.gpu_timer import GpuTimer
from lingctl.timer.ring import (
    HEADER_SIZE,
    RECORD_SIZE,
    RingReader,
    RingWriter,
    collect_stale,
    ensure_ring_dir,
    open_regular,
    remove_own_file,
    ring_dir,
    ring_path,
)
from lingctl.timer.stacks import STACKS_SIGNAL, dump_stacks
from lingctl.timer.targets import Targets
from lingctl.timer.trace_state import TraceState

log = logging.getLogger("lingctl.timer")

DEFAULT_TARGETS = ("collectives", "p2p", "optimizer", "data", "forward", "backward", "copy")

_now = time.monotonic_ns


def stacks_path(pid: int) -> Path:
    return ring_dir() / f"{pid}.stacks"


def meta_path(out: Path, rank: int, pid: int) -> Path:
    return Path(out) / f"rank-{rank}.{pid}.meta.json"


def log_path(out: Path, rank: int, pid: int) -> Path:
    return Path(out) / f"rank-{rank}.{pid}.trace.zst"


def parse_targets(spec: str | None) -> set[str]:
    """``None``/``""``/``"default"``/``"all"``: every target; else a comma list where ``name`` adds and ``-name``
    removes (a list that starts with a removal starts from the default set): ``"collectives,p2p"``, ``"-copy"``."""
    items = [s.strip() for s in (spec or "default").split(",") if s.strip()]
    chosen = set(DEFAULT_TARGETS) if not items or items[0].startswith("-") else set()
    for item in items:
        name = item.removeprefix("-")
        if name in ("default", "all"):
            names = set(DEFAULT_TARGETS)
        elif name in DEFAULT_TARGETS:
            names = {name}
        else:
            raise ValueError(
                f"unknown timer target {name!r}; valid: {', '.join(DEFAULT_TARGETS)} (or default, all; "
                "'-name' removes one)"
            )
        chosen = chosen - names if item.startswith("-") else chosen | names
    return chosen


def read_stacks(pid: int, timeout: float = 3.0) -> str:
    """Python stacks of every thread of traced process ``pid`` (one of ours): see ``dump_stacks``.
    FileNotFoundError when the process is not traced (the signal would kill an untraced process)."""
    text = dump_stacks(pid, stacks_path(pid), timeout=timeout)
    return text or ""


def collect_stale_files() -> list[Path]:
    """``ring.collect_stale`` (rings of dead processes), then the stacks files such processes left behind."""
    import psutil

    removed = collect_stale()  # checks the directory is ours first
    for path in ring_dir().glob("*.stacks"):
        pid = int(path.stem) if path.stem.isdigit() else -1
        if not os.path.lexists(ring_path(pid)) and not psutil.pid_exists(pid):
            try:
                os.unlink(path)  # a link is removed itself, never followed
            except FileNotFoundError:
                pass
            removed.append(path)
    return removed


class _AfterImport:
    """A one-shot meta path finder: run ``callback`` right after ``torch`` has been imported, so that installing
    the tracer in every process (``timer run``) does not import torch into processes that never use it."""

    def __init__(self, callback) -> None:
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        self.remove()
        try:
            spec = importlib.util.find_spec(fullname)
            loader = spec.loader if spec is not None else None
            if loader is None:
                raise ImportError(f"no loader for {fullname}")  # reported below like any other failure
            exec_module, callback = loader.exec_module, self.callback

            def exec_then_patch(module):
                exec_module(module)
                callback()

            # Patching this one loader instance is the point: torch's module runs, then the targets install.
            loader.exec_module = exec_then_patch  # type: ignore[method-assign]
            return spec
        except Exception as exc:  # never stand in the way of the import itself
            log.warning("lingctl timer: torch is not traced in this process: %r", exc)
            return None

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class Tracer(TraceState):
    """The installed tracer (one per process; see ``install``): the shared state of ``TraceState``, plus the ring,
    the files and the background thread."""

    def __init__(self, out: str | Path | None, targets: set[str], capacity: int, log_max_bytes: int) -> None:
        super().__init__()
        self.pid = os.getpid()
        self.out = Path(out) if out is not None else None
        self.requested = targets
        self.targets: list[str] = []
        self.log_max_bytes = log_max_bytes
        self.argv = " ".join(sys.argv)
        self._hook: _AfterImport | None = None
        self._stop = threading.Event()
        self._files_lock = threading.Lock()
        self._meta_written = 0
        self._files_rank: int | None = None
        self._flushed = 0
        self._log_size = 0
        self._log_full = False
        self._stacks_file: IO[str] | None = None
        try:
            self._open_ring(capacity)
            self._step_start = _now()
            if self.out is not None:
                import zstandard

                self._zstd = zstandard.ZstdCompressor(level=3)
                self.out.mkdir(parents=True, exist_ok=True)
                self._sync_files()
            if "torch" in sys.modules:
                self._install_targets()
            else:
                self._hook = _AfterImport(self._install_targets)
                sys.meta_path.insert(0, self._hook)
            self._thread = threading.Thread(target=self._run, name="lingctl-timer", daemon=True)
            self._thread.start()
        except BaseException:
            self.close(at_exit=True)
            raise

    def _open_ring(self, capacity: int) -> None:
        d = ensure_ring_dir()  # ours and 0700, or refused: see ring.py
        # Serialise collection with creation: a ring whose header is not written yet looks stale to a collector.
        # The lock file is never opened through a link, so it cannot create or touch a file elsewhere.
        lock = open_regular(d / ".lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            collect_stale_files()
            self.writer = RingWriter(
                ring_path(self.pid),
                capacity=capacity,
                rank=self.rank,
                world=self.world,
                local_rank=self.local_rank,
                argv=self.argv,
            )
        finally:
            os.close(lock)  # releases the lock
        reader = RingReader(self.writer.path)
        try:
            h = reader.header()
        finally:
            reader.close()
        self.mono_anchor_ns, self.wall_anchor_ns = h.mono_anchor_ns, h.wall_anchor_ns
        # A stacks file of an earlier process with this pid is removed only if it is a regular file of ours;
        # then the file is created anew (O_EXCL): a link planted under its name is refused, never followed.
        path = stacks_path(self.pid)
        remove_own_file(path)
        try:
            fd = create_exclusive(path, os.O_WRONLY | os.O_APPEND, 0o600)
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        # O_APPEND: a reader truncates the file before each request and the next dump must start at offset 0.
        self._stacks_file = os.fdopen(fd, "w")
        faulthandler.register(STACKS_SIGNAL, file=self._stacks_file, all_threads=True, chain=False)

    # -- patching ---------------------------------------------------------------------------------
    def _install_targets(self) -> None:
        try:
            import torch

            targets = Targets(self)
            for name in DEFAULT_TARGETS:
                if name in self.requested and targets.install(name, torch):
                    self.targets.append(name)
            if self._dist is not None and self._dist.is_initialized():  # installed after init_process_group
                self._update_rank()
            if torch.cuda.is_available() and {"forward", "backward"} & self.requested:
                self._gpu = GpuTimer(torch.cuda)
            self._version += 1
        except Exception as exc:
            self._fail(exc)

    # -- background thread and files -------------------------------------------------------------
    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(0.1):
            try:
                self.writer.heartbeat()
                if self._gpu is not None and self.active:
                    self._gpu.poll(self.writer)
                ticks += 1
                # every second, or sooner when the ring is half full and the log would lose records
                if ticks % 10 == 0 or self.writer.index - self._flushed > self.writer.capacity // 2:
                    with self._files_lock:
                        self._sync_files()
            except Exception as exc:
                self._fail(exc)
                return

    def _sync_files(self) -> None:
        if self.out is None:
            return
        rank, pid = self.rank, self.pid
        if self._files_rank is not None and self._files_rank != rank:  # rank learned after files were written
            old = log_path(self.out, self._files_rank, pid)
            if old.exists():
                os.replace(old, log_path(self.out, rank, pid))
            self._write_meta(self.out)
            meta_path(self.out, self._files_rank, pid).unlink(missing_ok=True)
        elif self._meta_written != self._version:
            self._write_meta(self.out)
        self._files_rank = rank
        self._flush_records(self.out)

    def _write_meta(self, out: Path) -> None:
        from lingctl.core.atomic import atomic_write

        version = self._version
        meta = {
            "pid": self.pid,
            "rank": self.rank,
            "world": self.world,
            "local_rank": self.local_rank,
            "argv": self.argv,
            "hostname": socket.gethostname(),
            "ring": str(self.writer.path),
            "stacks": str(stacks_path(self.pid)),
            "log": log_path(out, self.rank, self.pid).name,
            "mono_anchor_ns": self.mono_anchor_ns,
            "wall_anchor_ns": self.wall_anchor_ns,
            "groups": dict(self.writer.groups),
            "targets": list(self.targets),
            "capacity": self.writer.capacity,
            # "dist": from torch.distributed; "env": RANK was set; "default": neither (e.g. a launcher process)
            "rank_source": "dist" if self._rank_known else "env" if "RANK" in os.environ else "default",
        }
        with atomic_write(meta_path(out, self.rank, self.pid)) as (_, f):
            f.write(json.dumps(meta, indent=1).encode())
        self._meta_written = version

    def _flush_records(self, out: Path) -> None:
        w = self.writer
        end = w.index
        start = max(self._flushed, end - w.capacity + 1)  # one slot of margin against a concurrent overwrite
        if end <= start or self._log_full:
            self._flushed = end
            return
        parts, i = [], start
        while i < end:  # the new slots, in at most two runs around the ring's end
            slot = i % w.capacity
            n = min(end - i, w.capacity - slot)
            offset = HEADER_SIZE + slot * RECORD_SIZE
            parts.append(w.mm[offset : offset + n * RECORD_SIZE])
            i += n
        frame = self._zstd.compress(b"".join(parts))
        if self._log_size + len(frame) > self.log_max_bytes:
            self._log_full = True
            log.warning(
                "lingctl timer: %s reached %d bytes; no more records are logged (the ring still has the newest)",
                log_path(out, self.rank, self.pid),
                self.log_max_bytes,
            )
            return
        with open(log_path(out, self.rank, self.pid), "ab") as f:
            f.write(frame)
        self._log_size += len(frame)
        self._flushed = end

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self, *, at_exit: bool = False) -> None:
        """Restore what was patched, stop the thread, flush the log, remove the ring and the stacks file."""
        healthy, self.active = self.active, False
        steps = [self._unpatch, self._stop_thread, self._final_flush]
        if os.getpid() == self.pid:  # a forked child must not touch its parent's files
            steps += [lambda: self._close_files(at_exit)]
        for step in steps:
            try:
                step()
            except Exception as exc:  # after an internal error the one warning has been given already
                log.log(logging.WARNING if healthy else logging.DEBUG, "lingctl timer: while closing: %r", exc)

    def _unpatch(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        for handle in self._handles:
            handle.remove()
        for obj, name, original, wrapper in reversed(self._patches):
            if obj.__dict__.get(name) is wrapper:  # leave alone what someone patched over ours
                if original is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, original)
        self._patches.clear()
        self._handles.clear()

    def _stop_thread(self) -> None:
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    def _final_flush(self) -> None:
        if (
            getattr(self, "writer", None) is None
            or os.getpid() != self.pid
            or not self._files_lock.acquire(timeout=2.0)
        ):
            return
        try:
            if self._gpu is not None and self._gpu.free is not None:
                self._gpu.poll(self.writer)
            self._sync_files()
        finally:
            self._files_lock.release()

    def _close_files(self, at_exit: bool) -> None:
        # The stacks file goes first: readers only signal a process whose stacks file exists. Only the one this
        # tracer created: after a refused start, what is in the directory is not ours to remove.
        if self._stacks_file is not None:
            try:
                os.unlink(stacks_path(self.pid))
            except FileNotFoundError:
                pass
        if self._stacks_file is not None and not at_exit:  # at exit the handler stays: the signal must not kill
            faulthandler.unregister(STACKS_SIGNAL)
            self._stacks_file.close()
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.close()


_tracer: Tracer | None = None
_lock = threading.Lock()


def install(
    out: str | Path | None = None,
    *,
    targets: str | None = None,
    capacity: int = 1 << 16,
    log_max_bytes: int = 256 << 20,
) -> Tracer | None:
    """Trace this process (idempotent: a second call returns the tracer already installed). With ``out``, also
    write a compressed log and a metadata file there. torch targets are patched now if torch is imported, else
    right after it is. Returns None, with a warning, when the tracer could not be set up."""
    global _tracer
    chosen = parse_targets(targets)
    with _lock:
        if _tracer is None:
            try:
                _tracer = Tracer(out, chosen, capacity, log_max_bytes)
            except LingctlError as exc:  # e.g. a ring directory that is not ours: one line, with the way out
                log.warning("lingctl timer: tracing not installed: %s%s", exc, f" ({exc.hint})" if exc.hint else "")
                return None
            except Exception as exc:
                log.warning("lingctl timer: tracing not installed: %r", exc)
                return None
            atexit.register(_at_exit, _tracer)
        return _tracer


def uninstall() -> None:
    """Restore every patched function, stop the thread, flush the log, remove the ring and the stacks file."""
    global _tracer
    with _lock:
        tracer, _tracer = _tracer, None
    if tracer is not None:
        tracer.close()


def current() -> Tracer | None:
    return _tracer


def _at_exit(tracer: Tracer) -> None:
    global _tracer
    if _tracer is tracer and os.getpid() == tracer.pid:
        _tracer = None
        tracer.close(at_exit=True)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) shares its parent's ring mapping: its tracer goes quiet and lets go
    of the signal; the child may install a tracer of its own."""
    global _tracer, _lock
    tracer, _tracer, _lock = _tracer, None, threading.Lock()
    if tracer is not None:
        tracer.active = False
        if tracer._stacks_file is not None:
            faulthandler.unregister(STACKS_SIGNAL)


os.register_at_fork(after_in_child=_after_fork_in_child)
