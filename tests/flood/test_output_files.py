"""flood's outputs are never written through links, nor into files lingctl cannot show it wrote.

The scenario: another user copies a real manifest (plain data, from an evaluation or a run with the same model
and tasks) into a directory where someone's output goes, and plants a link, a hard link or a file of their own
under the output's name (``OUT``, ``OUT.partial``, the errors file). ``flood eval`` (which resumes by itself)
and ``flood run --resume`` must refuse in one line and leave every byte of the target as it was. The commands
run in this process; the refusals come before any weights are loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lingctl.cli import run as cli_run
from lingctl.core.atomic import tmp_prefix
from lingctl.core.errors import UsageError, VerificationError
from lingctl.flood.batch.output import BatchOutput, manifest_path
from lingctl.flood.batch.run import FloodOptions, run_batch
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.eval.output import ResultsFile, journal_path
from lingctl.flood.eval.run import EvalOptions, run_eval
from lingctl.flood.eval.tasks import EvalItem, Task
from tests.flood.test_eval import mc_rows, write_jsonl

# A file only its owner may read, with known bytes and no newline at the end: the last line looks torn.
VICTIM_BYTES = b"root-only secret\nlast line without a newline"
OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_run(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines[0].startswith("lingctl: error: ") and len(lines) <= 2, err
    assert all(line.startswith(("lingctl: error: ", "hint: ")) for line in lines) and "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def evaluated(text_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real, finished evaluation: (task file, its output)."""
    d = tmp_path_factory.mktemp("evaluated")
    tasks = write_jsonl(d / "mc.jsonl", mc_rows(3))
    out = d / "mc.eval.jsonl"
    run_eval(EvalOptions(tasks=[tasks], model=text_ckpt, out=out, engine=EngineOptions(threads=1)))
    return tasks, out


