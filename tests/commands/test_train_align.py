"""`lingctl train align`: exit codes, the text report, --json, and --save / --against."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
from pathlib import Path

import pytest
import torch

from lingctl.cli import run as cli_run
from lingctl.train.align.trace_file import load_trace, save_trace
from tests.conftest import run_lingctl

SMALL = ("--batch-size", "2", "--seq-len", "8")
GATE = "model.layers.1.mlp.gate"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process: exit code, stdout and stderr."""
    code = cli_run(["train", "align", *SMALL, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_identical_set_ups_exit_0_with_json(capsys) -> None:
    code, out, err = cli(capsys, "--a", "dtype=float32", "--b", "dtype=float32", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] is True and report["failed"] == 0 and report["first_module"] is None
    assert report["rows"] and all(r["ok"] for r in report["rows"])


def test_fp32_against_bf16_report_is_readable(capsys) -> None:
    code, out, err = cli(capsys)  # defaults: dtype=float32 against dtype=bfloat16
    assert code in (0, 4), err
    lines = out.splitlines()
    assert lines[0].startswith("a: dtype=float32,") and lines[1].startswith("b: dtype=bfloat16,")
    assert "tolerance: relative 0.03" in lines
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["#", "phase", "module"])
    rows = lines[header + 1 : next(i for i, line in enumerate(lines) if " entries: " in line)]
    assert rows and all(r.split()[1] in ("fwd", "bwd") for r in rows)
    assert lines[-1].startswith("verdict: ")


def test_planted_bug_exits_4_naming_the_router(capsys) -> None:
    code, out, err = cli(capsys, "--b", f"bug=router-no-renorm@{GATE}", "--show", "3")
    assert code == 4
    verdict = out.splitlines()[-1]
    assert verdict.startswith(f"verdict: first disagreement: {GATE} in forward, out.topk_weight: relative")
    # The error line counts (as babel verify's does) rather than repeat the verdict.
    assert len(err.splitlines()) == 1 and verdict.removeprefix("verdict: ") not in err
    assert re.fullmatch(r"lingctl: error: \d+ of \d+ entries beyond tolerance between set-up a and set-up b\n", err)
    assert "first forward: #" in out
    assert [line.split()[0] for line in out.splitlines() if line.split()[1:2] in (["fwd"], ["bwd"])] == ["1", "2", "3"]


def test_save_then_against_round_trip_and_refusals(capsys, tmp_path: Path, tiny_ckpt: Path) -> None:
    trace = tmp_path / "old.safetensors"
    code, out, err = cli(capsys, "--a", "dtype=float32", "--save", str(trace))
    assert code == 0 and trace.is_file() and "entries of set-up a" in out, err
    code, _, err = cli(capsys, "--save", str(trace))
    assert code == 2 and "already exists" in err and "--force" in err
    code, out, err = cli(capsys, "--a", "dtype=float32", "--against", str(trace), "--json")
    assert code == 0, err
    assert json.loads(out)["ok"] is True
    for other in (("--seed", "1"), ("--model", str(tiny_ckpt))):
        code, out, err = cli(capsys, "--against", str(trace), *other)
        assert code == 2 and out == ""
        assert len(err.splitlines()) == 1 and err.startswith(f"lingctl: error: {trace} was recorded with other ")


def test_bad_spec_is_one_line_and_exit_2() -> None:
    res = run_lingctl("train", "align", *SMALL, "--b", "dtype=fp8")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0] == "lingctl: error: --b: dtype='fp8' is not one of float32, bfloat16, float64"
    assert "Traceback" not in res.stderr


