"""What lingctl may write and delete in one place of a run: a local directory, or a store prefix.

Each place carries its own manifest (``layout.Manifest``). ``open`` reads it, or decides whether lingctl may start
one there: in a missing or empty place, in a run of the previous lingctl version (``latest.json`` and no
manifest) when resuming it, or anywhere with ``adopt``; otherwise the place belongs
to somebody else and the run is refused before anything is written. ``claim`` lists names before they are
created and refuses a name that exists without being listed; ``release`` deletes a listed name, then
unlists it. A crash between the two steps leaves a listed name that is missing, never an unlisted one.
"""

from __future__ import annotations

import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

from lingctl.core.atomic import atomic_write, is_tmp_name
from lingctl.core.errors import NotFoundError, UsageError, os_error
from lingctl.core.names import join_under
from lingctl.core.storage import ObjectStore
from lingctl.runs.layout import CHECKPOINTS, LATEST, MANIFEST, METRICS, Manifest, checkpoint_step

log = logging.getLogger(__name__)


def written_by_lingctl(run: Path, name: str) -> bool:
    """Whether the manifest of the local run directory ``run`` lists ``name``: lingctl wrote it, and may
    overwrite it (a damaged manifest is refused, exit 4)."""
    try:
        raw = (run / MANIFEST).read_bytes()
    except OSError:
        return False
    return name in Manifest.parse(raw, str(run / MANIFEST)).entries


class OwnedPlace(ABC):
    """A place a run writes to, with the manifest of what lingctl created there."""

    def __init__(self, where: str, hint: str, conflict_hint: str) -> None:
        self.where = where  # for messages
        self.hint = hint  # what to do when the place holds files that are not lingctl's
        self.conflict_hint = conflict_hint  # ... and when a name lingctl needs is one of them
        self.manifest: Manifest | None = None
        self._saved = False  # whether the manifest exists in the place (not only in memory)

    # -- what each kind of place provides ------------------------------------------------------------
    @abstractmethod
    def _read_manifest(self) -> bytes | None: ...

    @abstractmethod
    def _write_manifest(self, data: bytes) -> None: ...

    @abstractmethod
    def is_empty(self) -> bool: ...

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def checkpoints(self) -> list[str]:
        """Names of the checkpoint directories present (listed or not)."""

    @abstractmethod
    def _remove(self, name: str) -> None: ...

    # -- the rules ------------------------------------------------------------------------------------
    def open(self, *, adopt: bool, resume: bool) -> None:
        """Read the manifest, or start one where lingctl may; refuse a place that holds other files."""
        if self.manifest is not None:
            return
        raw = self._read_manifest()
        if raw is not None:
            self.manifest = Manifest.parse(raw, f"{self.where}/{MANIFEST}")
            self._saved = True
        elif self.is_empty():
            self.manifest = Manifest()
        elif resume and self.exists(LATEST):
            # A checkpointed run of the lingctl version before manifests: its pointer and metrics are what a
            # resume rewrites; everything else in it (its checkpoints, its tokenizer) stays unlisted, so it
            # is never pruned.
            log.info("%s: a run without %s; from now on its own files are listed there", self.where, MANIFEST)
            self.manifest = Manifest()
            self.manifest.entries.update(n for n in (LATEST, METRICS) if self.exists(n))
        elif adopt:
            self.manifest = Manifest()
        else:
            raise UsageError(
                f"{self.where} is not empty and was not created by lingctl (it has no {MANIFEST}); "
                "refusing to write into it",
                hint=self.hint,
            )

    def _entries(self) -> set[str]:
        assert self.manifest is not None, "open() first"
        return self.manifest.entries

    def _refuse(self, name: str) -> UsageError:
        return UsageError(
            f"{self.where}/{name} exists and lingctl did not write it (it is not listed in "
            f"{MANIFEST}); refusing to overwrite it",
            hint=self.conflict_hint,
        )

    def check(self, names: Iterable[str], *, steps: tuple[int, int]) -> None:
        """Refuse now, before anything is written, if a name this run will create (``names``, or a
        checkpoint of a step in ``(steps[0], steps[1]]``: a stop can save at any step) belongs to someone else."""
        entries = self._entries()
        for name in names:
            if name not in entries and self.exists(name):
                raise self._refuse(name)
        first, last = steps
        for name in self.checkpoints():
            step = checkpoint_step(name)
            if name not in entries and step is not None and first < step <= last:
                raise self._refuse(name)

    def claim(self, names: Iterable[str]) -> None:
        """List ``names`` in the manifest (written before they are created); refuse one that exists unlisted."""
        entries = self._entries()
        new = [n for n in names if n not in entries]
        for name in new:
            if self.exists(name):
                raise self._refuse(name)
        if new or not self._saved:
            entries.update(new)
            self._save()

    def release(self, names: Iterable[str]) -> None:
        """Delete listed names (never anything else), then drop them from the manifest."""
        entries = self._entries()
        gone = [n for n in names if n in entries]
        for name in gone:
            self._remove(name)
        if gone:
            entries.difference_update(gone)
            self._save()

    def _save(self) -> None:
        assert self.manifest is not None
        self._write_manifest(self.manifest.to_bytes())
        self._saved = True


