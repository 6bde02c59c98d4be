"""`lingctl train align`: exit codes, the text report, --json, and --save / --against."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lingctl.cli import run as cli_run
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
