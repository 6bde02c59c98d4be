"""``lingctl train align``: one batch through two set-ups (dtype, dispatch, device, workers, weights), every
module's forward and backward compared, and the first module where they disagree named.

Why (Ling report §6.2): on new hardware, checks of single operators passed and training still converged
differently; what found the causes was aligning whole framework modules, forward and backward (router
gradients, auxiliary losses, communication). A set-up is recorded with the same loss as training
(``losses.step_loss``, which the trainer calls too), one side may be a trace file recorded elsewhere
(``--save`` on the old platform, ``--against`` on the new one), and a planted bug (``bug=``) checks that
the tool finds a known fault.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch

from lingctl.core.errors import LingctlError, UsageError
from lingctl.core.names import printable
from lingctl.model.checkpoint import load_config, load_weights_into
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM
from lingctl.runs.train_config import MoeLossConfig
from lingctl.train import losses
from lingctl.train.align.router import force_routes, own_routes, plant_bug, router_names, routes_of
from lingctl.train.align.setup import AlignJob, SetUp, check_setup, make_batch
from lingctl.train.align.trace import (
    FORCED,
    LOSS,
    AlignReport,
    Recorder,
    Trace,
    compare,
)
from lingctl.train.align.trace_file import load_trace, save_trace

log = logging.getLogger(__name__)

_CPP_LOG = "TORCH_CPP_LOG_LEVEL"
WORKER_TIMEOUT_S = 300.0  # a worker set-up of a small model takes seconds; a hung one is stopped


def weights_fingerprint(model: LingForCausalLM) -> str:
    """A hash of every parameter as float32 (whatever the side's dtype), to tell a trace of other weights."""
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _side_config(job: AlignJob, setup: SetUp) -> tuple[LingConfig, str | None]:
    checkpoint = setup.checkpoint or job.checkpoint
    config = load_config(Path(checkpoint)) if checkpoint else dataclasses.replace(job.config)
    return config, checkpoint


def build_model(job: AlignJob, setup: SetUp) -> tuple[LingForCausalLM, str]:
    """The side's model (weights loaded or seeded, bug planted, dtype and device set) and its fingerprint."""
    config, checkpoint = _side_config(job, setup)
    model = LingForCausalLM(config, setup.dispatch)
    if checkpoint:
        load_weights_into(model, Path(checkpoint))
    else:
        model.init_weights(torch.Generator().manual_seed(job.seed))
    fingerprint = weights_fingerprint(model)
    bug = setup.bug_parts()
    if bug is not None:
        plant_bug(model, *bug)
    if setup.dtype == "float64":
        model = model.double()
    return model.to(setup.device), fingerprint


def training_loss(
    forward: torch.nn.Module,
    config: LingConfig,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    dtype: str,
    moe: MoeLossConfig,
    batch_balance: bool = False,
) -> dict[str, torch.Tensor]:
    """The loss of one training step, as the trainer computes it: bf16 autocast when asked, logits
    in float32 (float64 for a float64 set-up, which would otherwise drop to float32 here), cross-entropy,
    plus the balance loss and the z-loss with their coefficients. ``batch_balance``: the balance loss uses
    the whole batch's routed fractions (several workers, ``balance=batch``)."""
    parts = losses.step_loss(
        forward,
        inputs,
        targets,
        num_experts=config.num_experts,
        balance_coef=moe.balance_coef,
        z_coef=moe.z_coef,
        bf16=dtype == "bfloat16",
        logits_dtype=torch.float64 if dtype == "float64" else torch.float32,
        batch_balance=batch_balance,
    )
    return {"lm": parts["lm_loss"], "balance": parts["balance_loss"], "z": parts["z_loss"], "total": parts["loss"]}


def _meta(job: AlignJob, setup: SetUp, config: LingConfig, fingerprint: str) -> dict[str, Any]:
    device = torch.cuda.get_device_name() if setup.device == "cuda" else platform.processor() or platform.machine()
    return {
        "setup": dataclasses.asdict(setup),
        "batch": {"seed": job.seed, "batch_size": job.batch_size, "seq_len": job.seq_len},
        "model": config.to_hf_dict(),
        "weights": fingerprint,
        "loss": {"balance_coef": job.loss.balance_coef, "z_coef": job.loss.z_coef},
        "modules": job.modules,
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "device_name": device,
    }


def _record_one(
    job: AlignJob, setup: SetUp, *, rank: int = 0, world: int = 1, routes: dict[str, torch.Tensor] | None = None
) -> Trace:
    """Forward and backward of this process's rows of the batch (all of it with one worker). ``routes``: the
    whole batch's expert ids per router, which this side's routers must use (--same-routes)."""
    model, fingerprint = build_model(job, setup)
    batch = make_batch(job, model.config.vocab_size)
    rows = job.batch_size // world  # contiguous shards: concatenating the workers' entries restores the batch
    batch = batch[rank * rows : (rank + 1) * rows].to(setup.device)
    # A router sees the batch as [B * S] tokens, row-major, so this shard's tokens are contiguous as well.
    tokens = rows * job.seq_len
    patches = (
        force_routes(model, {n: t[rank * tokens : (rank + 1) * tokens] for n, t in routes.items()}) if routes else {}
    )
    include = re.compile(job.modules) if job.modules else None
    model.train()
    forward: torch.nn.Module = model
    if world > 1 and setup.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # As the trainer wraps it: experts no token reached get no gradient, so DDP must look for them.
        forward = DistributedDataParallel(model, find_unused_parameters=True)
    with Recorder(model, include) as rec:
        parts = training_loss(
            forward,
            model.config,
            batch[:, :-1],
            batch[:, 1:],
            dtype=setup.dtype,
            moe=job.loss,
            batch_balance=world > 1 and setup.balance == "batch",
        )
        rec.add_loss(parts)
        parts["total"].backward()
        if world > 1 and setup.mode == "edit":
            _mean_grads(model, world)
        rec.fill_grads()
    meta = _meta(job, setup, model.config, fingerprint)
    if patches:
        own_routes(rec.entries, {n: p.own_TK for n, p in patches.items()})
        meta[FORCED] = True
    return Trace(entries=rec.entries, meta=meta)


def _mean_grads(model: LingForCausalLM, world: int) -> None:
    """EDiT after one local step: the workers' parameter changes are averaged, which for one step of plain
    SGD is the mean of their gradients (Adam's normalisation aside). Unused parameters count as zero."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


def check_model(job: AlignJob, setup: SetUp) -> None:
    """Before any work (and not from inside a worker): the checkpoint's config.json must read (exit 3 when it
    is missing), and a planted bug must name a router of the model (checked on an empty, meta, model)."""
    config, _ = _side_config(job, setup)
    bug = setup.bug_parts()
    if bug is not None:
        with torch.device("meta"):
            plant_bug(LingForCausalLM(config, setup.dispatch), *bug)


def record(job: AlignJob, setup: SetUp, *, side: str = "a", routes: dict[str, torch.Tensor] | None = None) -> Trace:
    """Run one set-up on the job's batch and return its trace; with ``routes`` (expert ids of the whole
    batch per router), its routers use those."""
    job.validate()
    check_setup(setup, side=side)
    check_model(job, setup)
    if setup.workers > 1:
        if job.batch_size % setup.workers:
            raise UsageError(f"--batch-size {job.batch_size} does not split evenly across workers={setup.workers}")
        return _record_workers(job, setup, routes)
    return _record_one(job, setup, routes=routes)


# -- several workers ------------------------------------------------------------------------------------------
# Scaling: each worker's loss is a mean over its own 1/W of the tokens and DDP (or EDiT's sync) averages the
# parameter gradients, so for the mean-type parts (LM loss, z-loss) the result equals one worker's on the
# whole batch (equal shards: the batch size must divide by W). The activation gradients a worker sees are W
# times the whole batch's (its mean has W times fewer terms): they are divided by W before comparing. The
# loss parts are the mean over workers, as the trainer reports them. The balance loss is not a mean over
# tokens: E * sum_i f_i * P_i with each worker's own routed fractions f_i (``balance=rank``, what training
# does) differs from the whole batch's value, and so do the router gradients it adds, by how far each
# shard's routing is from the batch's. That is a property of training with several workers, not a fault;
# ``balance=batch`` removes it so that only the synchronisation is compared.


def _worker(
    rank: int, job: AlignJob, setup: SetUp, port: int, out_dir: str, routes: dict[str, torch.Tensor] | None
) -> None:
    import torch.distributed as dist

    out = Path(out_dir)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // setup.workers))
        store = dist.TCPStore("127.0.0.1", port, setup.workers, is_master=rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=setup.workers)
        try:
            save_trace(
                out / f"rank{rank}.safetensors", _record_one(job, setup, rank=rank, world=setup.workers, routes=routes)
            )
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # reported by the parent as one line; it stops the other workers
        message = exc.message if isinstance(exc, LingctlError) else f"{type(exc).__name__}: {exc}"
        (out / f"rank{rank}.error").write_text(message)


def _record_workers(job: AlignJob, setup: SetUp, routes: dict[str, torch.Tensor] | None) -> Trace:
    import torch.multiprocessing as mp

    from lingctl.core.net import free_port

    w = setup.workers
    with tempfile.TemporaryDirectory(prefix="lingctl-align-") as tmp:
        out = Path(tmp)
        # The workers inherit this environment at spawn: C++ warnings off in them (DDP notes that a step used
        # every expert), as ``workers.launch_env`` does for training's workers; restored at once.
        before = os.environ.get(_CPP_LOG)
        os.environ[_CPP_LOG] = before or "ERROR"
        try:
            ctx = mp.start_processes(
                _worker, args=(job, setup, free_port(), tmp, routes), nprocs=w, join=False, start_method="spawn"
            )
        finally:
            if before is None:
                del os.environ[_CPP_LOG]
        try:
            deadline = time.monotonic() + WORKER_TIMEOUT_S
            while True:
                errors = sorted(out.glob("rank*.error"))
                if errors:
                    raise LingctlError(f"align worker {errors[0].stem[4:]}: {errors[0].read_text().strip()}")
                if ctx.join(timeout=0.5):
                    break
                if time.monotonic() > deadline:
                    raise LingctlError(f"{w} align workers still running after {WORKER_TIMEOUT_S:.0f} s")
        except mp.ProcessExitedException as exc:
            raise LingctlError(f"align worker {exc.error_index} died (exit code {exc.exit_code})") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return _merge([load_trace(out / f"rank{r}.safetensors") for r in range(w)], w)


def _merge(traces: list[Trace], world: int) -> Trace:
    """One trace of the whole batch from the workers' (see the scaling note above)."""
    by_rank = [{e.key: e for e in t.entries} for t in traces]
    order = list(by_rank[0])
    order += [k for ranked in by_rank[1:] for k in ranked if k not in by_rank[0]]
    merged = []
    for key in dict.fromkeys(order):
        parts = [ranked[key] for ranked in by_rank if key in ranked]
        tensors = [cast(torch.Tensor, e.tensor).clone() for e in parts]
        head = parts[0]
        if head.module == LOSS:
            t = torch.stack([x.to(torch.float64) for x in tensors]).mean().to(tensors[0].dtype)
        elif head.what.startswith("grad."):  # parameter gradients: already averaged, equal on every worker
            t = tensors[0]
        elif head.phase == "bwd":
            t = torch.cat(tensors) / world
        else:
            t = torch.cat(tensors)
        merged.append(dataclasses.replace(head, tensor=t))
    return Trace(entries=merged, meta=traces[0].meta)


