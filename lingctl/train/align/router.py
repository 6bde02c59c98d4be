"""What ``lingctl train align`` does to routers: the planted bugs (a drill: the report must name the module)
and forced routes (``--same-routes``: one side runs on the other side's expert choices; ``route_flips`` in
``align_trace`` tells which flips were at near-ties, i.e. rounding).

Why forced routes: a top-k decision is discontinuous. Two set-ups that agree to rounding (float32 against
bfloat16, one kernel against another) still send a token to another expert where its k-th and (k+1)-th
probabilities are nearly equal, and from there every expert downstream sees other tokens, so every later
entry differs for a reason that is not a fault. Aligning MoE training across platforms therefore runs the
new side on the reference's routing decisions and compares everything else; the flips are reported apart.

Both replace the forward of one router instance (never the class) with one copy of ``Router.forward``
whose steps are switched by a ``RouterPatch`` kept on that instance, so a planted bug and forced routes
combine: a router that skips the renormalisation still skips it on forced routes.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.core.errors import LingctlError, UsageError, VerificationError
from lingctl.model.moe import Router, RouterOutput
from lingctl.train.align.trace import ROUTES, Entry, Trace

BUGS: dict[str, str] = {
    "router-no-renorm": "the router skips the renormalisation of the top-k weights (a forward bug)",
    "router-no-grad": "the router's scores are detached: same forward, no gradient through the routing weights "
    "(a backward-only bug; the z-loss still reaches the router)",
}
_PATCH_ATTR = "_align_patch"


@dataclass(kw_only=True, slots=True)
class RouterPatch:
    """How one router instance departs from ``Router.forward``."""

    name: str
    renorm: bool = True  # False: router-no-renorm
    grad: bool = True  # False: router-no-grad
    routes_TK: torch.Tensor | None = None  # forced expert ids, one row per token of this process's batch
    own_TK: list[torch.Tensor] = field(default_factory=list)  # its own top-k of each call, taken before forcing


def _patched_forward(self: Router, x_TD: torch.Tensor) -> RouterOutput:
    # Router.forward, with the steps a RouterPatch switches.
    patch: RouterPatch = getattr(self, _PATCH_ATTR)
    logits = F.linear(x_TD, self.weight).to(torch.float32)
    routed = logits if patch.grad else logits.detach()
    if self.warmup_alpha < 1.0:
        routed = self._blend(routed)
    probs = routed.softmax(dim=-1)
    weight, idx = torch.topk(probs, k=self.top_k, dim=-1, sorted=False)
    if patch.routes_TK is not None:
        if patch.routes_TK.shape != idx.shape:
            raise LingctlError(
                f"{patch.name}: forced routes of shape {tuple(patch.routes_TK.shape)}, the router chose "
                f"{tuple(idx.shape)} (tokens x k)"
            )
        patch.own_TK.append(idx.detach().to("cpu", copy=True))
        # The reference's experts, weighted by this side's own probabilities at them, so this side's
        # gradients flow through its own numbers.
        idx = patch.routes_TK
        weight = probs.gather(-1, idx)
    if patch.renorm and self.top_k > 1 and self.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    return RouterOutput(idx, weight, logits, probs)


def _patch(router: Router, name: str) -> RouterPatch:
    patch: RouterPatch | None = getattr(router, _PATCH_ATTR, None)
    if patch is None:
        patch = RouterPatch(name=name)
        setattr(router, _PATCH_ATTR, patch)
        router.forward = types.MethodType(_patched_forward, router)  # type: ignore[method-assign]
    return patch


def router_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, Router)]


def plant_bug(model: nn.Module, bug: str, module: str) -> None:
    """Make the router ``module`` of ``model`` behave as the faulty one named ``bug`` (see BUGS)."""
    target = dict(model.named_modules()).get(module)
    if not isinstance(target, Router):
        raise UsageError(
            f"bug {bug}@{module}: {module!r} is not a router of this model",
            hint=f"routers: {', '.join(router_names(model)) or 'none'}",
        )
    patch = _patch(target, module)
    patch.renorm = bug != "router-no-renorm"
    patch.grad = bug != "router-no-grad"


def force_routes(model: nn.Module, routes: dict[str, torch.Tensor]) -> dict[str, RouterPatch]:
    """Make every router of ``model`` use the expert ids ``routes[name]`` ([tokens, k], this process's rows),
    and return the patches, whose ``own_TK`` receive the routers' own choices as they run."""
    patches = {}
    for name in router_names(model):
        router = model.get_submodule(name)
        assert isinstance(router, Router)
        patch = _patch(router, name)
        patch.routes_TK = routes[name].to(router.weight.device, torch.long)
        patches[name] = patch
    return patches


# -- forced routes and traces ------------------------------------------------------------------------------


def routes_of(trace: Trace, routers: list[str], source: str, *, tokens: int) -> dict[str, torch.Tensor]:
    """The expert ids every router chose in ``trace`` (the whole batch of ``tokens`` tokens, each token's k
    sorted by id). A trace of this batch whose routes hold another number of tokens is not one lingctl wrote
    (exit 4)."""
    entries = {e.key: e for e in trace.entries}
    missing = [n for n in routers if f"fwd:{n}:{ROUTES}" not in entries]
    if missing:
        modules = trace.meta.get("modules")
        raise UsageError(
            f"--same-routes: {source} holds no {ROUTES} of the router {missing[0]} (recorded with --modules '{modules}')",
            hint="record it again with --modules matching every router (mlp\\.gate$), or compare without --same-routes",
        )
    routes = {n: cast(torch.Tensor, entries[f"fwd:{n}:{ROUTES}"].tensor) for n in routers}
    for name, t in routes.items():
        if t.shape[0] != tokens:
            raise VerificationError(
                f"{source}: the router {name}'s {ROUTES} has {t.shape[0]} tokens, the batch {tokens}"
            )
    return routes


def own_routes(entries: list[Entry], own: dict[str, list[torch.Tensor]]) -> None:
    """With forced routes, a router's recorded expert ids are the ones it would have chosen (each token's k
    sorted by id, as recorded otherwise): the report shows those flips; its other entries are as it ran."""
    by_key = {e.key: e for e in entries}
    for name, calls in own.items():
        for n, idx_TK in enumerate(calls, start=1):
            entry = by_key.get(f"fwd:{name}:{ROUTES}" + (f"#{n}" if n > 1 else ""))
            if entry is not None:
                entry.tensor = idx_TK.sort(dim=-1).values
