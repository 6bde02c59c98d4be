"""A training run's directory, on local disk or in an object store (``s3://bucket/prefix``).

Layout::

    tokenizer.json                 the run's tokenizer
    metrics.jsonl                  one JSON record per step / eval / spike / checkpoint
    checkpoints/step-00000050/     a complete Ling checkpoint (loadable by flood) + train_state.pt + train_config.json
    latest.json                    {"step": 50, "path": "checkpoints/step-00000050"}, written last

A checkpoint counts only once ``latest.json`` names it, and ``latest.json`` is replaced only after every
file of the checkpoint is written (and uploaded), so a crash mid-save leaves the previous checkpoint in
charge. The training state (model, optimizer, data position) is a pcache DCP checkpoint in ``state/``.

For ``s3://`` runs the local directory is pcache's flash tier (``--cache-dir``): a checkpoint is written
there at local-disk speed, training continues, and pcache's uploader copies ``state/`` to the store in the
background (its commit marker last), then the other files, then ``latest.json``. A resume reads the local
copy when it is complete and verifies, and downloads otherwise. The store has no append, so
``metrics.jsonl`` is re-uploaded whole at each checkpoint and at the end of the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.core.storage import ObjectStore, S3Options, StoreURL, open_store, parse_url
from lingctl.pcache import tier

log = logging.getLogger(__name__)

LATEST = "latest.json"
METRICS = "metrics.jsonl"
TOKENIZER = "tokenizer.json"
CHECKPOINTS = "checkpoints"
STATE_DIR = "state"  # the pcache (DCP) checkpoint inside each checkpoint directory


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS}/step-{step:08d}"


def staging_dir(url: StoreURL, cache_dir: Path | None = None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("LINGCTL_CACHE_DIR") or Path.home() / ".cache" / "lingctl") / "runs"
    return base / hashlib.sha256(str(url).encode()).hexdigest()[:16]


class RunDir:
    def __init__(self, url: str, s3: S3Options | None = None, *, cache_dir: Path | None = None) -> None:
        self.url = parse_url(url)
        self.s3 = s3 or S3Options()
        self.store: ObjectStore | None = open_store(self.url, s3) if self.url.is_s3 else None
        self.local = staging_dir(self.url, cache_dir) if self.store is not None else self.url.path
        self._uploader: tier.Uploader | None = None

    def describe(self) -> str:
        return str(self.url) if self.store is not None else str(self.local)

    # -- state of the run -------------------------------------------------------------------------
    def latest(self) -> dict[str, Any] | None:
        """The committed checkpoint pointer, or None when the run has no checkpoint yet."""
        if self.store is not None:
            if not self.store.exists(LATEST):
                return None
            raw = self.store.read(LATEST)
        else:
            path = self.local / LATEST
            if not path.exists():
                return None
            raw = path.read_bytes()
        try:
            data = json.loads(raw)
            int(data["step"]), str(data["path"])
        except (ValueError, KeyError, TypeError):
            raise LingctlError(f"{self.describe()}/{LATEST} is damaged",
                               hint="point it at a complete checkpoints/step-* directory") from None
        return data

    def has_content(self) -> bool:
        names = (LATEST, METRICS)
        if self.store is not None:
            return any(self.store.exists(n) for n in names)
        return any((self.local / n).exists() for n in names)

    def prepare_fresh(self) -> None:
        if self.store is not None:
            self.store.check()
            shutil.rmtree(self.local, ignore_errors=True)  # stale staging of an earlier run at this URL
        self.local.mkdir(parents=True, exist_ok=True)

    def fetch_for_resume(self, latest: dict[str, Any]) -> None:
        """Bring the committed checkpoint, tokenizer and metrics into the local directory."""
        if self.store is None:
            if not (self.local / latest["path"]).is_dir():
                raise NotFoundError(f"{LATEST} names {latest['path']}, which is missing from {self.local}")
            return
        if self._local_copy_complete(latest["path"]):
            log.info("resuming from the local copy of %s in %s", latest["path"], self.local)
            return
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True, exist_ok=True)
        keys = [o.key for o in self.store.list(latest["path"].rstrip("/") + "/")]
        if not keys:
            raise NotFoundError(f"{LATEST} names {latest['path']}, which is missing from {self.describe()}")
        for key in keys + [k for k in (TOKENIZER, METRICS) if self.store.exists(k)]:
            self.store.download(key, self.local / key)
        state = self.local / latest["path"] / STATE_DIR
        if state.is_dir():
            problems = tier.verify_local(state)
            if problems:
                raise LingctlError(f"{self.describe()}/{latest['path']}/{STATE_DIR}: {problems[0]}")

    def _local_copy_complete(self, rel: str) -> bool:
        """The staged copy of checkpoint ``rel`` is whole: its pcache state verifies against its marker and
        the files uploaded after it are present with the sizes the store has."""
        ckpt = self.local / rel
        state = ckpt / STATE_DIR
        if not state.is_dir() or tier.verify_local(state) or not (self.local / TOKENIZER).exists():
            return False
        assert self.store is not None
        for obj in self.store.list(rel.rstrip("/") + "/"):
            if obj.key.startswith(f"{rel}/{STATE_DIR}/"):
                continue
            path = self.local / obj.key
            if not path.is_file() or path.stat().st_size != obj.size:
                return False
        return True

    # -- writing ----------------------------------------------------------------------------------
    def publish(self, relpaths: list[str]) -> None:
        """Upload files (in order) from the staging directory; a no-op for local runs."""
        if self.store is None:
            return
        for rel in relpaths:
            self.store.upload(rel, self.local / rel)

    def publish_checkpoint(self, step: int, rel: str, files: list[str]) -> None:
        """Make checkpoint ``rel`` durable and then current. Local runs: commit now. s3:// runs: upload
        ``state/`` in the background (pcache's uploader, marker last), then ``files`` in order, then commit;
        training goes on meanwhile, and ``latest.json`` moves only once everything is in the store."""
        if self.store is None:
            self.commit(step, rel)
            return
        if self._uploader is None:
            self._uploader = tier.Uploader()

        def durable(_: str) -> None:
            self.publish(files)
            self.commit(step, rel)

        self._uploader.submit(self.local / rel / STATE_DIR, str(self.url.join(f"{rel}/{STATE_DIR}")), self.s3,
                              rank=None, finalize=True, on_durable=durable)

    def wait_uploads(self) -> None:
        """Block until background checkpoint uploads are done; raise the first failure."""
        if self._uploader is not None:
            self._uploader.wait()

    def commit(self, step: int, path: str) -> None:
        """Make checkpoint ``path`` the one a resume starts from (after all its files are in place)."""
        data = json.dumps({"step": step, "path": path}).encode()
        with atomic_write(self.local / LATEST) as (_, f):
            f.write(data)
        if self.store is not None:
            self.store.write(LATEST, data)

    def prune(self, keep: int, current: str) -> None:
        """Delete all but the newest ``keep`` checkpoints (never the current one)."""
        local_dirs = sorted(p.name for p in (self.local / CHECKPOINTS).glob("step-*") if p.is_dir())
        names = local_dirs
        if self.store is not None:
            remote = {o.key.split("/")[1] for o in self.store.list(CHECKPOINTS + "/") if o.key.count("/") >= 2}
            names = sorted(set(local_dirs) | remote)
        for name in names[:-keep] if keep > 0 else []:
            rel = f"{CHECKPOINTS}/{name}"
            if rel == current:
                continue
            shutil.rmtree(self.local / rel, ignore_errors=True)
            if self.store is not None:
                for obj in list(self.store.list(rel + "/")):
                    self.store.delete(obj.key)