def test_fp32_against_bf16_flips_a_route_at_a_near_tie_and_agrees_on_same_routes(capsys) -> None:
    # 4 x 32, seed 0 (the command's defaults): bf16 sends one token of the MoE layer to another expert.
    size = ("--batch-size", "4", "--seq-len", "32")
    code, out, err = cli(capsys, *size)
    assert code == 4
    verdict = out.splitlines()[-1]
    assert verdict.startswith(f"verdict: first disagreement: {GATE} in forward, out.topk_idx: ")
    assert re.search(
        r"(\d+)/256 routes differ \(\1 at near-ties\); all at near-ties: rounding; rerun with --same-routes", verdict
    )
    code, out, err = cli(capsys, *size, "--same-routes", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] is True and report["routes_forced"] == "b"
    assert all(r["ok"] for r in report["rows"] if r["ok"] is not None)
    [gate] = [r for r in report["rows"] if r["module"] == GATE and r["what"] == "out.topk_idx"]
    flipped = gate["routes"]["flipped"]
    assert flipped > 0 and gate["routes"]["near_ties"] == flipped
    assert gate["note"] == f"{flipped}/256 routes differ ({flipped} at near-ties); b ran on a's routes"


def test_same_routes_against_a_trace_and_refused_without_its_routes(capsys, tmp_path: Path) -> None:
    trace = tmp_path / "old.safetensors"
    assert cli(capsys, "--a", "dtype=float32", "--save", str(trace))[0] == 0
    code, out, err = cli(capsys, "--a", "dtype=bfloat16", "--against", str(trace), "--same-routes")
    assert code == 0, err
    assert "routes: a ran on b's; its own top-k would differ in " in out and out.splitlines()[-1].startswith(
        "verdict: a and b agree: "
    )
    partial = tmp_path / "layer0.safetensors"
    layer0 = ("--modules", r"layers\.0\.")
    assert cli(capsys, "--save", str(partial), *layer0)[0] == 0
    code, out, err = cli(capsys, "--against", str(partial), *layer0, "--same-routes")
    assert code == 2 and out == ""
    assert err.splitlines()[0] == (
        f"lingctl: error: --same-routes: {partial} holds no out.topk_idx of the router {GATE} "
        r"(recorded with --modules 'layers\.0\.')"
    )


# -- traces from elsewhere are data: a damaged or crafted one is refused in one line, exit 4 ------------------


def _split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _meta_edit(change):
    """A crafting step that edits the trace's JSON record (set-up, batch, entry order) and nothing else."""

    def craft(raw: bytes) -> bytes:
        header, data = _split(raw)
        meta = json.loads(header["__metadata__"]["lingctl.align"])
        change(meta)
        header["__metadata__"]["lingctl.align"] = json.dumps(meta)
        return _join(header, data)

    return craft


def _tensor_edit(key: str, **fields):
    def craft(raw: bytes) -> bytes:
        header, data = _split(raw)
        header[key].update(fields)
        return _join(header, data)

    return craft


def _retensor(what: str, make):
    """Replace router entries' tensors (``what``: a regex on the entry) by ``make(tensor)``, written as lingctl
    writes traces."""

    def craft(raw: bytes, path: Path) -> None:
        path.write_bytes(raw)
        trace = load_trace(path)
        for e in trace.entries:
            if e.module == GATE and re.fullmatch(what, e.what):
                e.tensor = make(e.tensor)
        path.unlink()
        save_trace(path, trace)

    return craft


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


