"""``flood run`` with ``s3://bucket/key`` for its batch, output and errors: the run works on local copies.

The output is an append-only file, flushed line by line and proved by its manifest (``output``,
``jsonl_file``); an object store has no append, so it cannot be written that way. Instead each ``s3://``
file has a staged copy in a private directory of lingctl's cache (``flood-staging/<hash>/<name>``, one
directory per URL), the run reads and writes those copies with the local code unchanged, and they go up
when the run ends, normally or not. A local path never goes through here.

- The batch is downloaded afresh for every run, and its copy removed after it.
- Without ``--resume`` an output, errors or manifest object that holds something is refused, as a local
  file is. With it, the staged copies of an interrupted run on this machine are used when they continue
  what the store holds (so a ``kill -9``, which uploads nothing, loses nothing); otherwise the objects
  (output, errors, and the manifest ``<out key>.manifest.json``) are downloaded first, and the usual resume
  checks read them.
- On the way out the output and errors go up, then the manifest, so the manifest in the store never claims
  more than the objects beside it hold. After a complete run the staged copies are removed; after an
  interruption or an error they are kept for the ``--resume`` that follows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import TypeGuard

from lingctl.core.cache import cache_dir
from lingctl.core.errors import LingctlError, NotFoundError, UsageError, os_error
from lingctl.core.private_dir import ensure_private_dir
from lingctl.core.storage import ObjectStore, S3Options, StoreURL, open_store, parse_url
from lingctl.flood.batch.jsonl_file import Written, has_content
from lingctl.flood.batch.output import ERRORS, OUTPUT, manifest_path, proof_of

log = logging.getLogger(__name__)

STAGING = "flood-staging"  # the cache subdirectory that holds the staged copies
_S3_SCHEME = re.compile(r"\s*s3a?://", re.IGNORECASE)  # the schemes storage.parse_url takes as s3


def is_s3(spec: str | None) -> TypeGuard[str]:
    """Whether ``spec`` is an ``s3://`` URL. Anything else is a local path, taken as it always was."""
    return spec is not None and _S3_SCHEME.match(spec) is not None


def stage_batch(spec: str, s3: S3Options | None = None) -> Path:
    """The local file to read the batch from: ``spec`` itself, or a fresh download of an ``s3://`` object."""
    if not is_s3(spec):
        return Path(spec)
    obj = _Object.of(spec, "BATCH", s3)
    obj.make_dir()
    try:
        obj.store.download(obj.key, obj.staged)
    except NotFoundError as exc:
        _rmdir(obj.staged.parent)
        raise NotFoundError(f"batch {obj.url}: no such object ({exc.message})", hint=exc.hint) from None
    except BaseException:
        _rmdir(obj.staged.parent)
        raise
    return obj.staged


