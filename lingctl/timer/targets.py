"""What the tracer wraps: one installer per target (collectives, p2p, optimizer, data, forward, backward,
copy), and the state only the targets keep (forward nesting, pending optimizer steps, the forward hooks).

``Targets`` gets the tracer's ``TraceState`` (trace_state.py) as a collaborator: the ring writer, the step
count, the "inside now" stack, the two wrapper patterns and the patch list that ``uninstall`` restores."""

from __future__ import annotations

import functools
import time
import weakref
from typing import TYPE_CHECKING, Any

from lingctl.timer.ring import NO_GROUP, Kind, Op
from lingctl.timer.trace_state import TraceState

if TYPE_CHECKING:  # torch is imported only once a target is installed
    import torch

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
_FORWARD, _BACKWARD, _OPTIMIZER, _STEP = int(Kind.FORWARD), int(Kind.BACKWARD), int(Kind.OPTIMIZER), int(Kind.STEP)


class Targets:
    """The installers of the tracer's targets, writing through ``state``."""

    def __init__(self, state: TraceState) -> None:
        self.state = state
        self._fwd_depth = self._bwd_depth = 0
        self._fwd_prev: Any = None
        self._fwd_gpu: Any = None
        self._fwd_start = 0
        self._fwd_roots: dict[int, torch.nn.Module] | None = None  # outermost modules seen before the first step
        self._fwd_global: list = []
        self._fwd_hooks: tuple[Any, Any] | None = None
        self._opt_pending: dict[int, tuple] = {}
        self._first_opt: weakref.ReferenceType[Any] | None = None

    def install(self, name: str, torch: Any) -> bool:
        """Install target ``name``; False when it installed nothing (no torch.distributed, no CUDA)."""
        return getattr(self, f"_target_{name}")(torch) is not False

    # -- targets (each returns False when it installed nothing) -----------------------------------
    def _target_collectives(self, torch):
        import torch.distributed as dist

        if not dist.is_available():
            return False
        s = self.state
        s._dist = dist
        init = dist.init_process_group

        @functools.wraps(init)
        def init_process_group(*args, **kwargs):
            result = init(*args, **kwargs)
            try:
                s._group_cache.clear()
                s._update_rank()
            except Exception as exc:
                s._fail(exc)
            return result

        s._patch(dist, "init_process_group", init_process_group)
        for name, (op, payload) in COLLECTIVES.items():
            if hasattr(dist, name):
                s._patch(dist, name, s._comm(getattr(dist, name), Kind.COLLECTIVE, op, payload))

    def _target_p2p(self, torch):
        import torch.distributed as dist

        if not dist.is_available():
            return False
        s = self.state
        s._dist = dist
        for name, op in P2P.items():
            s._patch(dist, name, s._comm(getattr(dist, name), Kind.P2P, op, "tensor"))

    def _target_optimizer(self, torch):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        s, tg = self.state, self

        def pre(opt, args, kwargs):
            if s.active:
                try:
                    tg._opt_pending[id(opt)] = (_now(), s._push(_OPTIMIZER, 0, NO_GROUP, s.step))
                except Exception as exc:
                    s._fail(exc)

        def post(opt, args, kwargs):
            if s.active:
                try:
                    tg._step_done(opt, _now())
                except Exception as exc:
                    s._fail(exc)

        s._handles += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def _step_done(self, opt, end: int) -> None:
        pending = self._opt_pending.pop(id(opt), None)
        if pending is None:
            return
        s = self.state
        start, prev = pending
        s._pop(prev)
        step, w = s.step, s.writer
        w.append(_OPTIMIZER, 0, NO_GROUP, step, start, end, 0)
        first = self._first_opt() if self._first_opt is not None else None
        if first is None:  # steps count the first optimizer seen (or a replacement once it is gone)
            self._first_opt, first = weakref.ref(opt), opt
        if first is opt:
            w.append(_STEP, 0, NO_GROUP, step, s._step_start, end, 0)
            s.step, s._step_start = step + 1, end
            w.set_step(step + 1, end)
            if self._fwd_roots is not None:
                self._settle_forward()

    def _target_data(self, torch):
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        s = self.state
        s._patch(_BaseDataLoaderIter, "__next__", s._timed(_BaseDataLoaderIter.__next__, int(Kind.DATA)))

    def _target_forward(self, torch):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        compiling = torch.compiler.is_compiling
        pre, post = self._forward_pre(compiling), self._forward_post(compiling)
        # Global module hooks put every module call (nested ones too) on PyTorch's slow hook path, several
        # us each. They run only until the first optimizer step, to learn which modules are called
        # outermost; then they are replaced by hooks on those modules alone (see _settle_forward).
        self._fwd_hooks = (pre, post)
        self._fwd_roots = {}
        self._fwd_global = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
        self.state._handles += self._fwd_global

    def _forward_pre(self, compiling):
        s, tg = self.state, self

        def pre(module, args):
            if s.active and not compiling():
                try:
                    depth = tg._fwd_depth
                    tg._fwd_depth = depth + 1
                    if depth == 0 and tg._fwd_roots is not None:
                        tg._fwd_roots[id(module)] = module
                    if depth == 0 and tg._bwd_depth == 0:  # outermost, and not a recompute inside backward
                        tg._fwd_start = _now()
                        tg._fwd_prev = s._push(_FORWARD, 0, NO_GROUP, s.step)
                        tg._fwd_gpu = s._gpu.begin() if s._gpu is not None else None
                except Exception as exc:
                    s._fail(exc)

        return pre

    def _forward_post(self, compiling):
        s, tg = self.state, self

        def post(module, args, output):  # always_call: also when forward raised, so the depth stays right
            if s.active and not compiling():
                try:
                    depth = max(tg._fwd_depth - 1, 0)
                    tg._fwd_depth = depth
                    if depth == 0 and tg._fwd_start:
                        start, tg._fwd_start = tg._fwd_start, 0
                        s._pop(tg._fwd_prev)
                        s.writer.append(_FORWARD, 0, NO_GROUP, s.step, start, _now(), 0)
                        if tg._fwd_gpu is not None and s._gpu is not None:  # a pair comes from _gpu.begin()
                            s._gpu.end(tg._fwd_gpu, _FORWARD, s.step, start)
                except Exception as exc:
                    s._fail(exc)

        return post

    def _settle_forward(self) -> None:
        """After the first step: time the outermost modules that hold parameters (the model) through their
        own ``forward``, drop the global hooks. A module first called outermost later (an eval model) is
        not traced."""
        roots, self._fwd_roots = self._fwd_roots, None
        if not roots or not self._fwd_global or self._fwd_hooks is None:
            return
        s = self.state
        for handle in self._fwd_global:
            handle.remove()
            s._handles.remove(handle)
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
                s._patch(module, "forward", timed(module, module.forward))

    def _target_backward(self, torch):
        s = self.state
        s._patch(torch.Tensor, "backward", self._backward(torch.Tensor.backward))
        s._patch(torch.autograd, "backward", self._backward(torch.autograd.backward))

    def _backward(self, fn):
        s, tg = self.state, self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not s.active or tg._bwd_depth:  # Tensor.backward calls torch.autograd.backward: count it once
                return fn(*args, **kwargs)
            ok = True
            try:
                tg._bwd_depth = 1
                start = _now()
                prev = s._push(_BACKWARD, 0, NO_GROUP, s.step)
                pair = s._gpu.begin() if s._gpu is not None else None
            except Exception as exc:
                s._fail(exc)
                ok = False
            if not ok:
                tg._bwd_depth = 0
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                tg._bwd_depth = 0
                try:
                    s._pop(prev)
                    s.writer.append(_BACKWARD, 0, NO_GROUP, s.step, start, _now(), 0)
                    if pair is not None and s._gpu is not None:  # a pair comes from _gpu.begin()
                        s._gpu.end(pair, _BACKWARD, s.step, start)
                except Exception as exc:
                    s._fail(exc)

        return wrapper

    def _target_copy(self, torch):
        """Host-device copies through ``Tensor.to/cuda/cpu``; installed only when CUDA is available (on a
        CPU-only machine there are no such copies and ``Tensor.to`` is too hot to wrap for nothing)."""
        if not torch.cuda.is_available():
            return False
        s, compiling, kind = self.state, torch.compiler.is_compiling, int(Kind.COPY)

        def wrap(fn):
            @functools.wraps(fn)
            def wrapper(tensor, *args, **kwargs):
                if not s.active or compiling():
                    return fn(tensor, *args, **kwargs)
                start = _now()
                result = fn(tensor, *args, **kwargs)
                try:
                    if result is not tensor and result.device.type != tensor.device.type:
                        s.writer.append(kind, 0, NO_GROUP, s.step, start, _now(), result.nbytes)
                except Exception as exc:
                    s._fail(exc)
                return result

            return wrapper

        for name in ("to", "cuda", "cpu"):
            s._patch(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