ROUTES_KEY = f"fwd:{GATE}:out.topk_idx"
CRAFTED = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "only the length": lambda raw: raw[:8],
    "header bigger than the file": lambda raw: struct.pack("<Q", 2**62) + raw[8:],
    "header not JSON": lambda raw: struct.pack("<Q", 9) + b"not json!",
    "header nested beyond reason": lambda raw: struct.pack("<Q", 200_000) + b"[" * 200_000,
    "header with a 5000-digit number": lambda raw: _join({"n": 0}, b"").replace(b"0", b"7" * 5000, 1),
    "header is a list": lambda raw: _join([], b""),  # type: ignore[arg-type]
    "no align record": _meta_edit(lambda m: m.clear()),
    "format of another version": _meta_edit(lambda m: m.update(format="lingctl.align/9")),
    "set-up missing": _meta_edit(lambda m: m.pop("setup")),
    "dtype a number": _meta_edit(lambda m: m["setup"].update(dtype=5)),
    "workers a string": _meta_edit(lambda m: m["setup"].update(workers="2")),
    "batch size a bool": _meta_edit(lambda m: m["batch"].update(batch_size=True)),
    "host with an escape sequence": _meta_edit(lambda m: m.update(host="\x1b]0;owned\x07")),
    "entries an object": _meta_edit(lambda m: m.update(entries={"a": 1})),
    "entry of numbers": _meta_edit(lambda m: m["entries"].__setitem__(0, [1, 2, 3])),
    "module name with ..": _meta_edit(lambda m: m["entries"][0].__setitem__(1, "model/../../etc/passwd")),
    "entry listed twice": _meta_edit(lambda m: m["entries"].append(m["entries"][0])),
    "entry without its tensor": _meta_edit(lambda m: m["entries"].append(["fwd", "model.extra", "out"])),
    "unknown dtype": _tensor_edit(ROUTES_KEY, dtype="C64"),
    "huge declared shape": _tensor_edit(ROUTES_KEY, shape=[2**40, 2**20]),
    "shape of strings": _tensor_edit(ROUTES_KEY, shape=["16", "2"]),
    "offsets past the end": _tensor_edit(ROUTES_KEY, data_offsets=[0, 2**50]),
    "expert ids as floats": _retensor(r"out\.topk_idx", lambda t: t.to(torch.float32)),
    "expert ids out of range": _retensor(r"out\.topk_idx", lambda t: t + 1000),
    "expert ids of another shape": _retensor(r"out\.topk_idx", lambda t: t[:, :1].contiguous()),
    "probabilities of another shape": _retensor(r"out\.probs", lambda t: t[:, :3].contiguous()),
}


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("trace") / "good.safetensors"
    assert cli_run(["train", "align", *SMALL, "--a", "dtype=float32", "--save", str(path)]) == 0
    return path.read_bytes()


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_damaged_or_crafted_trace_is_refused_in_one_line_with_exit_4(
    capsys, tmp_path: Path, good_trace: bytes, name: str
) -> None:
    path = tmp_path / "crafted.safetensors"
    craft = CRAFTED[name]
    if craft.__code__.co_argcount == 2:
        craft(good_trace, path)
    else:
        path.write_bytes(craft(good_trace))
    code, out, err = cli(capsys, "--against", str(path))
    assert code == 4 and out == "", err
    assert err.startswith(f"lingctl: error: {path} is not a trace of lingctl train align: "), err
    assert "Traceback" not in err and "\x1b" not in err and len(err.splitlines()) <= 2  # the line and its hint


def test_a_pickle_is_refused_and_runs_nothing(capsys, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps({"entries": _RunsCode(marker)}))
    code, out, err = cli(capsys, "--against", str(path))
    assert code == 4 and err.startswith(f"lingctl: error: {path} is not a trace"), err
    torch.save({"x": _RunsCode(marker)}, path)  # torch's own format: a zip of pickles
    code, out, err = cli(capsys, "--against", str(path), "--same-routes")
    assert code == 4 and err.startswith(f"lingctl: error: {path} is not a trace"), err
    assert not marker.exists()


def test_forced_routes_of_another_batch_are_refused(capsys, tmp_path: Path, good_trace: bytes) -> None:
    path = tmp_path / "short.safetensors"
    _retensor(r"out\.(topk_idx|probs)", lambda t: t[:3].contiguous())(good_trace, path)
    code, out, err = cli(capsys, "--against", str(path), "--same-routes")
    assert code == 4 and out == ""
    assert err.splitlines()[0] == f"lingctl: error: {path}: the router {GATE}'s out.topk_idx has 3 tokens, the batch 16"
