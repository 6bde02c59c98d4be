"""What ``lingctl train align`` records of one training step: every module's outputs, the gradients
reaching its inputs, every parameter's gradient and the loss parts, in execution order; and the comparison
of two records. The trace file that carries a record to another machine is ``align_file``.

Capture. Forward hooks record each module's output(s) in the order the modules finish (children before
their parent: data-flow order). Backward: modules that take and return plain tensors (``nn.Linear``,
``RMSNorm``, ``MLP``, ``Attention``) get ``register_full_backward_hook`` and record ``grad_input``. A full
backward hook cannot see through outputs that are not tensors or tuples of tensors: the router returns a
``RouterOutput``, the MoE block and the decoder layer return ``(tensor, RouterOutput | None)``. Those get a
tensor hook instead: a forward pre-hook passes each input through ``view_as`` (a new autograd node), and a
hook on that view receives exactly the gradient this module sends back to its input. Parameter gradients
are noted in the order autograd accumulates them (``register_post_accumulate_grad_hook``) and read after
backward, so under DDP they are the averaged gradients the optimizer would apply.

Router outputs are recorded with each token's k slots sorted by expert id: ``topk(sorted=False)`` may
list the same k experts in another order on another kernel, which is not a difference.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lingctl.model.layers import MLP, Attention, RMSNorm
from lingctl.model.ling import CausalLMOutput, LingForCausalLM
from lingctl.model.moe import RouterOutput

Phase = Literal["fwd", "bwd"]
ROOT = "(model)"  # the whole model's entry (its logits); "" is not a readable module name
LOSS = "loss"  # pseudo-module of the loss parts
ROUTES = "out.topk_idx"  # a router's entries: the chosen expert ids, and the probabilities they were chosen on
PROBS = "out.probs"
FORCED = "routes_forced"  # meta key: this side ran on the other side's expert ids (--same-routes)
TRACE_FORMAT = "lingctl.align/1"

# Modules whose forward takes and returns plain tensors: full backward hooks work on them.
_FULL_HOOK_TYPES = (nn.Linear, RMSNorm, MLP, Attention)


@dataclass(kw_only=True, slots=True)
class Entry:
    """One recorded tensor. ``what``: ``out``, ``out.<field>``, ``grad_in.<i>`` or ``grad.<parameter>``."""

    phase: Phase
    module: str
    what: str
    tensor: torch.Tensor | None = None  # a parameter's gradient is filled in after backward

    @property
    def key(self) -> str:
        return f"{self.phase}:{self.module}:{self.what}"


@dataclass(kw_only=True, slots=True)
class Trace:
    """One side's record: entries in execution order (forward, loss parts, then backward) and where and
    how they were recorded (``meta``: set-up, batch, model config, weights fingerprint, torch, host)."""

    entries: list[Entry]
    meta: dict[str, Any] = field(default_factory=dict)


# -- capture ----------------------------------------------------------------------------------------------


def _route_sorted(r: RouterOutput) -> list[tuple[str, torch.Tensor]]:
    order = r.topk_idx_TK.argsort(dim=-1)
    return [
        (ROUTES, r.topk_idx_TK.gather(-1, order)),
        ("out.topk_weight", r.topk_weight_TK.gather(-1, order)),
        ("out.logits", r.logits_TE),
        (PROBS, r.probs_TE),
    ]


def _flatten(value: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [("out", value)]
    if isinstance(value, RouterOutput):
        return _route_sorted(value)
    if isinstance(value, CausalLMOutput):
        return [("out.logits", value.logits)]  # its routes repeat what the routers recorded
    if isinstance(value, tuple):  # (hidden, RouterOutput): the router's own entries already hold the route
        return [(f"out.{i}", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class Recorder:
    """Hooks on a model that append ``Entry`` items to ``entries`` in execution order. ``include``: a regex
    on module names (the root is ``(model)``); None records every module. Use as a context manager."""

    def __init__(self, model: LingForCausalLM, include: re.Pattern[str] | None = None) -> None:
        self.model = model
        self.include = include
        self.entries: list[Entry] = []
        self._handles: list[Any] = []
        self._grads: dict[str, tuple[nn.Parameter, Entry]] = {}
        self._calls: dict[str, int] = {}
        self._noted: set[str] = set()  # parameter entries already placed in ``entries``

    def _wanted(self, name: str) -> bool:
        return self.include is None or self.include.search(name) is not None

    def __enter__(self) -> Recorder:
        for name, module in self.model.named_modules():
            name = name or ROOT
            if not self._wanted(name) or isinstance(module, nn.ModuleList):
                continue
            self._handles.append(module.register_forward_hook(self._on_forward(name)))
            if isinstance(module, _FULL_HOOK_TYPES):
                self._handles.append(module.register_full_backward_hook(self._on_backward(name)))
            elif module is not self.model and not isinstance(module, nn.Embedding):
                self._handles.append(module.register_forward_pre_hook(self._tap_inputs(name)))
        for pname, p in self.model.named_parameters():
            module, _, leaf = pname.rpartition(".")
            if self._wanted(module or ROOT):
                entry = Entry(phase="bwd", module=module or ROOT, what=f"grad.{leaf}")
                self._grads[pname] = (p, entry)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad(entry)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _add(self, phase: Phase, module: str, what: str, t: torch.Tensor) -> None:
        # A module called twice in one step (none is, in this model) keeps both calls apart.
        key = f"{phase}:{module}:{what}"
        n = self._calls[key] = self._calls.get(key, 0) + 1
        self.entries.append(Entry(phase=phase, module=module, what=what if n == 1 else f"{what}#{n}", tensor=_keep(t)))

    def add_loss(self, parts: dict[str, torch.Tensor]) -> None:
        for what, t in parts.items():
            self._add("fwd", LOSS, what, t)

    def _on_forward(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for what, t in _flatten(output):
                self._add("fwd", name, what, t)

        return hook

    def _on_backward(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            for i, g in enumerate(grad_input):
                if g is not None:
                    self._add("bwd", name, f"grad_in.{i}", g)

        return hook

    def _tap_inputs(self, name: str) -> Callable[..., Any]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            tapped = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    a = a.view_as(a)
                    a.register_hook(self._on_input_grad(name, i))
                tapped.append(a)
            return tuple(tapped)

        return pre_hook

    def _on_input_grad(self, name: str, i: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            self._add("bwd", name, f"grad_in.{i}", g)

        return hook

    def _on_grad(self, entry: Entry) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._note(entry)

        return hook

    def _note(self, entry: Entry) -> None:
        if entry.key not in self._noted:  # a gradient accumulated twice keeps its first place
            self._noted.add(entry.key)
            self.entries.append(entry)

    def fill_grads(self) -> None:
        """Read every parameter gradient now (after backward and any synchronisation). A parameter no token
        reached (an idle expert) has no gradient: recorded as zeros, after the others, so both sides list it."""
        for p, entry in self._grads.values():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            entry.tensor = _keep(g)
            self._note(entry)


# -- comparison ---------------------------------------------------------------------------------------------
# Relative tolerance per dtype; a pair is held to the less precise of its two sides. The metric is normwise:
# max|a - b| / max(max|a|, max|b|), so it reads in units of the tensor's own scale and tiny elements that
# round differently do not dominate. Unit roundoffs: float32 6e-8, bfloat16 3.9e-3 (8 bits of mantissa).
# - float32 1e-4: a step is a few hundred dependent reductions over the hidden size; rounding grows like
#   sqrt(n) * u, 1e-5 at most in practice, so 1e-4 keeps 10x headroom, while a real fault (a missing
#   renormalisation, a wrong scale, a lost gradient term) shows at 1e-2 or more.
# - bfloat16 3e-2: about 8 units of bf16 rounding, what two bf16 matmul chains differ by after a layer.
# - float64 1e-6, not 1e-12: the router softmax, the expert combine and NormHead compute in float32 whatever
#   the dtype (as Ling's code does), so a float64 side still carries float32 rounding at those points.
TOLERANCE: dict[str, float] = {"float64": 1e-6, "float32": 1e-4, "bfloat16": 3e-2}


def tolerance(dtype_a: str, dtype_b: str) -> float:
    return max(TOLERANCE[dtype_a], TOLERANCE[dtype_b])


@dataclass(kw_only=True, slots=True)
class RouteFlips:
    slots: int  # tokens x k
    flipped: int  # slots whose expert the other side did not choose
    near_ties: int | None  # of those, the ones at a near-tie of the reference's probabilities; None: unknown

    @property
    def all_near_ties(self) -> bool:
        return self.flipped > 0 and self.near_ties == self.flipped

    def note(self) -> str:
        if not self.flipped:
            return ""
        ties = "near-ties unknown: no probs recorded" if self.near_ties is None else f"{self.near_ties} at near-ties"
        return f"{self.flipped}/{self.slots} routes differ ({ties})"


def route_flips(
    ref_TK: torch.Tensor, other_TK: torch.Tensor, ref_probs_TE: torch.Tensor | None, tol: float
) -> RouteFlips:
    """Compare two sides' expert ids per token as sets (the order of a token's k slots means nothing).

    A token's flip is at a near-tie when, on the reference's probabilities, the largest margin the other side
    reversed is at most ``tol`` x that token's largest probability: max p(x) - min p(y) over the experts x only
    the reference chose and y only the other side chose. Every y beat every x on the other side, so that is
    how far the other side's probabilities must have moved; for one swap of the k-th and (k+1)-th experts it
    is the gap between the k-th and (k+1)-th largest probabilities. Rounding at ``tol`` moves them that far; a
    larger reversal is a real difference (``tol`` is the comparison's relative tolerance)."""
    kept_TK = (ref_TK.unsqueeze(-1) == other_TK.unsqueeze(-2)).any(-1)  # reference's expert also chosen there
    flipped_T = (~kept_TK).sum(-1)
    flips = RouteFlips(slots=ref_TK.numel(), flipped=int(flipped_T.sum()), near_ties=None)
    if ref_probs_TE is None or not flips.flipped:
        flips.near_ties = 0 if ref_probs_TE is not None else None
        return flips
    p_TE = ref_probs_TE.to(torch.float64)
    new_TK = ~(other_TK.unsqueeze(-1) == ref_TK.unsqueeze(-2)).any(-1)  # the other side's expert is new
    lost_max_T = p_TE.gather(-1, ref_TK).masked_fill(kept_TK, -torch.inf).amax(-1)
    new_min_T = p_TE.gather(-1, other_TK).masked_fill(~new_TK, torch.inf).amin(-1)
    near_T = (lost_max_T - new_min_T) <= tol * p_TE.amax(-1)
    flips.near_ties = int(flipped_T[near_T & (flipped_T > 0)].sum())
    return flips


@dataclass(kw_only=True, slots=True)
class Row:
    """One entry compared. ``ok`` None: the entry exists on one side only (e.g. the experts' own modules do
    not run under dispatch=grouped, whose kernel reads their weights directly), so it is listed, not judged."""

    index: int
    phase: Phase
    module: str
    what: str
    abs_diff: float | None
    rel_diff: float | None
    tol: float
    ok: bool | None
    note: str = ""
    routes: RouteFlips | None = None  # a router's expert ids: the flipped slots and how many are at near-ties


@dataclass(kw_only=True, slots=True)
class AlignReport:
    a: dict[str, Any]  # each side's trace metadata: set-up, host, torch, device
    b: dict[str, Any]
    tolerance: float
    rows: list[Row]
    compared: int
    failed: int
    one_sided: int
    first_forward: Row | None  # the first forward entry (execution order) beyond tolerance
    first_backward: Row | None  # the first backward entry, in the order autograd ran them, beyond tolerance
    first_module: str | None  # the verdict's module: forward first, as a forward difference reaches every gradient
    verdict: str
    ok: bool
    routes_forced: str | None = None  # "b" (or "a"): that side ran on the other side's routes (--same-routes)
    route_flips: RouteFlips | None = None  # all routers' flips together (with forced routes: those that would be)


def compare_tensors(a: torch.Tensor, b: torch.Tensor, tol: float) -> tuple[float, float, bool, str]:
    """(max abs diff, relative diff, within tolerance, note), computed in float64."""
    if tuple(a.shape) != tuple(b.shape):
        return math.inf, math.inf, False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if not a.dtype.is_floating_point and not b.dtype.is_floating_point:
        # Expert ids: a routing decision either matches or it does not; a flipped one is a difference.
        differ = int((a != b).sum())
        n = max(a.numel(), 1)
        return float(differ), differ / n, differ == 0, f"{differ}/{a.numel()} routes differ" if differ else ""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    bad_a, bad_b = ~torch.isfinite(a64), ~torch.isfinite(b64)
    if not torch.equal(bad_a, bad_b):
        return math.inf, math.inf, False, f"non-finite values: {int(bad_a.sum())} vs {int(bad_b.sum())}"
    a64, b64 = a64.masked_fill(bad_a, 0.0), b64.masked_fill(bad_b, 0.0)
    if a64.numel() == 0:
        return 0.0, 0.0, True, ""
    diff = float((a64 - b64).abs().max())
    scale = max(float(a64.abs().max()), float(b64.abs().max()))
    rel = diff / scale if scale > 0 else 0.0
    return diff, rel, rel <= tol, ""


def compare(a: Trace, b: Trace) -> AlignReport:
    """Every entry of ``a`` in its execution order against the same entry of ``b``; entries only ``b`` has
    follow. The verdict names the first forward failure, else the first backward one.

    Routers' expert ids are compared per token as sets, against the reference side: the side whose routes
    the other ran on (``FORCED`` in the other's meta), else ``a``. A router whose flips are all at near-ties
    (``route_flips``) passes when the routes were forced, since everything after it then ran on the same
    routes and is judged on its own; otherwise it fails (the outputs do differ) and the verdict says so."""
    tol = tolerance(a.meta["setup"]["dtype"], b.meta["setup"]["dtype"])
    forced = "b" if b.meta.get(FORCED) else "a" if a.meta.get(FORCED) else None
    ref, other_side = ("b", "a") if forced == "a" else ("a", "b")
    ref_entries = {e.key: e for e in (b if ref == "b" else a).entries}
    theirs = {e.key: e for e in b.entries}
    ours = {e.key for e in a.entries}
    rows: list[Row] = []
    flips: list[RouteFlips] = []
    for e in [*a.entries, *(e for e in b.entries if e.key not in ours)]:
        other = theirs.get(e.key) if e.key in ours else None
        row = Row(
            index=len(rows) + 1,
            phase=e.phase,
            module=e.module,
            what=e.what,
            abs_diff=None,
            rel_diff=None,
            tol=tol,
            ok=None,
        )
        if e.key not in ours:
            row.note = "only in b"
        elif other is None:
            row.note = "only in a"
        else:
            assert e.tensor is not None and other.tensor is not None
            if e.phase == "fwd" and e.what == ROUTES and e.tensor.shape == other.tensor.shape:
                ref_idx, other_idx = (e.tensor, other.tensor) if ref == "a" else (other.tensor, e.tensor)
                probs = ref_entries.get(f"fwd:{e.module}:{PROBS}")
                row.routes = route_flips(ref_idx, other_idx, probs.tensor if probs else None, tol)
                flips.append(row.routes)
                row.abs_diff, row.rel_diff = float(row.routes.flipped), row.routes.flipped / max(row.routes.slots, 1)
                row.ok = not row.routes.flipped or (forced is not None and row.routes.all_near_ties)
                row.note = row.routes.note()
                if forced is not None:
                    row.note = "; ".join(filter(None, [row.note, f"{forced} ran on {ref}'s routes"]))
            else:
                row.abs_diff, row.rel_diff, row.ok, row.note = compare_tensors(e.tensor, other.tensor, tol)
        rows.append(row)
    total = _sum_flips(flips)
    failed = [r for r in rows if r.ok is False]
    first_fwd = next((r for r in failed if r.phase == "fwd"), None)
    first_bwd = next((r for r in failed if r.phase == "bwd"), None)
    first = first_fwd or first_bwd
    compared = sum(r.ok is not None for r in rows)
    if first is None:
        verdict = f"a and b agree: {compared} entries within tolerance {tol:g}"
        if forced is not None and total is not None:
            own = (
                f"{total.flipped}/{total.slots} of its own would differ"
                if total.flipped
                else "none of its own would differ"
            )
            ties = f", {total.near_ties} at near-ties" if total.flipped else ""
            verdict += f" ({forced} ran on {ref}'s routes: {own}{ties})"
    else:
        where = "forward" if first is first_fwd else "backward (the forward agrees)"
        verdict = f"first disagreement: {first.module} in {where}, {first.what}: {_why(first)}"
        if first.routes is not None and first.routes.all_near_ties:
            verdict += "; all at near-ties: rounding; rerun with --same-routes to compare the rest"
    return AlignReport(
        a=a.meta,
        b=b.meta,
        tolerance=tol,
        rows=rows,
        compared=compared,
        failed=len(failed),
        one_sided=len(rows) - compared,
        first_forward=first_fwd,
        first_backward=first_bwd,
        first_module=first.module if first else None,
        verdict=verdict,
        ok=first is None,
        routes_forced=forced,
        route_flips=total,
    )


def _sum_flips(flips: list[RouteFlips]) -> RouteFlips | None:
    if not flips:
        return None
    ties = [f.near_ties for f in flips]
    return RouteFlips(
        slots=sum(f.slots for f in flips),
        flipped=sum(f.flipped for f in flips),
        near_ties=None if None in ties else sum(t or 0 for t in ties),
    )


def _why(row: Row) -> str:
    if row.note:
        return row.note
    return f"relative difference {row.rel_diff:.3g} > {row.tol:g}"
