"""A training run's directory, on local disk or in an object store (``s3://bucket/prefix``).

Layout::

    tokenizer.json                 the run's tokenizer
    metrics.jsonl                  one JSON record per step / eval / spike / checkpoint
    checkpoints/step-00000050/     a complete Ling checkpoint (loadable by flood) + state/ + train_config.json
    latest.json                    {"step": 50, "path": "checkpoints/step-00000050"}, written last
    lingctl-run.json               what lingctl created here (lingctl.runs.layout), written first

A checkpoint counts only once ``latest.json`` names it, and ``latest.json`` is replaced only after every
file of the checkpoint is written (and uploaded), so a crash mid-save leaves the previous checkpoint in
charge. Nothing but what ``lingctl-run.json`` lists is ever overwritten or deleted (``owned.py``), so a run
directory may hold the user's own files. The training state (model, optimizer, data position) is a pcache
DCP checkpoint in ``state/``.

For ``s3://`` runs the local directory is pcache's flash tier (``--cache-dir``): a checkpoint is written
there at local-disk speed, training continues, and pcache's uploader copies ``state/`` to the store in the
background (its commit marker last), then the other files, then ``latest.json``. A resume reads the local
copy when it is complete and verifies, and downloads otherwise. The store has no append, so
``metrics.jsonl`` is re-uploaded whole at each checkpoint and at the end of the run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError, NotFoundError, os_error
from lingctl.core.names import check_relative, join_under
from lingctl.core.storage import LocalStore, ObjectStore, S3Options, StoreURL, open_store, parse_url
from lingctl.model.checkpoint_files import STATE_DIR, TOKENIZER
from lingctl.pcache import tier
from lingctl.pcache.marker import verify_local
from lingctl.runs.layout import (
    INCIDENT_FILES,
    LATEST,
    METRICS,
    RUN_FILES,
    checkpoint_step,
    parse_latest,
    staging_dir,
)
from lingctl.runs.owned import LocalPlace, OwnedPlace, StorePlace

log = logging.getLogger(__name__)

_FOREIGN_HINT = (
    "choose a new --out, or pass --adopt to add the run's files beside the ones there "
    "(lingctl never overwrites or deletes a file it did not write)"
)


class RunDir:
    """The run's files through the store interface: ``store`` is where the run lives (a ``LocalStore`` of
    its directory, or the S3 store), ``staging`` the local directory it is written in first (the same
    ``LocalStore`` for a local run, the staging copy for an s3:// run)."""

    def __init__(
        self, url: str, s3: S3Options | None = None, *, cache_dir: Path | None = None, adopt: bool = False
    ) -> None:
        """``adopt``: the directory may already hold other files; lingctl adds its own beside them."""
        self.url = parse_url(url)
        self.s3 = s3 or S3Options()
        self.adopt = adopt
        self.store: ObjectStore = open_store(self.url, s3)
        self.remote_run = self.url.is_s3
        self.local = staging_dir(self.url, cache_dir) if self.remote_run else self.url.path
        self.staging: ObjectStore = (
            LocalStore(StoreURL("file", prefix=str(self.local))) if self.remote_run else self.store
        )
        self.remote: StorePlace | None = None
        if not self.remote_run:
            self.place = LocalPlace(self.local, hint=_FOREIGN_HINT)
        else:
            staging = f"it is the local staging copy of {self.url}: remove it, or pass another --cache-dir"
            self.place = LocalPlace(self.local, hint=staging, conflict_hint=staging)
            self.remote = StorePlace(self.store, hint=_FOREIGN_HINT)
        self._uploader: tier.Uploader | None = None

    def describe(self) -> str:
        return str(self.url) if self.remote_run else str(self.local)

    def _places(self) -> list[OwnedPlace]:
        return [self.place] + ([self.remote] if self.remote is not None else [])

    def _stores(self) -> list[ObjectStore]:
        """Where the run's own files are written: the staging directory first, then the run's store."""
        return [self.staging] + ([self.store] if self.store is not self.staging else [])

    # -- state of the run -------------------------------------------------------------------------
    def latest(self) -> dict[str, Any] | None:
        """The committed checkpoint pointer, or None when the run has no checkpoint yet."""
        if not self.store.exists(LATEST):
            return None
        return parse_latest(self.store.read(LATEST), f"{self.describe()}/{LATEST}")

    def read(self, name: str) -> bytes:
        """A file of the run (``name`` relative to it; checked, as names from markers are)."""
        return self.store.read(check_relative(name, what="run file"))

    def has_content(self) -> bool:
        return any(self.store.exists(n) for n in (LATEST, METRICS))

    def check_fresh(self, *, restart: bool, last_step: int) -> None:
        """Before anything is written: refuse a directory (or prefix) that holds files lingctl did not write,
        unless adopting it, and then refuse if a name this run will create is among them."""
        for place in self._places():
            place.open(adopt=self.adopt, resume=restart)
            place.check(RUN_FILES, steps=(0, last_step))

    def prepare_fresh(self) -> None:
        if self.remote_run:
            self.store.check()
            self.place.open(adopt=self.adopt, resume=False)
            self.place.remove_owned()  # a stale staging of an earlier run at this URL: only what lingctl wrote
        try:
            self.local.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, str(self.local)) from exc
        for place in self._places():
            place.open(adopt=self.adopt, resume=False)
            place.claim(RUN_FILES)  # the manifest is the first file written into a new run directory

    def claim_incident_files(self) -> None:
        """List incidents.jsonl and incidents/ as the run's before an incident is recorded (runs created before
        they existed get them listed on resume)."""
        for place in self._places():
            place.claim(INCIDENT_FILES)

    def claim_report_dir(self, name: str) -> None:
        """List the directory a reporter writes into (``tensorboard/``, ``wandb/``) as the run's before it does."""
        self.claim_files([name])

    def claim_files(self, names: list[str]) -> None:
        """List files of the run (a DPO run's reference log-probabilities) as its own before they are written."""
        for place in self._places():
            place.claim(names)

    def fetch_for_resume(self, latest: dict[str, Any], *, last_step: int, main: bool = True) -> None:
        """Bring the committed checkpoint, tokenizer and metrics into the local directory. ``main``: this
        process writes the run's own files (the other workers only read, or fill their node's staging)."""
        rel = latest["path"]
        own = [LATEST, METRICS]
        places = self._places() if main else ([self.place] if self.remote_run else [])
        for place in places:
            place.open(adopt=self.adopt, resume=True)
            place.check(own, steps=(latest["step"], last_step))
        if self.remote is not None and main:
            self.remote.claim(own)
        if not self.remote_run:
            if not join_under(self.local, rel).is_dir():
                raise NotFoundError(f"{LATEST} names {rel}, which is missing from {self.local}")
            if main:
                self.place.claim(own)
            return
        if self._local_copy_complete(rel):
            log.info("resuming from the local copy of %s in %s", rel, self.local)
            self.place.claim(own)
            return
        keys = [o.key for o in self.store.list(rel + "/")]
        if not keys:
            raise NotFoundError(f"{LATEST} names {rel}, which is missing from {self.describe()}")
        self.place.claim([rel, TOKENIZER, *own])  # refuses names in the staging directory that are not lingctl's
        self.place.release([rel])  # a partial copy: fetched again whole
        self.place.claim([rel])
        for key in keys + [k for k in (TOKENIZER, METRICS) if self.store.exists(k)]:
            self.store.download(key, join_under(self.local, key, what="store key"))
        state = self.local / rel / STATE_DIR
        if state.is_dir():
            problems = verify_local(state)
            if problems:
                raise LingctlError(f"{self.describe()}/{rel}/{STATE_DIR}: {problems[0]}")

    def _local_copy_complete(self, rel: str) -> bool:
        """The staged copy of checkpoint ``rel`` is whole: its pcache state verifies against its marker and
        the files uploaded after it are present with the sizes the store has."""
        ckpt = self.local / rel
        state = ckpt / STATE_DIR
        if not state.is_dir() or verify_local(state) or not (self.local / TOKENIZER).exists():
            return False
        for obj in self.store.list(rel + "/"):
            if obj.key.startswith(f"{rel}/{STATE_DIR}/"):
                continue
            path = join_under(self.local, obj.key, what="store key")
            if not path.is_file() or path.stat().st_size != obj.size:
                return False
        return True

    # -- writing ----------------------------------------------------------------------------------
    def claim_checkpoint(self, rel: str, *, main: bool = True) -> None:
        """List checkpoint ``rel`` as lingctl's before it is written; refuse if it exists and is not.
        ``main``: the process that writes the run's files; another node's first worker lists it only in its
        own staging directory (s3:// runs), where its share of the checkpoint lands."""
        places = self._places() if main else ([self.place] if self.remote_run else [])
        for place in places:
            place.claim([rel])

    def publish(self, relpaths: list[str]) -> None:
        """Upload files (in order) from the staging directory; a no-op for local runs."""
        if not self.remote_run:
            return
        for rel in relpaths:
            self.store.upload(rel, self.local / rel)

    def publish_checkpoint(self, step: int, rel: str, files: list[str]) -> None:
        """Make checkpoint ``rel`` durable and then current. Local runs: commit now. s3:// runs: upload
        ``state/`` in the background (pcache's uploader, marker last), then ``files`` in order, then commit;
        training goes on meanwhile, and ``latest.json`` moves only once everything is in the store."""
        if not self.remote_run:
            self.commit(step, rel)
            return
        if self._uploader is None:
            self._uploader = tier.Uploader()

        def durable(_: str) -> None:
            self.publish(files)
            self.commit(step, rel)

        self._uploader.submit(
            self.local / rel / STATE_DIR,
            str(self.url.join(f"{rel}/{STATE_DIR}")),
            self.s3,
            rank=None,
            finalize=True,
            on_durable=durable,
        )

    def wait_uploads(self) -> None:
        """Block until background checkpoint uploads are done; raise the first failure."""
        if self._uploader is not None:
            self._uploader.wait()

    def commit(self, step: int, path: str) -> None:
        """Make checkpoint ``path`` the one a resume starts from (after all its files are in place)."""
        data = json.dumps({"step": step, "path": path}).encode()
        for store in self._stores():
            store.write(LATEST, data)

    def prune(self, keep: int, current: str) -> None:
        """Delete all but the newest ``keep`` checkpoints this run's manifests list (never the current one,
        never one lingctl did not write). A failure is logged and tried again at the next checkpoint."""
        places = self._places()
        listed = sorted(
            {n for p in places if p.manifest is not None for n in p.manifest.entries if checkpoint_step(n) is not None}
        )
        doomed = [n for n in listed[:-keep] if n != current] if keep > 0 else []
        for place in places:
            if place.manifest is None:
                continue
            try:
                place.release(doomed)
            except LingctlError as exc:
                log.warning("could not remove an old checkpoint from %s: %s", place.where, exc)
