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
from lingctl.train.post.objective import Finetuning, item_logps
from lingctl.train.post.packing import PackedRows
from lingctl.train.rundir import RunDir
from lingctl.train.workers import Workers

log = logging.getLogger(__name__)


def _shard(rows: PackedRows, workers: Workers, model: torch.nn.Module, bf16: bool) -> np.ndarray:
    """This worker's rows' log-probabilities (every item of the split; 0 for the others' items), summed over
    the workers."""
    out = np.zeros((rows.n_items, 2), dtype=np.float64)
    for r in range(workers.rank, len(rows), workers.world):
        out += item_logps(model, _one_row(rows, r), bf16=bf16)
    if workers.distributed:
        import torch.distributed as dist

        total = torch.from_numpy(out)
        dist.all_reduce(total)
        out = total.numpy()
    return out


def _one_row(rows: PackedRows, r: int) -> PackedRows:
    """Row ``r`` alone (its items keep their indices)."""
    s, e = int(rows.row_starts[r]), int(rows.row_starts[r + 1])
    a, b = int(rows.seg_starts[r]), int(rows.seg_starts[r + 1])
    return PackedRows(
        tokens=rows.tokens[s:e],
        loss_mask=rows.loss_mask[s:e],
        positions=rows.positions[s:e],
        block=rows.block[s:e],
        row_starts=np.array([0, e - s], dtype=np.int64),
        seg_starts=np.array([0, b - a], dtype=np.int64),
        seg_item=rows.seg_item[a:b],
        seg_side=rows.seg_side[a:b],
        stage_rows=[1],
        n_items=rows.n_items,
    )


def attach_reference(
    objective: Finetuning,
    model: torch.nn.Module,
    run: RunDir,
    workers: Workers,
    *,
    fingerprint: str,
    resume: bool,
    bf16: bool,
) -> None:
    """Set ``objective.reference``: read from the run (``resume``) or computed with ``model`` (the starting
    weights, before any step) and written there."""
    if resume:
        objective.reference = _read(run, fingerprint)
        return
    began = time.monotonic()
    was = model.training
    model.eval()
    try:
        splits = {"train": objective.train}
        if objective.eval_rows is not None:
            splits["eval"] = objective.eval_rows
        computed = {name: _shard(rows, workers, model, bf16) for name, rows in splits.items()}
    finally:
        model.train(was)
    log.info("reference log-probabilities of %d pairs in %.1f s", objective.train.n_items, time.monotonic() - began)
    objective.reference = {name: torch.from_numpy(v) for name, v in computed.items()}
    if workers.is_main:
        run.claim_files([REFERENCE])
        doc = {"fingerprint": fingerprint, **{name: v.tolist() for name, v in computed.items()}}
        with atomic_write(run.local / REFERENCE) as (_, f):
            f.write(json.dumps(doc).encode())
        run.publish([REFERENCE])
    workers.barrier()


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