class LocalPlace(OwnedPlace):
    def __init__(self, root: Path, *, hint: str, conflict_hint: str = "move it away, or choose another --out") -> None:
        super().__init__(str(root), hint, conflict_hint)
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"{self.where} is a file, not a directory", hint="name a directory, or one to create")

    def _read_manifest(self) -> bytes | None:
        try:
            return (self.root / MANIFEST).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise os_error(exc, str(self.root / MANIFEST)) from exc

    def _write_manifest(self, data: bytes) -> None:
        with atomic_write(self.root / MANIFEST) as (_, f):
            f.write(data)

    def is_empty(self) -> bool:
        try:
            with os.scandir(self.root) as it:
                return all(is_tmp_name(e.name) for e in it)  # a user's file that merely holds the marker counts
        except FileNotFoundError:
            return True
        except OSError as exc:
            raise os_error(exc, str(self.root)) from exc

    def exists(self, name: str) -> bool:
        return os.path.lexists(join_under(self.root, name))

    def checkpoints(self) -> list[str]:
        try:
            with os.scandir(self.root / CHECKPOINTS) as it:
                names = [f"{CHECKPOINTS}/{e.name}" for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise os_error(exc, str(self.root / CHECKPOINTS)) from exc
        return sorted(n for n in names if checkpoint_step(n) is not None)

    def _remove(self, name: str) -> None:
        path = join_under(self.root, name)
        try:
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise os_error(exc, str(path)) from exc

    def remove_owned(self) -> None:
        """Delete everything the manifest lists (a staging directory starting over); keep the manifest."""
        self.release(sorted(self._entries()))


class StorePlace(OwnedPlace):
    def __init__(self, store: ObjectStore, *, hint: str) -> None:
        super().__init__(store.describe(), hint, "move it away, or choose another --out")
        self.store = store

    def _read_manifest(self) -> bytes | None:
        try:
            return self.store.read(MANIFEST)
        except NotFoundError:
            return None

    def _write_manifest(self, data: bytes) -> None:
        self.store.write(MANIFEST, data)

    def is_empty(self) -> bool:
        return next(iter(self.store.list("")), None) is None

    def exists(self, name: str) -> bool:
        return self.store.exists(name) or next(iter(self.store.list(name + "/")), None) is not None

    def checkpoints(self) -> list[str]:
        names = [o.key for o in self.store.list(CHECKPOINTS + "/", recursive=False) if o.is_dir]
        return sorted(n for n in names if checkpoint_step(n) is not None)

    def _remove(self, name: str) -> None:
        for obj in list(self.store.list(name + "/")):
            self.store.delete(obj.key)
        self.store.delete(name)