@pytest.fixture(scope="module")
def answered(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real, finished ``flood run``: (batch file, its output)."""
    d = tmp_path_factory.mktemp("answered")
    batch = write_jsonl(
        d / "b.jsonl", [{"custom_id": f"r{i}", "prompt": [5 + i, 6], "max_tokens": 2} for i in range(3)]
    )
    summary = run_batch(FloodOptions(batch=batch, model=tiny_ckpt, engine=EngineOptions(threads=1)))
    assert summary.succeeded == 3
    return batch, d / "b.output.jsonl"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    victim.chmod(0o600)
    return victim


def _untouched(victim: Path, data: bytes = VICTIM_BYTES) -> None:
    assert victim.read_bytes() == data and stat.S_IMODE(victim.stat().st_mode) == 0o600


def _beside_a_copied_manifest(earlier_out: Path, tmp_path: Path) -> Path:
    """``OUT`` in a fresh directory holding only a copy of the earlier output's manifest."""
    shared = tmp_path / "shared"
    shared.mkdir(parents=True)
    out = shared / earlier_out.name
    shutil.copyfile(manifest_path(earlier_out), manifest_path(out))
    return out


def _listing(directory: Path) -> dict[str, bytes | str]:
    """Every entry: a link's target, a file's bytes."""
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("planted", ["OUT.partial", "OUT"])
def test_flood_eval_never_writes_through_a_link_beside_a_copied_manifest(
    capsys, text_ckpt, evaluated, tmp_path, planted
):
    tasks, earlier = evaluated
    victim = _victim(tmp_path)
    out = _beside_a_copied_manifest(earlier, tmp_path)
    (journal_path(out) if planted == "OUT.partial" else out).symlink_to(victim)
    before = _listing(out.parent)
    code, _, err = cli(capsys, "flood", "eval", str(tasks), "-m", str(text_ckpt), "-o", str(out), "--threads", "1")
    assert code == 2 and "is a symbolic link" in one_line(err)
    _untouched(victim)
    assert _listing(out.parent) == before  # nothing written, cut, created or removed


@pytest.mark.parametrize("planted", ["output", "errors"])
def test_flood_run_resume_never_writes_through_a_link_beside_a_copied_manifest(
    capsys, tiny_ckpt, answered, tmp_path, planted
):
    batch, earlier = answered
    victim = _victim(tmp_path)
    out = _beside_a_copied_manifest(earlier, tmp_path)
    errors = out.with_name("b.errors.jsonl")
    (out if planted == "output" else errors).symlink_to(victim)
    before = _listing(out.parent)
    for resume in (["--resume"], []):
        code, _, err = cli(capsys, "flood", "run", str(batch), "-m", str(tiny_ckpt), "-o", str(out), *resume)
        assert code == 2 and "is a symbolic link" in one_line(err)
    _untouched(victim)
    assert _listing(out.parent) == before


def test_a_hard_link_or_a_copy_of_a_users_file_is_never_shortened(
    capsys, text_ckpt, tiny_ckpt, evaluated, answered, tmp_path
):
    """A file of the caller's own that lingctl did not write: with a second name it is refused as a hard link
    (exit 2); alone under the output's name its bytes are not those the manifest records (exit 4)."""
    tasks, evaluation = evaluated
    batch, run = answered
    mine = tmp_path / "notes.jsonl"
    data = b'{"task": "mc", "id": "q0", "custom_id": "r0"}\n{"torn'
    mine.write_bytes(data)
    mine.chmod(0o600)
    eval_out = _beside_a_copied_manifest(evaluation, tmp_path / "e")
    run_out = _beside_a_copied_manifest(run, tmp_path / "r")
    eval_args = ("flood", "eval", str(tasks), "-m", str(text_ckpt), "-o", str(eval_out), "--threads", "1")
    run_args = ("flood", "run", str(batch), "-m", str(tiny_ckpt), "-o", str(run_out), "--resume")
    for name, args in ((journal_path(eval_out), eval_args), (run_out, run_args)):
        os.link(mine, name)
        code, _, err = cli(capsys, *args)
        assert code == 2 and "has 2 hard links" in one_line(err)
        name.unlink()
        shutil.copyfile(mine, name)
        code, _, err = cli(capsys, *args)
        assert code == 4 and "lingctl wrote" in one_line(err), err
        assert name.read_bytes() == data  # not shortened
    _untouched(mine, data)


@as_root
def test_files_and_manifests_of_another_user_are_refused(capsys, text_ckpt, tiny_ckpt, evaluated, answered, tmp_path):
    """As root, the case as it happens: the copied manifest belongs to whoever copied it, and so may the file."""
    tasks, evaluation = evaluated
    batch, run = answered
    eval_out = _beside_a_copied_manifest(evaluation, tmp_path / "e")
    run_out = _beside_a_copied_manifest(run, tmp_path / "r")
    theirs = [journal_path(eval_out), run_out]
    for path in theirs:
        path.write_bytes(VICTIM_BYTES)
        os.chown(path, OTHER_UID, OTHER_UID)
    eval_args = ("flood", "eval", str(tasks), "-m", str(text_ckpt), "-o", str(eval_out), "--threads", "1")
    run_args = ("flood", "run", str(batch), "-m", str(tiny_ckpt), "-o", str(run_out), "--resume")
    for args in (eval_args, run_args):
        code, _, err = cli(capsys, *args)
        assert code == 2 and f"belongs to uid {OTHER_UID}" in one_line(err)
    for path in theirs:
        assert path.read_bytes() == VICTIM_BYTES
        path.unlink()
    for path in (manifest_path(eval_out), manifest_path(run_out)):
        os.chown(path, OTHER_UID, OTHER_UID)
    for args in (eval_args, run_args):
        code, _, err = cli(capsys, *args)
        assert code == 2 and f"belongs to uid {OTHER_UID}" in one_line(err) and "manifest.json" in err
    assert not any(p.exists() for p in theirs)


# --- the files themselves, without a model -----------------------------------------------------------------

MANIFEST = {"model": "m", "created": "2025-01-01T00:00:00Z"}
EVAL_MANIFEST = {"format": "lingctl-eval", "model": "m", "compare": ["format", "model"]}
BODY = {"object": "text_completion", "choices": []}


def _plant(kind: str, path: Path, target: Path) -> None:
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "dangling symlink":
        path.symlink_to(target.with_name("nothing-here"))
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.link(target, path)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo", "hard link"])
def test_anything_but_a_sole_regular_file_is_refused_before_a_byte_changes(tmp_path, kind):
    victim = _victim(tmp_path)
    out, errors = tmp_path / "o.jsonl", tmp_path / "o.errors.jsonl"
    with BatchOutput(out, errors, MANIFEST, resume=False) as files:
        files.write_result("r1", BODY)
    errors.unlink()
    _plant(kind, errors, victim)
    before = _listing(tmp_path) if kind != "fifo" else None
    for resume in (True, False):
        with pytest.raises(UsageError, match="is a symbolic link|is not a regular file|has 2 hard links"):
            BatchOutput(out, errors, MANIFEST, resume=resume)
    _untouched(victim)
    assert before is None or _listing(tmp_path) == before


def test_lingctls_own_torn_line_is_cut_and_the_record_follows_every_write(tmp_path):
    out = tmp_path / "o.jsonl"
    with BatchOutput(out, out.with_name("e.jsonl"), MANIFEST, resume=False) as files:
        files.write_result("r1", BODY)
        files.write_result("r2", BODY)
    complete = out.read_bytes()
    written = json.loads(manifest_path(out).read_bytes())["written"]["output"]
    assert written == {"bytes": len(complete), "sha256": hashlib.sha256(complete).hexdigest()}
    out.write_bytes(complete + b'{"id": "batch_req_x", "custom_id": "r3", "resp')
    with BatchOutput(out, out.with_name("e.jsonl"), MANIFEST, resume=True) as files:
        assert files.state.done == {"r1", "r2"} and files.state.torn_bytes > 0
    assert out.read_bytes() == complete


def test_a_file_with_bytes_but_no_record_is_refused_whole(tmp_path):
    """Content where the manifest records none (a manifest of an older lingctl, or a copied one of a run that had
    written nothing): lingctl cannot show that it wrote any of it."""
    out = tmp_path / "o.jsonl"
    BatchOutput(out, out.with_name("e.jsonl"), MANIFEST, resume=False).close()
    out.write_bytes(VICTIM_BYTES)
    with pytest.raises(UsageError, match="records none that lingctl wrote there"):
        BatchOutput(out, out.with_name("e.jsonl"), MANIFEST, resume=True)
    assert out.read_bytes() == VICTIM_BYTES


def _task(*ids: str) -> Task:
    items = [EvalItem(task="t", id=i, kind="generate", line=n) for n, i in enumerate(ids, start=1)]
    return Task(name="t", kind="generate", path=Path("t.jsonl"), sha256="", items=items, pool=[])


def test_an_evaluation_journal_is_continued_and_cut_when_it_is_lingctls(tmp_path):
    out = tmp_path / "o.jsonl"
    first = ResultsFile(out, EVAL_MANIFEST)
    first.append({"task": "t", "id": "a"})
    first.close()
    journal = journal_path(out)
    kept = journal.read_bytes()
    journal.write_bytes(kept + b'{"task": "t", "id"')
    again = ResultsFile(out, EVAL_MANIFEST)
    assert [r["id"] for r in again.done] == ["a"] and journal.read_bytes() == kept
    again.append({"task": "t", "id": "b"})
    again.finish([_task("a", "b")])
    assert not journal.exists() and [json.loads(line)["id"] for line in out.read_bytes().splitlines()] == ["a", "b"]
    # The finished output was written whole: a torn tail in it is damage, reported and never cut.
    finished = out.read_bytes()
    out.write_bytes(finished + b"{")
    with pytest.raises(VerificationError, match="last line is not a complete JSON record"):
        ResultsFile(out, EVAL_MANIFEST)
    assert out.read_bytes() == finished + b"{"


def test_a_journal_replaced_during_the_evaluation_is_left_where_it_is(tmp_path):
    out = tmp_path / "o.jsonl"
    files = ResultsFile(out, EVAL_MANIFEST)
    files.append({"task": "t", "id": "a"})
    journal = journal_path(out)
    replacement = tmp_path / "replacement"
    replacement.write_bytes(journal.read_bytes())  # the same bytes, another file
    os.replace(replacement, journal)
    files.finish([_task("a")])
    assert out.exists() and journal.exists()  # lingctl removes only the journal it wrote


def test_a_runs_evaluation_directory_must_be_a_real_directory_of_the_caller(evaluated, tmp_path):
    """The refusals come before the run's checkpoints are listed: a run directory with only its manifest will do."""
    tasks, _ = evaluated
    run = tmp_path / "run"
    run.mkdir()
    (run / "lingctl-run.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "lingctl-eval.json").write_text("{}")  # looks like lingctl's, but is not where -o points
    before = _listing(elsewhere)
    out = tmp_path / "ev"

    def evaluate() -> None:
        run_eval(EvalOptions(tasks=[tasks], model=run, out=out, engine=EngineOptions(threads=1)))

    out.symlink_to(elsewhere)
    with pytest.raises(UsageError, match="ev is a symbolic link"):
        evaluate()
    out.unlink()
    out.mkdir()
    (out / "lingctl-eval.json").symlink_to(elsewhere / "lingctl-eval.json")
    with pytest.raises(UsageError, match="lingctl-eval.json is a symbolic link"):
        evaluate()
    if os.geteuid() == 0:
        (out / "lingctl-eval.json").unlink()
        os.chown(out, OTHER_UID, OTHER_UID)
        with pytest.raises(UsageError, match=f"belongs to uid {OTHER_UID}"):
            evaluate()
        assert list(out.iterdir()) == []
    assert _listing(elsewhere) == before


def test_a_manifest_write_cut_by_a_kill_leaves_nothing_behind_on_the_next_run(tmp_path):
    """The manifest is rewritten as the files grow; a kill inside one write leaves a temporary file, which the
    next run removes when its writer is dead (and only then)."""
    out = tmp_path / "o.jsonl"
    BatchOutput(out, tmp_path / "e.jsonl", MANIFEST, resume=False).close()
    ours = tmp_prefix(manifest_path(out).name)  # ".<name>.lingctl-tmp-<host>-<this pid>-"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / (ours.replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-") + "abcd1234")
    live = tmp_path / (ours + "abcd1234")  # this process: a write in progress
    for path in (left, live):
        path.write_bytes(b"{")
    BatchOutput(out, tmp_path / "e.jsonl", MANIFEST, resume=True).close()
    assert not left.exists() and live.exists()
