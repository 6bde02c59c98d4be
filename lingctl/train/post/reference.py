"""A DPO run's reference: the starting checkpoint's summed log-probabilities of every answer, computed once,
before the first step, and kept in the run directory (``reference_logps.json``), so a resumed run, whose
weights have moved, reads them instead of needing the frozen model again.

Several workers split the rows between them and add up the results (each row is one worker's); rank 0 writes
the file. The file names the data fingerprint it was computed for; a resume with other data is refused before
this, and a file that does not match is refused here.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import torch

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import LingctlError, VerificationError
from lingctl.runs.layout import REFERENCE
from lingctl.train.post.logps import item_logps
from lingctl.train.post.packing import PackedRows
from lingctl.train.rundir import RunDir
from lingctl.train.workers import Workers

log = logging.getLogger(__name__)


def _computed(rows: PackedRows, workers: Workers, model: torch.nn.Module, bf16: bool) -> np.ndarray:
    """Every item's log-probabilities: each worker computes its share of the rows, the sum goes to all."""
    out = item_logps(model, rows, indices=range(workers.rank, len(rows), workers.world), bf16=bf16)
    if workers.distributed:
        import torch.distributed as dist

        total = torch.from_numpy(out)
        dist.all_reduce(total)
        out = total.numpy()
    return out


def reference_logps(
    splits: dict[str, PackedRows],
    model: torch.nn.Module,
    run: RunDir,
    workers: Workers,
    *,
    fingerprint: str,
    resume: bool,
    bf16: bool,
) -> dict[str, torch.Tensor]:
    """Per split, every item's (chosen, rejected) summed log-probabilities: read from the run (``resume``), or
    computed with ``model`` (the starting weights, before any step) and written there."""
    if resume:
        return _read(run, fingerprint)
    began = time.monotonic()
    was = model.training
    model.eval()
    try:
        computed = {name: _computed(rows, workers, model, bf16) for name, rows in splits.items()}
    finally:
        model.train(was)
    log.info("reference log-probabilities of %d pairs in %.1f s", splits["train"].n_items, time.monotonic() - began)
    if workers.is_main:
        run.claim_files([REFERENCE])
        doc = {"fingerprint": fingerprint, **{name: v.tolist() for name, v in computed.items()}}
        with atomic_write(run.local / REFERENCE) as (_, f):
            f.write(json.dumps(doc).encode())
        run.publish([REFERENCE])
    workers.barrier()
    return {name: torch.from_numpy(v) for name, v in computed.items()}


def _read(run: RunDir, fingerprint: str) -> dict[str, torch.Tensor]:
    if not run.store.exists(REFERENCE):
        raise LingctlError(
            f"{run.describe()}/{REFERENCE} is missing: a DPO run cannot resume without its reference",
            hint="restore the file, or start the run again",
        )
    try:
        doc = json.loads(run.read(REFERENCE))
    except ValueError:
        raise VerificationError(f"{run.describe()}/{REFERENCE} is damaged: not JSON") from None
    if not isinstance(doc, dict) or doc.get("fingerprint") != fingerprint:
        raise VerificationError(f"{run.describe()}/{REFERENCE} was computed for other data")
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in doc.items() if k in ("train", "eval")}
