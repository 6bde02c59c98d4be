"""`lingctl train align` as a library: planted bugs are named where they are, equal set-ups agree, dispatch
strategies and real gloo workers match one process, and trace files keep what they recorded."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lingctl.core.errors import UsageError
from lingctl.model.moe import grouped_mm_available
from lingctl.model.presets import preset
from lingctl.train.align.compare import AlignOptions, record, run_align
from lingctl.train.align.setup import AlignJob, parse_setup
from lingctl.train.align.trace import (
    FORCED,
    TOLERANCE,
    AlignReport,
    Entry,
    Trace,
    compare,
    compare_tensors,
    route_flips,
)
from lingctl.train.align.trace_file import load_trace, save_trace

GATE = "model.layers.1.mlp.gate"  # tiny: layer 0 is dense, layer 1 is the MoE layer


def job(**kw: int) -> AlignJob:
    settings: dict[str, Any] = {"batch_size": 2, "seq_len": 8, **kw}
    return AlignJob(config=preset("tiny"), **settings)


def align(a: str, b: str, *, same_routes: bool = False, **kw: int) -> AlignReport:
    opts = AlignOptions(job=job(**kw), a=parse_setup(a), b=parse_setup(b, side="b"), same_routes=same_routes)
    _, report = run_align(opts)
    assert report is not None
    return report


def test_planted_forward_bug_is_named_first_in_forward() -> None:
    report = align("dtype=float32", f"bug=router-no-renorm@{GATE}")
    assert not report.ok and report.first_module == GATE
    assert report.first_forward is not None and report.first_forward.module == GATE
    assert report.first_forward.what == "out.topk_weight"  # ids, logits and probs agree; the weights do not
    # Everything that ran before the router agrees.
    before = [r for r in report.rows if r.index < report.first_forward.index]
    assert before and all(r.ok for r in before)
    assert "forward" in report.verdict and GATE in report.verdict


def test_planted_backward_bug_passes_forward_and_is_named_first_in_backward() -> None:
    report = align("dtype=float32", f"bug=router-no-grad@{GATE}")
    assert all(r.ok for r in report.rows if r.phase == "fwd")
    assert report.first_forward is None
    assert report.first_backward is not None and report.first_backward.module == GATE
    assert report.first_module == GATE and "backward" in report.verdict
    # Backward rows keep autograd's order: the router's gradients come before the layer's attention's.
    modules = [r.module for r in report.rows if r.phase == "bwd"]
    assert modules.index(GATE) < modules.index("model.layers.1.attention")


def test_identical_set_ups_agree_exactly() -> None:
    report = align("dtype=float32", "dtype=float32")
    assert report.ok and report.failed == 0 and report.one_sided == 0
    assert all(r.rel_diff == 0.0 for r in report.rows)
    phases = {r.phase for r in report.rows}
    whats = {r.what for r in report.rows}
    assert phases == {"fwd", "bwd"} and {"lm", "balance", "z", "total"} <= whats
    assert f"{GATE}" in {r.module for r in report.rows if r.what == "grad.weight"}  # router gradient recorded


@pytest.mark.skipif(not grouped_mm_available(), reason="torch._grouped_mm is missing")
def test_naive_and_grouped_dispatch_agree_within_float32_tolerance() -> None:
    report = align("dispatch=naive", "dispatch=grouped")
    assert report.tolerance == TOLERANCE["float32"]
    assert report.ok, report.verdict
    # The experts' own modules do not run under grouped dispatch: listed, not judged; their weights'
    # gradients are compared.
    assert report.one_sided > 0 and all(r.note == "only in a" for r in report.rows if r.ok is None)
    assert any(r.ok and ".experts." in r.module and r.what == "grad.weight" for r in report.rows)


@pytest.mark.slow
def test_two_ddp_workers_match_one_worker() -> None:
    report = align("dtype=float32", "workers=2,mode=ddp,balance=batch", batch_size=4)
    grads = [r for r in report.rows if r.what.startswith("grad.")]
    assert grads and all(r.ok for r in grads), [r for r in grads if not r.ok][:3]
    assert report.ok, report.verdict
    assert report.b["setup"]["workers"] == 2


def tensor_of(entry: Entry) -> torch.Tensor:
    assert entry.tensor is not None
    return entry.tensor


def test_trace_round_trip_keeps_entries_and_refuses_other_files(tmp_path) -> None:
    trace = record(job(), parse_setup("dtype=bfloat16"))
    path = tmp_path / "t.safetensors"
    save_trace(path, trace)
    back = load_trace(path)
    assert [e.key for e in back.entries] == [e.key for e in trace.entries]
    assert all(torch.equal(tensor_of(x), tensor_of(y)) for x, y in zip(back.entries, trace.entries))
    assert back.meta["setup"]["dtype"] == "bfloat16" and back.meta["batch"] == {
        "seed": 0,
        "batch_size": 2,
        "seq_len": 8,
    }
    (tmp_path / "other.safetensors").write_bytes(path.read_bytes()[:8] + b"{}")
    with pytest.raises(Exception, match="not a safetensors file|not a trace"):
        load_trace(tmp_path / "other.safetensors")


def test_modules_regex_keeps_the_trace_small() -> None:
    trace = record(AlignJob(config=preset("tiny"), batch_size=2, seq_len=8, modules=r"mlp\.gate$"), parse_setup(""))
    assert {e.module for e in trace.entries} == {GATE, "loss"}


@pytest.mark.parametrize(
    "spec,message",
    [
        ("dtype=float16", "dtype='float16'"),
        ("speed=fast", "unknown key 'speed'"),
        ("workers=0", "workers='0'"),
        ("bug=router-on-fire@x", "KIND@MODULE"),
        ("dtype", "dtype needs a value"),
    ],
)
def test_bad_specs_name_the_key(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        parse_setup(spec)


def test_compare_tensors_counts_flipped_routes_and_non_finite_values() -> None:
    ids = torch.tensor([[0, 1], [2, 3]])
    assert compare_tensors(ids, torch.tensor([[0, 1], [2, 4]]), 1e-4)[2:] == (False, "1/4 routes differ")
    x = torch.tensor([1.0, float("nan")])
    assert compare_tensors(x, x.clone(), 1e-4)[2] is True
    abs_diff, rel, ok, note = compare_tensors(x, torch.tensor([1.0, 2.0]), 1e-4)
    assert math.isinf(rel) and not ok and "non-finite" in note
    assert compare_tensors(torch.ones(3), torch.ones(3) * (1 + 5e-5), 1e-4)[2] is True


def test_planted_bugs_are_named_first_with_same_routes_too() -> None:
    # no-renorm changes the weights at the chosen experts, not which experts: forcing routes must keep it.
    fwd = align("dtype=float32", f"bug=router-no-renorm@{GATE}", same_routes=True)
    assert fwd.first_forward is not None and (fwd.first_forward.module, fwd.first_forward.what) == (
        GATE,
        "out.topk_weight",
    )
    bwd = align("dtype=float32", f"bug=router-no-grad@{GATE}", same_routes=True)
    assert bwd.first_forward is None and bwd.first_backward is not None and bwd.first_backward.module == GATE
    assert fwd.routes_forced == bwd.routes_forced == "b"


def test_route_flips_count_sets_and_classify_near_ties() -> None:
    ref = torch.tensor([[0, 1], [2, 3], [0, 3]])
    probs = torch.tensor(
        [
            [0.40, 0.30, 0.299, 0.001],  # token 0: experts 1 and 2 at a near-tie
            [0.10, 0.10, 0.40, 0.40],  # token 1: 1 and 2 far apart
            [0.50, 0.10, 0.10, 0.30],
        ]
    )
    # The same experts in another slot order are no flip; token 0 swaps 1 for 2 at a near-tie.
    tie = route_flips(ref, torch.tensor([[0, 2], [3, 2], [3, 0]]), probs, 0.03)
    assert (tie.flipped, tie.near_ties, tie.all_near_ties) == (1, 1, True)
    assert tie.note() == "1/6 routes differ (1 at near-ties)"
    # Token 1 drops expert 2 (p 0.40) for expert 0 (p 0.10): a real difference.
    real = route_flips(ref, torch.tensor([[0, 2], [0, 3], [0, 3]]), probs, 0.03)
    assert (real.flipped, real.near_ties, real.all_near_ties) == (2, 1, False)
    unknown = route_flips(ref, torch.tensor([[0, 2], [2, 3], [0, 3]]), None, 0.03)
    assert unknown.near_ties is None and "unknown" in unknown.note()


def test_forced_routes_pass_only_flips_at_near_ties() -> None:
    def trace(idx: list[list[int]], forced: bool) -> Trace:
        entries = [
            Entry(phase="fwd", module=GATE, what="out.topk_idx", tensor=torch.tensor(idx)),
            Entry(phase="fwd", module=GATE, what="out.probs", tensor=torch.tensor([[0.5, 0.25, 0.249, 0.001]] * 2)),
        ]
        return Trace(entries=entries, meta={"setup": {"dtype": "bfloat16"}, FORCED: forced})

    ref = trace([[0, 1], [0, 1]], False)
    assert compare(ref, trace([[0, 2], [0, 1]], True)).ok  # 1 for 2: a near-tie
    report = compare(ref, trace([[0, 2], [2, 3]], True))  # token 1 also drops expert 0 (p 0.5)
    assert not report.ok and report.rows[0].note.startswith("3/4 routes differ (1 at near-ties)")
    unforced = compare(ref, trace([[0, 2], [0, 1]], False))
    assert not unforced.ok and unforced.verdict.endswith("rerun with --same-routes to compare the rest")
