from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from lingctl.core.errors import UsageError, VerificationError
from lingctl.flood.batch.output import BatchOutput, default_paths, manifest_path
from lingctl.flood.batch.requests import DUPLICATE_CUSTOM_ID

MANIFEST = {"model_sha": "abc123", "batch_sha": "f00d", "max_batch": 64, "created": "2025-01-01T00:00:00Z"}
BODY = {"object": "text_completion", "choices": [{"index": 0, "text": "héllo", "finish_reason": "stop"}]}


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def _open(tmp_path: Path, manifest: dict[str, Any] | None = None, *, resume: bool = False) -> BatchOutput:
    return BatchOutput(tmp_path / "b.output.jsonl", tmp_path / "b.errors.jsonl", manifest or MANIFEST, resume=resume)


def _first_run(tmp_path: Path) -> BatchOutput:
    with _open(tmp_path) as out:
        out.write_result("r1", BODY)
        out.write_result("r2", BODY)
        out.write_error(custom_id=None, line=3, code="invalid_json", message="not valid JSON", status_code=None)
        out.write_error(custom_id="r4", line=4, code="invalid_request", message="n=2: only n=1 is supported")
        out.write_error(custom_id="r1", line=5, code=DUPLICATE_CUSTOM_ID, message="custom_id is used")
        out.write_error(custom_id="r6", line=None, code="generation_failed", message="boom", status_code=500)
    return out


# --- paths ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "out", "errors", "expected"),
    [
        ("data/b.jsonl", None, None, ("data/b.output.jsonl", "data/b.errors.jsonl")),
        ("data/b.jsonl", "runs/b.output.jsonl", None, ("runs/b.output.jsonl", "runs/b.errors.jsonl")),
        ("data/b.jsonl", "x.jsonl", None, ("x.jsonl", "x.errors.jsonl")),
        ("data/b.jsonl", "x.jsonl", "e/err.jsonl", ("x.jsonl", "e/err.jsonl")),
    ],
)
def test_default_paths(
    tmp_path: Path, batch: str, out: str | None, errors: str | None, expected: tuple[str, str]
) -> None:
    def p(name: str | None) -> Path | None:
        return None if name is None else tmp_path / name

    assert default_paths(tmp_path / batch, p(out), p(errors)) == (tmp_path / expected[0], tmp_path / expected[1])


def test_paths_must_differ(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="same file"):
        default_paths(tmp_path / "b.jsonl", tmp_path / "o.jsonl", tmp_path / "o.jsonl")
    with pytest.raises(UsageError, match="is the batch file itself"):
        default_paths(tmp_path / "b.jsonl", tmp_path / "b.jsonl", None)


def test_manifest_path_is_a_sibling() -> None:
    assert manifest_path(Path("runs/b.output.jsonl")) == Path("runs/b.output.jsonl.manifest.json")


# --- writing ----------------------------------------------------------------------------------------------


def test_start_creates_both_files_and_the_manifest(tmp_path: Path) -> None:
    out = BatchOutput(tmp_path / "runs/o.jsonl", tmp_path / "errs/e.jsonl", MANIFEST, resume=False)
    assert (tmp_path / "runs/o.jsonl").read_bytes() == b""
    assert (tmp_path / "errs/e.jsonl").read_bytes() == b""
    assert json.loads((tmp_path / "runs/o.jsonl.manifest.json").read_text()) == MANIFEST
    assert out.state.done == set() and out.state.error_lines == set() and out.state.torn_bytes == 0
    out.close()
    out.close()  # closing twice is harmless


