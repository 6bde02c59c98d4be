"""The output and errors files of ``flood run``, their manifest, and resuming an interrupted run.

Both files are in the OpenAI Batch output format, one JSON object per line, appended as each request
finishes. A line is flushed as soon as it is written, so a reader (or a crash) sees whole lines; fsync is
rationed to one every ``jsonl_file.FSYNC_EVERY_S`` and one at close, since per-line fsyncs would cost more
than short generations. A crash may leave a torn last line; a resumed run cuts it and appends after the last complete
line, so complete lines are never rewritten, reordered, lost or duplicated.

Every id in a line (the line's ``id``, the response's ``request_id``, the body's ``id``) is derived from the model
and the request, not drawn at random: the same batch on the same model gives the same file wherever it runs (this
machine or a cluster, in one go or resumed), and within a file each request's ids differ.

The manifest (``OUT.jsonl.manifest.json``) records what produced the output (model, settings, chat template,
batch file), and what lingctl has written to each file (``written``: bytes and sha256). A resumed run must
match the settings, otherwise one output would mix answers from two different runs, and the files must hold
what was written: a resume never writes into, or cuts, a file it cannot show is its own (``jsonl_file``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.atomic import TMP_MARKER, atomic_write, is_stale_tmp, tmp_prefix
from lingctl.core.errors import UsageError
from lingctl.flood.batch.jsonl_file import JsonlSink, Written, has_content, lstat_own, read_jsonl, read_own
from lingctl.flood.batch.requests import DUPLICATE_CUSTOM_ID

WRITTEN = "written"  # manifest key: role -> Written record of that file
OUTPUT, ERRORS = "output", "errors"  # roles of flood run's two files
# Manifest keys that differ between runs of the same job (timestamps, what was written so far); compared only
# when listed in manifest["compare"].
_UNCOMPARED_KEYS = frozenset({"created", "updated", WRITTEN})
_OVERWRITE_HINT = "pass --resume to continue it, or choose another -o"
_MISMATCH_HINT = "rerun with the settings of that run, or choose another -o"
_RESUME_HINT = "fix or remove that line, then resume"
# Manifest keys whose mismatch has a more specific next step than _MISMATCH_HINT.
_KEY_HINTS = {
    "chat_template_sha256": "the chat template differs: pass the --chat-template of that run (or none, "
    "for the model's own), or choose another -o"
}
_SHOW_CHARS = 40
_ABSENT = object()


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


class BatchOutput:
    """The two files of one run. Without ``resume`` it refuses to touch an earlier run's files; with it, it
    checks the manifest, reads what was answered into ``state`` and appends. One writer at a time.

    The manifest is rewritten whenever a file's ``Written`` record changes (see ``jsonl_file``)."""

    def __init__(self, out: Path, errors: Path, manifest: dict[str, Any], *, resume: bool) -> None:
        self.out = Path(out)
        self.errors = Path(errors)
        self.manifest_path = manifest_path(self.out)
        self.state = ResumeState()
        saved = earlier_run(self.out, self.errors, manifest, resume=resume)
        sweep_manifest_tmp(self.manifest_path)
        if saved is None:
            self._manifest = json.loads(json.dumps(manifest))
            self._save_manifest()
        else:
            self._manifest = saved
        # Both files exist from the start, so the user sees where the answers go.
        self._out = self._sink(self.out, OUTPUT, errors_file=False)
        try:
            self._errors = self._sink(self.errors, ERRORS, errors_file=True)
        except BaseException:
            self._out.close()
            raise

    def _sink(self, path: Path, role: str, *, errors_file: bool) -> JsonlSink:
        sink = JsonlSink.open(
            path,
            proof=proof_of(self._manifest, role),
            on_record=_collector(self.state, errors_file),
            valid=_valid,
            hint=_RESUME_HINT,
            on_sync=lambda written: self._record(role, written),
        )
        self.state.torn_bytes += sink.torn
        return sink

    def _record(self, role: str, written: Written) -> None:
        record_written(self.manifest_path, self._manifest, role, written)

    def _save_manifest(self) -> None:
        save_manifest(self.manifest_path, self._manifest)

    def answer_id(self, digest: str) -> str:
        """The hex part of the body ``id`` of the answer to the request ``digest`` (``answers.request_digest``)."""
        return derived_id(self._id_salt, "answer", digest, 24)

    @property
    def _id_salt(self) -> str:
        return str(self._manifest.get("model_fingerprint", ""))

    def write_result(self, custom_id: str, body: dict[str, Any], *, digest: str | None = None) -> None:
        """A finished request; ``body`` is the completion or chat completion object; ``digest``: the request's
        (``answers.request_digest``), from which the line's ids are derived (else from the custom_id)."""
        digest = digest if digest is not None else json.dumps([custom_id], ensure_ascii=True)
        self._out.write(
            {
                "id": "batch_req_" + derived_id(self._id_salt, "line", digest, 24),
                "custom_id": custom_id,
                "response": {
                    "status_code": 200,
                    "request_id": derived_id(self._id_salt, "request", digest, 32),
                    "body": body,
                },
                "error": None,
            }
        )

    def write_error(
        self,
        *,
        custom_id: str | None,
        line: int | None,
        code: str,
        message: str,
        status_code: int | None = 400,
        digest: str | None = None,
    ) -> None:
        """A failed request. ``line``: its batch-file line, for errors found reading the file.
        ``status_code`` None: the line could not be parsed into a request, so there is no response. ``digest``:
        the request's, when there is one; else the ids come from the line, custom_id and error."""
        key = digest if digest is not None else json.dumps([custom_id, line, code, message], ensure_ascii=True)
        response = None
        if status_code is not None:
            kind = "invalid_request_error" if status_code < 500 else "server_error"
            response = {
                "status_code": status_code,
                "request_id": derived_id(self._id_salt, "error-request", key, 32),
                "body": {"error": {"message": message, "type": kind, "code": code}},
            }
        self._errors.write(
            {
                "id": "batch_req_" + derived_id(self._id_salt, "error", key, 24),
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


def earlier_run(out: Path, errors: Path, manifest: dict[str, Any], *, resume: bool) -> dict[str, Any] | None:
    """The saved manifest of the earlier run a resume continues (checked against ``manifest``); None for a
    fresh start. Refuses an earlier run's files without ``resume``, and files with no manifest beside them."""
    path = manifest_path(out)
    for p in (out, errors):  # a link or a file that is not ours is refused before anything is created
        lstat_own(p, sole_link=True)
    if not resume:
        for p in (out, errors, path):
            if has_content(p):
                raise UsageError(f"{p} already exists and is not empty", hint=_OVERWRITE_HINT)
        return None
    if has_content(path):
        saved = read_manifest(path)
        check_manifest(saved, manifest, out)
        return saved
    if has_content(out) or has_content(errors):
        raise UsageError(
            f"{out} has no manifest ({path.name}), so nothing tells which run wrote it",
            hint="choose another -o, or move the old output away",
        )
    return None


def preview_resume(out: Path, errors: Path, manifest: dict[str, Any]) -> ResumeState:
    """What ``--resume`` would find answered, read with the same checks and without changing a byte (a torn
    last line is left for the real run to cut)."""
    state = ResumeState()
    saved = earlier_run(out, errors, manifest, resume=True)
    if saved is None:
        return state
    for path, role, on_record in ((out, OUTPUT, _collector(state, False)), (errors, ERRORS, _collector(state, True))):
        state.torn_bytes += read_jsonl(
            path,
            on_record,
            valid=_valid,
            hint=_RESUME_HINT,
            proof=proof_of(saved, role),
            require_proof=True,
            torn_is_damage=False,
        )
    return state


def read_manifest(path: Path) -> dict[str, Any]:
    """The JSON object saved at ``path``, read only when it is a regular file of this user (never through a
    link): UsageError otherwise."""
    data = read_own(path)
    if data is None:
        raise UsageError(f"{path} was removed while lingctl read it", hint="run the same command again")
    try:
        saved = json.loads(data)
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(saved, dict):
        raise UsageError(f"{path} is not a JSON object")
    return saved


def sweep_manifest_tmp(path: Path) -> None:
    """Remove the temporary files that killed writers of the manifest at ``path`` left beside it: only regular
    files of this user with exactly lingctl's temporary name for it, whose writer is dead. The manifest is
    rewritten while a run writes, so a kill can land inside one of its atomic writes."""
    prefix = tmp_prefix(path.name).split(TMP_MARKER)[0] + TMP_MARKER
    try:
        with os.scandir(path.parent) as entries:
            leftovers = [entry for entry in entries if entry.name.startswith(prefix)]
    except OSError:
        return  # housekeeping: never the reason a run fails
    for entry in leftovers:
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and is_stale_tmp(entry.name, st.st_mtime):
                os.unlink(entry.path)
        except OSError:
            continue


def save_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest whole; the rename replaces whatever was at ``path`` (a link is replaced, not followed)."""
    with atomic_write(path) as (_, f):
        f.write(json.dumps(manifest, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def record_written(path: Path, manifest: dict[str, Any], role: str, written: Written) -> None:
    """Set the ``Written`` record of the file ``role`` in ``manifest`` and save it at ``path``."""
    records = manifest.get(WRITTEN)
    if not isinstance(records, dict):  # none yet, or a saved one that is not a record
        records = manifest[WRITTEN] = {}
    records[role] = written.to_json()
    save_manifest(path, manifest)


def proof_of(manifest: dict[str, Any], role: str) -> Written | None:
    """The ``Written`` record of the file ``role`` in a saved manifest (None when it has none)."""
    written = manifest.get(WRITTEN)
    return Written.from_json(written.get(role)) if isinstance(written, dict) else None


def check_manifest(saved: dict[str, Any], manifest: dict[str, Any], out: Path) -> None:
    """UsageError unless the ``saved`` manifest (of the output ``out``) matches ``manifest`` on its ``compare``
    keys (all keys but timestamps and write records when it lists none)."""
    # Through JSON and back, so a tuple here equals the list that was saved.
    wanted = json.loads(json.dumps(manifest))
    keys = wanted.get("compare")
    if keys is None:
        keys = [k for k in {**wanted, **saved} if k not in _UNCOMPARED_KEYS]
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


def _valid(record: dict[str, Any]) -> bool:
    return isinstance(record.get("custom_id", _ABSENT), (str, type(None)))


def _collector(state: ResumeState, errors_file: bool) -> Callable[[dict[str, Any]], None]:
    return lambda record: _collect(record, state, errors_file=errors_file)


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


def derived_id(salt: str, what: str, key: str, hex_chars: int) -> str:
    """``hex_chars`` hex digits of sha256 over (``salt``, ``what``, ``key``): an id that a rerun reproduces."""
    data = "\0".join((salt, what, key)).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:hex_chars]


def _show(value: Any) -> str:
    text = "(absent)" if value is _ABSENT else json.dumps(value, ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: its JSON escape, so the message can be printed
            text = json.dumps(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 1] + "…"
