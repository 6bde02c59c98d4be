"""The output and errors files of ``flood run``, their manifest, and resuming an interrupted run.

Both files are in the OpenAI Batch output format, one JSON object per line, appended as each request
finishes. A line is flushed as soon as it is written, so a reader (or a crash) sees whole lines; fsync is
rationed to one every ``FSYNC_EVERY_S`` and one at close, since per-line fsyncs would cost more than short
generations. A crash may leave a torn last line; a resumed run cuts it and appends after the last complete
line, so complete lines are never rewritten, reordered, lost or duplicated.

The manifest (``OUT.jsonl.manifest.json``) records what produced the output (model, settings, chat template,
batch file). A resumed run must match it, otherwise one output would mix answers from two different runs.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import UsageError, VerificationError, os_error
from lingctl.flood.requests import DUPLICATE_CUSTOM_ID

log = logging.getLogger("lingctl.flood.batch_output")

FSYNC_EVERY_S = 2.0
# Manifest keys that differ between runs of the same job; compared only when listed in manifest["compare"].
_TIMESTAMP_KEYS = frozenset({"created", "updated"})
_OVERWRITE_HINT = "pass --resume to continue it, or choose another -o"
_MISMATCH_HINT = "rerun with the settings of that run, or choose another -o"
# Manifest keys whose mismatch has a more specific next step than _MISMATCH_HINT.
_KEY_HINTS = {
    "chat_template_sha256": "the chat template differs: pass the --chat-template of that run (or none, "
    "for the model's own), or choose another -o"
}
_SHOW_CHARS = 40
_ABSENT = object()
_BLANK: dict[str, Any] = {}  # the record of a blank line: kept, answers nothing


@dataclass(kw_only=True, slots=True)
class ResumeState:
    """What an earlier run already wrote. A ``Request`` is answered when its custom_id is in ``done``; a
    ``RequestError`` from the batch file is reported when its line is in ``error_lines``."""

    done: set[str] = field(default_factory=set)  # custom_ids answered in the output or errors file
    error_lines: set[int] = field(default_factory=set)  # batch-file lines reported in the errors file
    torn_bytes: int = 0  # bytes cut from torn last lines


def manifest_path(out: Path) -> Path:
    """``OUT.jsonl`` -> ``OUT.jsonl.manifest.json``, beside it."""
    out = Path(out)
    return out.with_name(out.name + ".manifest.json")


def default_paths(batch: Path, out: Path | None, errors: Path | None) -> tuple[Path, Path]:
    """``b.jsonl`` -> ``b.output.jsonl`` and ``b.errors.jsonl``; an explicit ``x.jsonl`` -> ``x.errors.jsonl``."""
    batch = Path(batch)
    out = Path(out) if out is not None else batch.with_name(f"{batch.stem}.output.jsonl")
    if errors is None:
        errors = out.with_name(f"{out.stem.removesuffix('.output')}.errors.jsonl")
    errors = Path(errors)
    if out.resolve() == errors.resolve():
        raise UsageError(f"the output and the errors file are the same file: {out}", hint="choose another --errors")
    for path, option in ((out, "-o"), (errors, "--errors")):
        if path.resolve() == batch.resolve():
            raise UsageError(f"{path} is the batch file itself", hint=f"choose another {option}")
    return out, errors


class JsonlSink:
    """One append-only JSONL file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "ab")
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        self._synced = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        data = _dumps(record)
        try:
            self._f.write(data)
            self._f.flush()
            now = time.monotonic()
            if now - self._synced >= FSYNC_EVERY_S:
                os.fsync(self._f.fileno())
                self._synced = now
        except OSError as exc:
            raise os_error(exc, str(self.path)) from exc

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as exc:
            raise os_error(exc, str(self.path)) from exc
        finally:
            self._f.close()


