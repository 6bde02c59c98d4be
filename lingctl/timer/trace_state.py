"""What the tracer and the targets it installs share: the ring writer, the step count, what the main thread is
inside, the process groups and their sequence numbers, the patches to undo, and the two wrapper patterns every
target follows (``_timed`` for plain calls, ``_comm`` for sequence-numbered communication).

``Tracer`` (tracer.py) is a ``TraceState`` that also owns the ring, the files and the background thread;
``Targets`` (targets.py) gets the state as a collaborator and patches torch with wrappers that write through it.
The members keep their leading underscore: they are the timer's internals, for these two classes only.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from typing import Any

from lingctl.timer.gpu_timer import GpuTimer
from lingctl.timer.ring import NO_GROUP, Kind, RingWriter

log = logging.getLogger("lingctl.timer")

_now = time.monotonic_ns
_get_ident = threading.get_ident
_OTHER_THREAD = object()  # what _push returns off the main thread: the header shows the main thread only


def _nbytes(x: Any) -> int:
    try:
        if x is None:
            return 0
        if isinstance(x, (list, tuple)):
            return sum(t.nbytes for t in x if t is not None)
        return x.nbytes
    except Exception:
        return 0


class TraceState:
    """The state of one process's tracing, and the operations on it that wrappers perform per call."""

    writer: RingWriter  # set once the ring is open; absent only when construction failed before that

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.active = True
        self.step = 0
        self._step_start = 0  # monotonic ns at which the current step began (the ring's opening, at first)
        self._main = threading.main_thread().ident
        self._cur: tuple[int, int, int, int] | None = None  # (kind, op, group, seq) the main thread is inside
        self._groups: dict[str, list[int]] = {}  # name -> [ring index, next collective seq, next p2p seq]
        self._group_cache: dict = {}  # group object (None: default) -> the same list
        self._rank_known = False
        self._dist: Any = None  # torch.distributed once a target imported it
        self._gpu: GpuTimer | None = None
        self._patches: list[tuple] = []
        self._handles: list = []
        self._version = 1  # bumped when rank, groups or targets change; the tracer rewrites the meta file

    # -- failure ----------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if not self.active:
            return
        self.active = False
        try:
            self.writer.disable()
        except Exception:
            pass
        log.warning("lingctl timer: tracing disabled after an internal error: %r", exc)

    # -- what the main thread is inside -----------------------------------------------------------
    def _push(self, kind: int, op: int, group: int, seq: int, now: int | None = None) -> Any:
        if _get_ident() != self._main:
            return _OTHER_THREAD
        prev, self._cur = self._cur, (kind, op, group, seq)
        self.writer.enter(kind, op, group, seq, now)
        return prev

    def _pop(self, prev: Any) -> None:
        if prev is _OTHER_THREAD:
            return
        self._cur = prev
        if prev is None:
            self.writer.leave()
        else:
            self.writer.enter(*prev)

    # -- patching ---------------------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, wrapper: Any) -> None:
        self._patches.append((obj, name, obj.__dict__.get(name), wrapper))
        setattr(obj, name, wrapper)

    # -- the two wrapper patterns -----------------------------------------------------------------
    def _timed(self, fn, kind: int):
        """A wrapper recording one ``kind`` record per call (the pattern every target follows)."""
        t = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not t.active:
                return fn(*args, **kwargs)
            ok = True
            try:
                start = _now()
                prev = t._push(kind, 0, NO_GROUP, t.step, start)
            except Exception as exc:
                t._fail(exc)
                ok = False
            if not ok:  # outside the except block, so the call's own exceptions carry no context of ours
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                try:
                    t._pop(prev)
                    t.writer.append(kind, 0, NO_GROUP, t.step, start, _now(), 0)
                except Exception as exc:
                    t._fail(exc)

        return wrapper

    def _comm(self, fn, kind: int, op: int, payload: str | None):
        """A wrapper numbering each call in its process group (collectives and point-to-point apart) and
        recording the group's progress in the ring header, as well as one record per call."""
        import inspect

        params = list(inspect.signature(fn).parameters)
        group_i = params.index("group")
        payload_i = params.index(payload) if payload else -1
        collective = kind == Kind.COLLECTIVE
        slot = 1 if collective else 2  # collectives and point-to-point are numbered apart
        t, Tensor = self, sys.modules["torch"].Tensor

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not t.active:
                return fn(*args, **kwargs)
            ok = True
            try:
                group = args[group_i] if len(args) > group_i else kwargs.get("group")
                info = t._group_cache.get(group) or t._group(group)
                if info is None:  # no default group yet: the call itself will say so
                    ok = False
                else:
                    g = info[0]
                    seq = info[slot]
                    info[slot] = seq + 1
                    x = None if not payload else args[payload_i] if len(args) > payload_i else kwargs.get(payload)
                    nbytes = x.nbytes if isinstance(x, Tensor) else _nbytes(x)
                    start = _now()
                    prev = t._push(kind, op, g, seq, start)
                    if collective:
                        t.writer.group_started(g, op, seq, start)
            except Exception as exc:
                t._fail(exc)
                ok = False
            if not ok:
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                try:
                    end = _now()
                    if collective:
                        t.writer.group_completed(g, seq)
                    t._pop(prev)
                    t.writer.append(kind, op, g, seq, start, end, nbytes)
                except Exception as exc:
                    t._fail(exc)

        return wrapper

    # -- process groups and the rank --------------------------------------------------------------
    def _group(self, group):
        dist = self._dist
        if not dist.is_initialized():
            return None
        if not self._rank_known:
            self._update_rank()
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        try:
            name = dist.distributed_c10d._get_process_group_name(pg)
        except Exception:
            name = str(pg.group_name)
        info = self._groups.get(name)
        if info is None:
            info = self._groups[name] = [self.writer.group_index(name, dist.get_world_size(pg)), 0, 0]
            self._version += 1
        self._group_cache[group] = info
        return info

    def _update_rank(self) -> None:
        dist = self._dist
        if dist is not None and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.local_rank = int(os.environ.get("LOCAL_RANK", self.local_rank))
            self.writer.set_rank(self.rank, self.world, self.local_rank)
            self._rank_known = True
            self._version += 1
