"""Single-file sources: what ``babel copy SRC DST`` means when SRC names one file or one object.

SRC is a single object when it is a local path to a file, or an ``s3://bucket/key`` without a trailing
``/`` whose exact key exists (one HEAD, as rclone checks whether a remote path is a file); anything else is
a tree (a trailing ``/`` always means a prefix). Then, as rclone's ``copy`` and ``copyto``:

- DST ending in ``/``, an existing local directory, a bucket, or an S3 prefix that holds objects: the
  object goes *into* it under its own name;
- otherwise DST names the destination object itself (an existing file or object there is replaced).

The copy itself is an ordinary sync of one key between the two parent directories (``SyncOptions.objects``),
so it is verified, journaled and resumed like any tree copy, and it never deletes anything.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import Any

from lingctl.core.errors import NotFoundError, UsageError
from lingctl.core.names import printable
from lingctl.core.storage import S3Options, StoreURL, open_store, parse_url


@dataclass(frozen=True, slots=True)
class Plan:
    """The two roots of a copy and, for a single object, its key on each side."""

    src: StoreURL
    dst: StoreURL
    objects: dict[str, str] | None = None  # source key -> destination key; None: SRC is a tree

    @property
    def single(self) -> bool:
        return self.objects is not None


def _parent(url: StoreURL) -> tuple[StoreURL, str]:
    """(the root holding ``url``'s last segment, that segment)."""
    if url.is_s3:
        head, _, name = url.prefix.rpartition("/")
        return StoreURL("s3", url.bucket, head), name
    path = os.path.abspath(url.path)
    return StoreURL("file", prefix=os.path.dirname(path)), os.path.basename(path)


def _is_s3_object(url: StoreURL, s3: S3Options) -> bool:
    parent, name = _parent(url)
    try:
        open_store(parent, s3).stat(name)
    except NotFoundError:
        return False
    return True


def _holds_objects(url: StoreURL, s3: S3Options) -> bool:
    try:
        return next(iter(open_store(url, s3).list("")), None) is not None
    except NotFoundError:
        return False


def plan(src_text: str, dst_text: str, s3: S3Options) -> Plan:
    """How to copy SRC to DST: a tree, or one object and the key it takes at the destination."""
    src, dst = parse_url(src_text), parse_url(dst_text)
    into = dst_text.rstrip().endswith("/")
    if src.is_s3:
        single = bool(src.prefix) and not src_text.rstrip().endswith("/") and _is_s3_object(src, s3)
    else:
        single = os.path.isfile(src.path)
        if single and src_text.rstrip().endswith("/"):
            raise UsageError(
                f"{printable(src_text)} is a file, not a directory", hint="drop the trailing '/' to copy the file"
            )
    if not single:
        return Plan(src, dst)
    src_root, name = _parent(src)
    if dst.is_s3:
        into = into or not dst.prefix or (not _is_s3_object(dst, s3) and _holds_objects(dst, s3))
    else:
        into = into or os.path.isdir(dst.path)
    dst_root, dst_key = (dst, name) if into else _parent(dst)
    _refuse_same_object(src_root, name, dst_root, dst_key)
    return Plan(src_root, dst_root, {name: dst_key})


def _refuse_same_object(src_root: StoreURL, key: str, dst_root: StoreURL, dst_key: str) -> None:
    """A copy of an object onto itself would read what it is replacing."""
    if src_root.is_s3 != dst_root.is_s3:
        return
    if src_root.is_s3:
        same = (src_root.bucket, posixpath.join(src_root.prefix, key)) == (
            dst_root.bucket,
            posixpath.join(dst_root.prefix, dst_key),
        )
    else:
        a = os.path.realpath(os.path.join(src_root.path, key))
        same = a == os.path.realpath(os.path.join(dst_root.path, dst_key))
    if same:
        shown = printable(str(src_root.join(key)))
        raise UsageError(
            f"source and destination are the same file ({shown})", hint="give another destination name or directory"
        )


class RenamedKeys:
    """A side of a transfer seen under other key names: ``names`` maps the name a caller uses (the
    destination key) to the side's own key, so a copy of ``a.bin`` can land as ``b.bin``. Every method
    whose first argument is a key is forwarded with that key translated; the rest pass through. It passes
    ``isinstance`` checks as the side it wraps (``__class__``, as ``unittest.mock`` does), so code that
    branches on the kind of side treats it as that side."""

    def __init__(self, side: Any, names: dict[str, str]) -> None:
        self._side = side
        self._names = dict(names)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        return type(self._side)

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._side, attr)
        if not callable(value):
            return value
        names = self._names

        def call(*args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], str):
                args = (names.get(args[0], args[0]), *args[1:])
            if isinstance(kwargs.get("key"), str):
                kwargs["key"] = names.get(kwargs["key"], kwargs["key"])
            return value(*args, **kwargs)

        return call