# -- the whole command ------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class AlignOptions:
    job: AlignJob
    a: SetUp
    b: SetUp | None = None  # None: compare with ``against``, or only record ``a`` (``save``)
    against: Path | None = None
    save: Path | None = None
    force: bool = False  # --save may replace an existing file
    # The compared side runs on the reference's expert ids: b on a's, or with ``against`` a on the trace's.
    same_routes: bool = False


_COMPARABLE = (
    ("model", "model shape"),
    ("weights", "weights"),
    ("batch", "batch"),
    ("loss", "loss"),
    ("modules", "--modules"),
)


def check_comparable(a: dict[str, Any], b: dict[str, Any], source: str) -> None:
    """A trace of another model, other weights, another batch or loss is refused: nothing would match.
    Only the keys ``a`` holds are checked (before recording, ``a`` has no weights fingerprint yet)."""
    for key, what in _COMPARABLE:
        if key not in a:
            continue
        mine, theirs = a.get(key), b.get(key)
        if mine != theirs:
            if isinstance(mine, dict) and isinstance(theirs, dict):  # name only the fields that differ
                diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
                mine, theirs = {k: mine.get(k) for k in diff}, {k: theirs.get(k) for k in diff}
            # What the trace says is data: shown escaped and cut short (a crafted field may be long).
            there = printable(str(theirs))
            there = there if len(there) <= 300 else there[:300] + "..."
            raise UsageError(f"{source} was recorded with other {what} ({there} there, {mine} here)")


