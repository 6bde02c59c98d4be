"""What the tracer wraps: one method per target (collectives, p2p, optimizer, data, forward, backward, copy)
and the two wrapper patterns they share (``_timed`` for plain calls, ``_comm`` for sequence-numbered
communication). A mixin of ``Tracer`` (tracer.py), which owns the state these methods read: the ring writer,
the "inside now" stack, step counting and the patch list that ``uninstall`` restores."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from lingctl.timer.ring import NO_GROUP, Kind, Op, RingWriter

if TYPE_CHECKING:  # torch is imported only once a target is installed; tracer imports this module
    import torch

    from lingctl.timer.tracer import _GpuTimer

# torch.distributed name -> (op, payload parameter whose bytes are recorded)
COLLECTIVES = {
    "all_reduce": (Op.ALL_REDUCE, "tensor"),
    "broadcast": (Op.BROADCAST, "tensor"),
    "all_gather": (Op.ALL_GATHER, "tensor_list"),
    "all_gather_into_tensor": (Op.ALL_GATHER, "output_tensor"),
    "reduce_scatter": (Op.REDUCE_SCATTER, "input_list"),
    "reduce_scatter_tensor": (Op.REDUCE_SCATTER, "input"),
    "reduce": (Op.REDUCE, "tensor"),
    "gather": (Op.GATHER, "tensor"),
    "scatter": (Op.SCATTER, "tensor"),
    "all_to_all": (Op.ALL_TO_ALL, "input_tensor_list"),
    "all_to_all_single": (Op.ALL_TO_ALL, "input"),
    "barrier": (Op.BARRIER, None),
}
P2P = {"send": Op.SEND, "isend": Op.SEND, "recv": Op.RECV, "irecv": Op.RECV}

_now = time.monotonic_ns
_get_ident = threading.get_ident
_FORWARD, _BACKWARD, _OPTIMIZER, _STEP = int(Kind.FORWARD), int(Kind.BACKWARD), int(Kind.OPTIMIZER), int(Kind.STEP)


def _nbytes(x) -> int:
    try:
        if x is None:
            return 0
        if isinstance(x, (list, tuple)):
            return sum(t.nbytes for t in x if t is not None)
        return x.nbytes
    except Exception:
        return 0


class TargetsMixin:
    # The Tracer's state these methods use (declared for the type checker; Tracer.__init__ sets them).
    writer: RingWriter
    active: bool
    step: int
    local_rank: int
    _version: int
    _opt_pending: dict[int, tuple]
    _first_opt: weakref.ReferenceType[Any] | None
    _step_start: int
    _handles: list
    _dist: Any  # torch.distributed once a target imported it, else None
    _rank_known: bool
    _groups: dict[str, list[int]]
    _group_cache: dict
    _gpu: _GpuTimer | None
    _fwd_depth: int
    _bwd_depth: int
    _fwd_start: int
    _fwd_prev: Any
    _fwd_gpu: Any
    _fwd_roots: dict[int, torch.nn.Module] | None  # outermost modules seen before the first step
    _fwd_global: list

    if TYPE_CHECKING:

        def _push(self, kind: int, op: int, group: int, seq: int, now: int | None = None) -> Any: ...

        def _pop(self, prev: Any) -> None: ...

        def _fail(self, exc: BaseException) -> None: ...

        def _patch(self, obj: Any, name: str, wrapper: Any) -> None: ...

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

    # -- targets (each returns False when it installed nothing) -----------------------------------
    def _target_collectives(self, torch):
        import torch.distributed as dist

        if not dist.is_available():
            return False
        self._dist = dist
        t, init = self, dist.init_process_group

        @functools.wraps(init)
        def init_process_group(*args, **kwargs):
            result = init(*args, **kwargs)
            try:
                t._group_cache.clear()
                t._update_rank()
            except Exception as exc:
                t._fail(exc)
            return result

        self._patch(dist, "init_process_group", init_process_group)
        for name, (op, payload) in COLLECTIVES.items():
            if hasattr(dist, name):
                self._patch(dist, name, self._comm(getattr(dist, name), Kind.COLLECTIVE, op, payload))

    def _target_p2p(self, torch):
        import torch.distributed as dist

        if not dist.is_available():
            return False
        self._dist = dist
        for name, op in P2P.items():
            self._patch(dist, name, self._comm(getattr(dist, name), Kind.P2P, op, "tensor"))

    def _target_optimizer(self, torch):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        t = self

        def pre(opt, args, kwargs):
            if t.active:
                try:
                    t._opt_pending[id(opt)] = (_now(), t._push(_OPTIMIZER, 0, NO_GROUP, t.step))
                except Exception as exc:
                    t._fail(exc)

        def post(opt, args, kwargs):
            if t.active:
                try:
                    t._step_done(opt, _now())
                except Exception as exc:
                    t._fail(exc)

        self._handles += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def _step_done(self, opt, end: int) -> None:
        pending = self._opt_pending.pop(id(opt), None)
        if pending is None:
            return
        start, prev = pending
        self._pop(prev)
        step, w = self.step, self.writer
        w.append(_OPTIMIZER, 0, NO_GROUP, step, start, end, 0)
        first = self._first_opt() if self._first_opt is not None else None
        if first is None:  # steps count the first optimizer seen (or a replacement once it is gone)
            self._first_opt, first = weakref.ref(opt), opt
        if first is opt:
            w.append(_STEP, 0, NO_GROUP, step, self._step_start, end, 0)
            self.step, self._step_start = step + 1, end
            w.set_step(step + 1, end)
            if self._fwd_roots is not None:
                self._settle_forward()

    def _target_data(self, torch):
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        self._patch(_BaseDataLoaderIter, "__next__", self._timed(_BaseDataLoaderIter.__next__, int(Kind.DATA)))

    def _target_forward(self, torch):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        t, compiling = self, torch.compiler.is_compiling

        def pre(module, args):
            if t.active and not compiling():
                try:
                    depth = t._fwd_depth
                    t._fwd_depth = depth + 1
                    if depth == 0 and t._fwd_roots is not None:
                        t._fwd_roots[id(module)] = module
                    if depth == 0 and t._bwd_depth == 0:  # outermost, and not a recompute inside backward
                        t._fwd_start = _now()
                        t._fwd_prev = t._push(_FORWARD, 0, NO_GROUP, t.step)
                        t._fwd_gpu = t._gpu.begin() if t._gpu is not None else None
                except Exception as exc:
                    t._fail(exc)

        def post(module, args, output):  # always_call: also when forward raised, so the depth stays right
            if t.active and not compiling():
                try:
                    depth = max(t._fwd_depth - 1, 0)
                    t._fwd_depth = depth
                    if depth == 0 and t._fwd_start:
                        start, t._fwd_start = t._fwd_start, 0
                        t._pop(t._fwd_prev)
                        t.writer.append(_FORWARD, 0, NO_GROUP, t.step, start, _now(), 0)
                        if t._fwd_gpu is not None and t._gpu is not None:  # a pair comes from _gpu.begin()
                            t._gpu.end(t._fwd_gpu, _FORWARD, t.step, start)
                except Exception as exc:
                    t._fail(exc)

        # Global module hooks put every module call (nested ones too) on PyTorch's slow hook path, several
        # us each. They run only until the first optimizer step, to learn which modules are called
        # outermost; then they are replaced by hooks on those modules alone (see _settle_forward).
        self._fwd_hooks = (pre, post)
        self._fwd_roots = {}
        self._fwd_global = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
        self._handles += self._fwd_global

    def _settle_forward(self) -> None:
        """After the first step: time the outermost modules that hold parameters (the model) through their
        own ``forward``, drop the global hooks. A module first called outermost later (an eval model) is
        not traced."""
        roots, self._fwd_roots = self._fwd_roots, None
        if not roots or not getattr(self, "_fwd_global", None):
            return
        for handle in self._fwd_global:
            handle.remove()
            self._handles.remove(handle)
        self._fwd_global = []
        pre, post = self._fwd_hooks

        def timed(module, forward):
            # An instance-level ``forward`` rather than module hooks: hooks send even this one call down
            # PyTorch's slow hook path (measured ~12 us per call against ~3 us for this wrapper).
            @functools.wraps(forward)
            def traced_forward(*args, **kwargs):
                pre(module, args)
                try:
                    return forward(*args, **kwargs)
                finally:
                    post(module, args, None)

            return traced_forward

        for module in roots.values():
            if next(module.parameters(), None) is not None:
                self._patch(module, "forward", timed(module, module.forward))

    def _target_backward(self, torch):
        self._patch(torch.Tensor, "backward", self._backward(torch.Tensor.backward))
        self._patch(torch.autograd, "backward", self._backward(torch.autograd.backward))

    def _backward(self, fn):
        t = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not t.active or t._bwd_depth:  # Tensor.backward calls torch.autograd.backward: count it once
                return fn(*args, **kwargs)
            ok = True
            try:
                t._bwd_depth = 1
                start = _now()
                prev = t._push(_BACKWARD, 0, NO_GROUP, t.step)
                pair = t._gpu.begin() if t._gpu is not None else None
            except Exception as exc:
                t._fail(exc)
                ok = False
            if not ok:
                t._bwd_depth = 0
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                t._bwd_depth = 0
                try:
                    t._pop(prev)
                    t.writer.append(_BACKWARD, 0, NO_GROUP, t.step, start, _now(), 0)
                    if pair is not None and t._gpu is not None:  # a pair comes from _gpu.begin()
                        t._gpu.end(pair, _BACKWARD, t.step, start)
                except Exception as exc:
                    t._fail(exc)

        return wrapper

    def _target_copy(self, torch):
        """Host-device copies through ``Tensor.to/cuda/cpu``; installed only when CUDA is available (on a
        CPU-only machine there are no such copies and ``Tensor.to`` is too hot to wrap for nothing)."""
        if not torch.cuda.is_available():
            return False
        t, compiling, kind = self, torch.compiler.is_compiling, int(Kind.COPY)

        def wrap(fn):
            @functools.wraps(fn)
            def wrapper(tensor, *args, **kwargs):
                if not t.active or compiling():
                    return fn(tensor, *args, **kwargs)
                start = _now()
                result = fn(tensor, *args, **kwargs)
                try:
                    if result is not tensor and result.device.type != tensor.device.type:
                        t.writer.append(kind, 0, NO_GROUP, t.step, start, _now(), result.nbytes)
                except Exception as exc:
                    t._fail(exc)
                return result

            return wrapper

        for name in ("to", "cuda", "cpu"):
            self._patch(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