class StagedOutputs:
    """The local files of a run whose batch, output or errors is an ``s3://`` URL (see the module docstring):
    ``batch``, ``out`` and ``errors`` are what ``FloodOptions`` takes. ``out``/``errors`` None: the names
    ``output.default_paths`` gives, in the store when the file they are beside is there. ``stdout``: the
    answers go to standard output (``-o -``), so only the errors are a file of this run. ``upload`` False
    (a dry run): nothing is refused, uploaded or removed but the batch's copy."""

    def __init__(
        self,
        batch: str,
        out: str | None,
        errors: str | None,
        *,
        resume: bool,
        upload: bool = True,
        stdout: bool = False,
        s3: S3Options | None = None,
    ) -> None:
        out, errors = _defaults(batch, None if stdout else out, errors)
        out = None if stdout else out
        _check_distinct(batch, out, errors)
        self._batch_spec, self._resume, self._upload, self._s3 = batch, resume, upload, s3
        self._out = _Object.of(out, "-o", s3) if is_s3(out) else None
        self._errors = _Object.of(errors, "--errors", s3) if is_s3(errors) else None
        self.batch = Path(batch)
        self.out = self._out.staged if self._out else (Path(out) if out is not None else None)
        self.errors = self._errors.staged if self._errors else (Path(errors) if errors is not None else None)
        # In upload order: the manifest last.
        self._objects = [o for o in (self._out, self._errors) if o is not None]
        if self._out is not None:
            self._objects.append(self._out.manifest())
        self._seen: dict[Path, tuple[int, int] | None] = {}  # how each staged file looked once staged

    def shown(self, path: str) -> str:
        """What to call ``path`` (a file of this run) in messages: its URL when it is a staged copy."""
        return next((str(o.url) for o in self._objects if str(o.staged) == path), path)

    def __enter__(self) -> StagedOutputs:
        if self._upload and not self._resume:
            for obj in self._objects:
                obj.refuse_earlier_run()
        self.batch = stage_batch(self._batch_spec, self._s3)
        try:
            for obj in self._objects:
                obj.make_dir()
            kept = self._resume and self._keep_staged()
            for obj in self._objects:
                if self._resume and not kept:
                    obj.fetch()
                # A kept copy may hold what a failed upload did not take: it goes up on the way out.
                self._seen[obj.staged] = None if kept else _look(obj.staged)
        except BaseException:
            self._tidy(complete=False)
            raise
        return self

    def _keep_staged(self) -> bool:
        """Whether the staged copies hold everything the store has of them: the store has no manifest, or each
        file its manifest records is a prefix of the staged file. A copy that does not (the run went on
        elsewhere, another run wrote there) is never uploaded over what is there."""
        if self._out is None:  # the manifest is local, and checks the staged errors file itself
            return self._errors is not None and has_content(self._errors.staged)
        manifest = self._out.manifest()
        if not has_content(manifest.staged):
            return False
        if manifest.store.head(manifest.key) is None:  # nothing was uploaded, unless someone else's output
            info = self._out.store.head(self._out.key)
            return info is None or info.size == 0
        try:
            remote = json.loads(manifest.store.read(manifest.key))
        except ValueError:
            return False  # downloaded, the resume checks say what is wrong with it
        staged = {OUTPUT: self._out.staged, ERRORS: self.errors}
        return isinstance(remote, dict) and all(_starts_with(staged[r], proof_of(remote, r)) for r in staged)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        complete = False  # complete and in the store: the staged copies have done their work
        try:
            if self._upload:
                for obj in self._objects:
                    if obj.staged.exists() and _look(obj.staged) != self._seen.get(obj.staged):
                        obj.upload()  # the first failure stops here: a manifest never goes up ahead of its files
                complete = exc is None
        finally:
            self._tidy(complete=complete)

    def _tidy(self, *, complete: bool) -> None:
        if is_s3(self._batch_spec):
            _unlink(self.batch)
            _rmdir(self.batch.parent)
        for obj in self._objects:
            if complete:
                _unlink(obj.staged)
            _rmdir(obj.staged.parent)