def _planned_meta(job: AlignJob, setup: SetUp) -> dict[str, Any]:
    """What a side's trace meta will hold that is known before it runs (all but the weights fingerprint)."""
    full = _meta(job, setup, _side_config(job, setup)[0], fingerprint="")
    del full["weights"]
    return full


def _routers(job: AlignJob, setup: SetUp) -> list[str]:
    with torch.device("meta"):
        return router_names(LingForCausalLM(_side_config(job, setup)[0], setup.dispatch))


def _check_same_routes(opts: AlignOptions) -> list[str]:
    """What --same-routes needs, checked before anything runs; returns the routers' names."""
    if opts.b is None and opts.against is None:
        raise UsageError("--same-routes needs a side to compare: give --b or --against")
    if opts.against is not None and opts.save is not None:
        # With --against, set-up a runs on the trace's routes: a trace of that is not a record of a's own.
        raise UsageError(
            "--same-routes with --against runs set-up a on the trace's routes; --save would not record a's own",
            hint="record with --save in a run of its own",
        )
    routers = _routers(opts.job, opts.a)
    regex = opts.job.modules
    missing = [n for n in routers if regex is not None and re.search(regex, n) is None]
    if missing and opts.against is None:
        raise UsageError(
            f"--same-routes: --modules '{regex}' leaves out the router {missing[0]}, whose expert ids b must use",
            hint=rf"add the routers to --modules, e.g. '{regex}|mlp\.gate$'",
        )
    return routers