def test_line_formats(tmp_path: Path) -> None:
    _first_run(tmp_path)
    results = _records(tmp_path / "b.output.jsonl")
    errors = _records(tmp_path / "b.errors.jsonl")
    assert [r["custom_id"] for r in results] == ["r1", "r2"]
    for r in results:
        assert r["response"]["status_code"] == 200 and r["response"]["body"] == BODY and r["error"] is None
        assert re.fullmatch(r"[0-9a-f]{32}", r["response"]["request_id"])
    unparsed, rejected, duplicate, failed = errors
    assert unparsed["custom_id"] is None and unparsed["response"] is None
    assert unparsed["error"] == {"code": "invalid_json", "message": "not valid JSON", "line": 3}
    assert rejected["response"]["status_code"] == 400
    assert rejected["response"]["body"]["error"] == {
        "message": "n=2: only n=1 is supported",
        "type": "invalid_request_error",
        "code": "invalid_request",
    }
    assert rejected["error"] == {"code": "invalid_request", "message": "n=2: only n=1 is supported", "line": 4}
    assert duplicate["error"]["code"] == DUPLICATE_CUSTOM_ID
    assert failed["response"]["status_code"] == 500 and failed["error"]["line"] is None
    assert failed["response"]["body"]["error"]["type"] == "server_error"
    ids = [r["id"] for r in results + errors]
    assert all(re.fullmatch(r"batch_req_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)
    assert "héllo" in (tmp_path / "b.output.jsonl").read_text(encoding="utf-8")


def test_a_custom_id_with_a_lone_surrogate_stays_valid_json(tmp_path: Path) -> None:
    with _open(tmp_path) as out:
        out.write_result("bad\ud800id", BODY)
    assert _records(tmp_path / "b.output.jsonl")[0]["custom_id"] == "bad\ud800id"
    with _open(tmp_path, resume=True) as out:
        assert out.state.done == {"bad\ud800id"}


def test_error_records_with_lone_surrogates_and_raw_surrogate_bytes_resume(tmp_path: Path) -> None:
    """Nothing a record can hold stops writing or resuming: a lone surrogate in an error message, and a line
    whose custom_id is a surrogate in raw (CESU-style) bytes, as another writer could leave it after lingctl's
    own lines."""
    with _open(tmp_path) as out:
        out.write_result("r1", BODY)
        out.write_error(custom_id="e\udfff", line=2, code="invalid_request", message="bad \ud800 text")
    assert _records(tmp_path / "b.errors.jsonl")[0]["error"]["message"] == "bad \ud800 text"
    with open(tmp_path / "b.output.jsonl", "ab") as f:
        f.write(b'{"id": "batch_req_raw", "custom_id": "raw\xed\xa0\x80", "response": null, "error": null}\n')
    with _open(tmp_path, resume=True) as out:
        assert out.state.done == {"r1", "e\udfff", "raw\ud800"} and out.state.error_lines == {2}
        out.write_result("next", BODY)
    assert _records(tmp_path / "b.output.jsonl")[-1]["custom_id"] == "next"


@pytest.mark.parametrize("name", ["b.output.jsonl", "b.errors.jsonl", "b.output.jsonl.manifest.json"])
def test_refuses_to_overwrite(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("{}\n")
    with pytest.raises(UsageError, match="already exists and is not empty") as info:
        _open(tmp_path)
    assert info.value.hint == "pass --resume to continue it, or choose another -o"
    assert (tmp_path / name).read_text() == "{}\n"


def test_empty_leftovers_are_not_an_earlier_run(tmp_path: Path) -> None:
    (tmp_path / "b.output.jsonl").touch()
    (tmp_path / "b.errors.jsonl").touch()
    _open(tmp_path).close()


# --- resume -----------------------------------------------------------------------------------------------


def test_resume_collects_what_was_answered(tmp_path: Path) -> None:
    _first_run(tmp_path)
    with _open(tmp_path, resume=True) as out:
        state = out.state
    # r1 is answered in the output; its duplicate on line 5 does not make it answered, but its line is reported.
    assert state.done == {"r1", "r2", "r4", "r6"}
    assert state.error_lines == {3, 4, 5}
    assert state.torn_bytes == 0


def test_resume_appends_and_keeps_every_byte(tmp_path: Path) -> None:
    _first_run(tmp_path)
    before = (tmp_path / "b.output.jsonl").read_bytes(), (tmp_path / "b.errors.jsonl").read_bytes()
    manifest_before = (tmp_path / "b.output.jsonl.manifest.json").read_bytes()
    later = MANIFEST | {"created": "2025-02-02T00:00:00Z"}  # a timestamp is not a setting
    with _open(tmp_path, later, resume=True) as out:
        out.write_result("r7", BODY)
        out.write_error(custom_id="r8", line=None, code="generation_failed", message="boom", status_code=500)
    after = (tmp_path / "b.output.jsonl").read_bytes(), (tmp_path / "b.errors.jsonl").read_bytes()
    assert after[0].startswith(before[0]) and after[1].startswith(before[1])
    assert [r["custom_id"] for r in _records(tmp_path / "b.output.jsonl")] == ["r1", "r2", "r7"]
    assert _records(tmp_path / "b.errors.jsonl")[-1]["custom_id"] == "r8"
    # The settings stay those of the first run; only the record of what was written grows.
    manifest_after = json.loads((tmp_path / "b.output.jsonl.manifest.json").read_bytes())
    written = manifest_after.pop("written")
    assert manifest_after == {k: v for k, v in json.loads(manifest_before).items() if k != "written"}
    assert written["output"] == {"bytes": len(after[0]), "sha256": hashlib.sha256(after[0]).hexdigest()}
    assert written["errors"] == {"bytes": len(after[1]), "sha256": hashlib.sha256(after[1]).hexdigest()}


@pytest.mark.parametrize(
    "torn",
    [
        b'{"id": "batch_req_1", "custom_id": "r9", "resp',  # cut mid-line
        b'{"id": "batch_req_1", "custom_id": "r9", "response": null, "error": null}',  # whole record, newline missing
        b"\x00\x00\x00\x00\n",  # a block the file system zero-filled
    ],
)
@pytest.mark.parametrize("name", ["b.output.jsonl", "b.errors.jsonl"])
def test_torn_last_line_is_cut_and_nothing_else_changes(tmp_path: Path, torn: bytes, name: str) -> None:
    _first_run(tmp_path)
    path = tmp_path / name
    complete = path.read_bytes()
    path.write_bytes(complete + torn)
    out = _open(tmp_path, resume=True)
    assert out.state.torn_bytes == len(torn)
    assert path.read_bytes() == complete
    assert "r9" not in out.state.done
    out.write_result("r9", BODY)
    out.write_error(custom_id="r10", line=None, code="generation_failed", message="boom")
    out.close()
    assert path.read_bytes().startswith(complete)
    assert all(isinstance(r, dict) for r in _records(path))


def test_a_broken_line_before_the_end_stops_the_resume(tmp_path: Path) -> None:
    _first_run(tmp_path)
    path = tmp_path / "b.output.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    original = b"".join([lines[0], b"garbage\n", *lines[1:]])
    path.write_bytes(original)
    with pytest.raises(VerificationError, match="line 2 is not a complete JSON record"):
        _open(tmp_path, resume=True)
    assert path.read_bytes() == original


def test_blank_lines_are_kept(tmp_path: Path) -> None:
    _first_run(tmp_path)
    path = tmp_path / "b.output.jsonl"
    path.write_bytes(path.read_bytes() + b"\n")
    out = _open(tmp_path, resume=True)
    out.close()
    assert out.state.torn_bytes == 0 and path.read_bytes().endswith(b"\n\n")


def test_manifest_mismatch_names_the_key_and_both_values(tmp_path: Path) -> None:
    _first_run(tmp_path)
    with pytest.raises(UsageError) as info:
        _open(tmp_path, MANIFEST | {"model_sha": "def456"}, resume=True)
    message = str(info.value)
    assert "model_sha" in message and "abc123" in message and "def456" in message and "\n" not in message
    with pytest.raises(UsageError, match=r"max_batch=64, this run has \(absent\)"):
        _open(tmp_path, {k: v for k, v in MANIFEST.items() if k != "max_batch"}, resume=True)


def test_a_compared_key_the_old_manifest_lacks_is_refused(tmp_path: Path) -> None:
    """An output written before the manifest recorded the chat template: nothing shows the template matches."""
    manifest = MANIFEST | {"compare": ["model_sha"]}
    _open(tmp_path, manifest).close()
    newer = MANIFEST | {"chat_template_sha256": "5ee", "compare": ["model_sha", "chat_template_sha256"]}
    with pytest.raises(UsageError, match="written without chat_template_sha256 in its manifest"):
        _open(tmp_path, newer, resume=True)
    with pytest.raises(UsageError, match=r'chat_template_sha256="5ee", this run has "f00"') as info:
        (tmp_path / "b.output.jsonl.manifest.json").write_text(json.dumps(newer))
        _open(tmp_path, newer | {"chat_template_sha256": "f00"}, resume=True)
    assert "--chat-template" in (info.value.hint or "")


def test_manifest_compare_list_limits_the_check(tmp_path: Path) -> None:
    manifest = MANIFEST | {"compare": ["model_sha"]}
    _open(tmp_path, manifest).close()
    _open(tmp_path, manifest | {"max_batch": 8}, resume=True).close()
    with pytest.raises(UsageError, match="model_sha"):
        _open(tmp_path, manifest | {"model_sha": "other"}, resume=True)


def test_resume_needs_the_manifest_of_existing_output(tmp_path: Path) -> None:
    _first_run(tmp_path)
    (tmp_path / "b.output.jsonl.manifest.json").unlink()
    with pytest.raises(UsageError, match="has no manifest"):
        _open(tmp_path, resume=True)


def test_resume_with_nothing_there_starts_fresh(tmp_path: Path) -> None:
    out = _open(tmp_path, resume=True)
    out.close()
    assert out.state.done == set()
    assert json.loads((tmp_path / "b.output.jsonl.manifest.json").read_text()) == MANIFEST
    assert (tmp_path / "b.output.jsonl").exists() and (tmp_path / "b.errors.jsonl").exists()


# --- ids ----------------------------------------------------------------------------------------------------


def test_ids_are_derived_so_a_second_run_writes_the_same_lines(tmp_path: Path) -> None:
    """The ids come from the model and the request, not from chance: the same writes give the same bytes, and
    every line's ids differ from every other line's."""
    files = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        _first_run(tmp_path / run)
        files.append([(tmp_path / run / f"b.{kind}.jsonl").read_bytes() for kind in ("output", "errors")])
    assert files[0] == files[1]
    records = _records(tmp_path / "a" / "b.output.jsonl") + _records(tmp_path / "a" / "b.errors.jsonl")
    ids = [r["id"] for r in records] + [r["response"]["request_id"] for r in records if r["response"]]
    assert len(ids) == len(set(ids)) and all(r["id"].startswith("batch_req_") for r in records)
    # Another model (fingerprint) gives other ids for the same requests.
    (tmp_path / "c").mkdir()
    with _open(tmp_path / "c", {**MANIFEST, "model_fingerprint": "other"}) as out:
        out.write_result("r1", BODY)
    assert _records(tmp_path / "c" / "b.output.jsonl")[0]["id"] != records[0]["id"]