class BatchOutput:
    """The two files of one run. Without ``resume`` it refuses to touch an earlier run's files; with it, it
    checks the manifest, reads what was answered into ``state`` and appends. One writer at a time."""

    def __init__(self, out: Path, errors: Path, manifest: dict[str, Any], *, resume: bool) -> None:
        self.out = Path(out)
        self.errors = Path(errors)
        self.manifest_path = manifest_path(self.out)
        self.state = ResumeState()
        if not resume:
            for path in (self.out, self.errors, self.manifest_path):
                if has_content(path):
                    raise UsageError(f"{path} already exists and is not empty", hint=_OVERWRITE_HINT)
        if resume and has_content(self.manifest_path):
            self._check_manifest(manifest)
            _scan(self.out, self.state, errors_file=False)
            _scan(self.errors, self.state, errors_file=True)
        elif resume and (has_content(self.out) or has_content(self.errors)):
            raise UsageError(
                f"{self.out} has no manifest ({self.manifest_path.name}), so nothing tells which run wrote it",
                hint="choose another -o, or move the old output away",
            )
        else:
            with atomic_write(self.manifest_path) as (_, f):
                f.write(json.dumps(manifest, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")
        # Both files exist from the start, so the user sees where the answers go.
        self._out = JsonlSink(self.out)
        try:
            self._errors = JsonlSink(self.errors)
        except BaseException:
            self._out.close()
            raise

    def write_result(self, custom_id: str, body: dict[str, Any]) -> None:
        """A finished request; ``body`` is the completion or chat completion object."""
        self._out.write(
            {
                "id": _new_id(),
                "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": secrets.token_hex(16), "body": body},
                "error": None,
            }
        )

    def write_error(
        self, *, custom_id: str | None, line: int | None, code: str, message: str, status_code: int | None = 400
    ) -> None:
        """A failed request. ``line``: its batch-file line, for errors found reading the file.
        ``status_code`` None: the line could not be parsed into a request, so there is no response."""
        response = None
        if status_code is not None:
            kind = "invalid_request_error" if status_code < 500 else "server_error"
            response = {
                "status_code": status_code,
                "request_id": secrets.token_hex(16),
                "body": {"error": {"message": message, "type": kind, "code": code}},
            }
        self._errors.write(
            {
                "id": _new_id(),
                "custom_id": custom_id,
                "response": response,
                "error": {"code": code, "message": message, "line": line},
            }
        )

    def close(self) -> None:
        try:
            self._out.close()
        finally:
            self._errors.close()

    def __enter__(self) -> BatchOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_manifest(self, manifest: dict[str, Any]) -> None:
        check_manifest(self.manifest_path, manifest, self.out)


def check_manifest(path: Path, manifest: dict[str, Any], out: Path) -> None:
    """UsageError unless the manifest saved at ``path`` (of the output ``out``) matches ``manifest`` on its
    ``compare`` keys (all keys but timestamps when it lists none)."""
    try:
        saved = json.loads(path.read_bytes())
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(saved, dict):
        raise UsageError(f"{path} is not a JSON object")
    # Through JSON and back, so a tuple here equals the list that was saved.
    wanted = json.loads(json.dumps(manifest))
    keys = wanted.get("compare")
    if keys is None:
        keys = [k for k in {**wanted, **saved} if k not in _TIMESTAMP_KEYS]
    for key in keys:
        before, now = saved.get(key, _ABSENT), wanted.get(key, _ABSENT)
        if before is _ABSENT and now is not _ABSENT:
            # Written by an older lingctl that did not record it: nothing shows this run matches.
            raise UsageError(
                f"{out} was written without {key} in its manifest, so this run cannot check that it matches",
                hint="choose another -o",
            )
        if before != now:
            raise UsageError(
                f"{out} was written with {key}={_show(before)}, this run has {_show(now)}",
                hint=_KEY_HINTS.get(key, _MISMATCH_HINT),
            )


def _scan(path: Path, state: ResumeState, *, errors_file: bool) -> None:
    """Add what ``path`` answers to ``state``; cut a torn last line (a crash mid-write)."""
    state.torn_bytes += scan_jsonl(
        path,
        lambda record: _collect(record, state, errors_file=errors_file),
        valid=lambda record: isinstance(record.get("custom_id", _ABSENT), (str, type(None))),
        hint="fix or remove that line, then resume",
    )


def scan_jsonl(
    path: Path,
    on_record: Callable[[dict[str, Any]], None],
    *,
    valid: Callable[[dict[str, Any]], bool] = lambda record: True,
    hint: str,
) -> int:
    """Pass every complete record of an append-only JSONL file to ``on_record``, and cut a torn last line (a
    crash mid-write): the bytes cut. A bad line before the last is damage, not a crash: VerificationError."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    with f:
        good_end = end = 0  # offsets past the last complete record and past the last byte
        bad_line = 0  # number of an unreadable line; fatal unless it is the last one
        for number, raw in enumerate(f, start=1):
            if bad_line:
                raise VerificationError(
                    f"{path}: line {bad_line} is not a complete JSON record, so the requests it answered are unknown",
                    hint=hint,
                )
            end += len(raw)
            record = _record(raw)
            if record is None or (record is not _BLANK and not valid(record)):
                bad_line = number
                continue
            good_end = end
            if record is not _BLANK:
                on_record(record)
        if end > good_end:
            try:
                f.truncate(good_end)
                os.fsync(f.fileno())
            except OSError as exc:
                raise os_error(exc, str(path)) from exc
            log.warning("%s: cut %d bytes of a torn last line", path, end - good_end)
        return end - good_end


def _record(raw: bytes) -> dict[str, Any] | None:
    """A complete line's record, ``_BLANK`` for a blank line, None for a torn or unreadable one."""
    if not raw.endswith(b"\n"):
        return None  # every record is written with its newline in one write: no newline, not finished
    if raw.isspace():
        return _BLANK
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _collect(record: dict[str, Any], state: ResumeState, *, errors_file: bool) -> None:
    cid = record["custom_id"]
    error = record.get("error") if errors_file else None
    error = error if isinstance(error, dict) else {}
    line = error.get("line")
    if isinstance(line, int) and not isinstance(line, bool):
        state.error_lines.add(line)
    # A duplicate's custom_id belongs to the earlier line, which may not have been answered yet.
    if isinstance(cid, str) and error.get("code") != DUPLICATE_CUSTOM_ID:
        state.done.add(cid)


def has_content(path: Path) -> bool:
    """The file exists and is not empty."""
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise os_error(exc, str(path)) from exc


def _new_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


def _dumps(record: dict[str, Any]) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (a custom_id written as "\ud800" in the batch) has no UTF-8 form; escapes do.
        return (json.dumps(record) + "\n").encode("ascii")


def _show(value: Any) -> str:
    text = "(absent)" if value is _ABSENT else json.dumps(value, ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: its JSON escape, so the message can be printed
            text = json.dumps(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 1] + "…"