def run_align(opts: AlignOptions) -> tuple[Trace, AlignReport | None]:
    """Record set-up a, save it if asked, and compare it with set-up b or a saved trace. With
    ``same_routes``, the reference's expert ids are recorded first and the other side's routers use them."""
    if opts.save is not None and opts.save.exists() and not opts.force:
        raise UsageError(
            f"{opts.save} already exists", hint="choose another --save path, or pass --force to replace it"
        )
    routers = _check_same_routes(opts) if opts.same_routes else []
    for setup in (opts.a, opts.b):
        if setup is not None:
            check_model(opts.job, setup)  # before set-up a runs: a bad set-up b should not cost a's time
    shapes = [_side_config(opts.job, s)[0].to_hf_dict() for s in (opts.a, opts.b) if s is not None]
    if len(shapes) == 2 and shapes[0] != shapes[1]:  # before either runs: forced routes would not fit
        raise UsageError("set-ups a and b load models of different shapes (their checkpoint= differ)")
    other = load_trace(opts.against) if opts.against is not None else None
    tokens = opts.job.batch_size * opts.job.seq_len
    forced_a: dict[str, torch.Tensor] | None = None
    if other is not None:
        check_comparable(_planned_meta(opts.job, opts.a), other.meta, str(opts.against))
        if opts.same_routes:
            forced_a = routes_of(other, routers, str(opts.against), tokens=tokens)
    log.info("recording a: %s", opts.a.describe())
    a = record(opts.job, opts.a, routes=forced_a)
    if opts.save is not None:
        save_trace(opts.save, a)
    if other is not None:
        check_comparable(a.meta, other.meta, str(opts.against))
        return a, compare(a, other)
    if opts.b is None:
        return a, None
    log.info("recording b: %s", opts.b.describe())
    forced_b = routes_of(a, routers, "set-up a", tokens=tokens) if opts.same_routes else None
    b = record(opts.job, opts.b, side="b", routes=forced_b)
    return a, compare(a, b)