@dataclass(kw_only=True, slots=True)
class _Object:
    """One ``s3://`` object of the run and its staged copy."""

    url: StoreURL
    option: str  # the command-line name of the file, for messages
    store: ObjectStore
    staged: Path

    @staticmethod
    def of(spec: str, option: str, s3: S3Options | None) -> _Object:
        url = parse_url(spec)
        if not url.prefix:
            raise UsageError(f"{option} {spec} names a bucket, not an object", hint="write s3://bucket/key")
        # The endpoint is part of the name: one bucket and key on two servers are two objects.
        endpoint = (s3 or S3Options()).resolved_endpoint() or ""
        digest = hashlib.sha256(f"{endpoint}\0{url}".encode()).hexdigest()[:16]
        staged = cache_dir(STAGING) / digest / PurePosixPath(url.prefix).name
        return _Object(url=url, option=option, store=open_store(StoreURL("s3", url.bucket), s3), staged=staged)

    @property
    def key(self) -> str:
        return self.url.prefix

    def manifest(self) -> _Object:
        """The manifest of this output: beside it in the store and beside its staged copy, named as
        ``output.manifest_path`` names it."""
        name = manifest_path(self.staged).name
        url = StoreURL("s3", self.url.bucket, str(PurePosixPath(self.key).with_name(name)))
        return _Object(url=url, option=self.option, store=self.store, staged=self.staged.with_name(name))

    def make_dir(self) -> None:
        """The staged copy's directory: created 0700, or checked to be ours and private."""
        root = self.staged.parent.parent
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, str(root.parent)) from exc
        ensure_private_dir(root)
        ensure_private_dir(self.staged.parent)

    def refuse_earlier_run(self) -> None:
        """A fresh run overwrites neither an object that holds something nor a staged copy not yet uploaded."""
        info = self.store.head(self.key)
        if info is not None and info.size > 0:
            raise UsageError(
                f"{self.url} already exists and is not empty",
                hint=f"pass --resume to continue it, or choose another {self.option}",
            )
        if has_content(self.staged):
            raise UsageError(
                f"{self.url} has a staged copy of an unfinished run at {self.staged}",
                hint=f"pass --resume to continue and upload it, or remove {self.staged.parent}",
            )

    def fetch(self) -> None:
        """Make the staged copy what the store holds (nothing, when it holds nothing)."""
        if self.store.head(self.key) is not None:
            self.store.download(self.key, self.staged)
        else:
            _unlink(self.staged)

    def upload(self) -> None:
        try:
            self.store.upload(self.key, self.staged)
        except LingctlError as exc:
            raise type(exc)(
                f"could not upload {self.url}: {exc.message}",
                hint=f"the staged copy is kept at {self.staged}; the same command with --resume uploads it",
            ) from exc
        log.info("uploaded %s", self.url)


def _defaults(batch: str, out: str | None, errors: str | None) -> tuple[str | None, str | None]:
    """The default names of ``output.default_paths`` where they fall in the store (``b.jsonl`` ->
    ``b.output.jsonl`` and ``b.errors.jsonl``; ``-o x.jsonl`` -> ``x.errors.jsonl``); local ones are left to it."""
    if out is None and is_s3(batch):
        out = _renamed(batch, lambda stem: f"{stem}.output.jsonl")
    if errors is None and is_s3(out):
        errors = _renamed(out, lambda stem: f"{stem.removesuffix('.output')}.errors.jsonl")
    return out, errors


def _renamed(spec: str, name: Callable[[str], str]) -> str:
    url = parse_url(spec)
    key = PurePosixPath(url.prefix)
    return str(StoreURL("s3", url.bucket, str(key.with_name(name(key.stem)))))


def _check_distinct(batch: str, out: str | None, errors: str | None) -> None:
    """The checks of ``output.default_paths``, on URLs (staged copies of one URL would share one path)."""
    urls = {name: str(parse_url(s)) for name, s in (("BATCH", batch), ("-o", out), ("--errors", errors)) if is_s3(s)}
    if "-o" in urls and urls["-o"] == urls.get("--errors"):
        raise UsageError(
            f"the output and the errors file are the same object: {urls['-o']}", hint="choose another --errors"
        )
    for option in ("-o", "--errors"):
        if option in urls and urls[option] == urls.get("BATCH"):
            raise UsageError(f"{urls[option]} is the batch file itself", hint=f"choose another {option}")


def _starts_with(path: Path | None, proof: Written | None) -> bool:
    """Whether the file at ``path`` begins with the bytes ``proof`` records (no record: nothing to hold)."""
    if proof is None:
        return True
    if path is None:
        return False
    digest, left = hashlib.sha256(), proof.size
    try:
        with open(path, "rb") as f:
            while left > 0 and (block := f.read(min(left, 1 << 20))):
                digest.update(block)
                left -= len(block)
    except OSError:
        return False
    return left == 0 and digest.hexdigest() == proof.sha256


def _look(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise os_error(exc, str(path)) from exc


def _rmdir(path: Path) -> None:
    """Remove a staging directory once it is empty (one that is not is kept as it is)."""
    try:
        os.rmdir(path)
    except OSError:
        pass
