"""The default thread count: chosen from the cores other processes leave free, fixed by --threads, re-decided
between steps only where results do not depend on it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lingctl.core.errors import UsageError
from lingctl.flood.batch.run import FloodOptions, run_batch
from lingctl.flood.engine import cpu_load
from lingctl.flood.engine.cpu_load import CpuBudget, CpuLoad, LoadMeter, measure, read_budget
from lingctl.flood.engine.loop import Engine, EngineConfig, GenRequest
from lingctl.flood.engine.native import kernels, why_unavailable
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.engine.sampling import SamplingParams
from lingctl.flood.engine.threads import (
    THREAD_INVARIANT_DTYPES,
    ThreadPolicy,
    ThreadPolicyConfig,
    choose_threads,
    results_follow_load_safely,
)
from lingctl.model.ling import LingForCausalLM
from tests.flood.conftest import tiny_model

needs_proc = pytest.mark.skipif(not cpu_load.PROC_STAT.exists(), reason="needs /proc/stat (Linux)")


@pytest.mark.parametrize(
    "usable, others, expected",
    [
        (2, 0.0, 2),  # idle: use both cores
        (2, 0.1, 2),  # a shell, a logger: still idle
        (2, 0.4, 1),  # a core is partly taken: its barrier waits would cost more than it gives
        (2, 0.67, 1),  # one busy competitor beside our 2 threads gets 2/3 of a core
        (2, 1.0, 1),  # one busy competitor
        (2, 2.0, 1),  # never fewer than one
        (4, 1.0, 3),
        (4, 0.0, 4),
        (1.5, 0.0, 1),  # a cgroup quota of 1.5 cores: one whole core
        (16, 0.0, 16),
    ],
)
def test_choose_threads(usable: float, others: float, expected: int) -> None:
    assert choose_threads(usable, others) == expected


def test_choose_threads_respects_a_cap() -> None:
    assert choose_threads(16, 0.0, max_threads=4) == 4
    assert choose_threads(2, 0.0, max_threads=0) == 1


class FakeMeter(LoadMeter):
    """A meter that hands out given loads and counts how often it is read."""

    def __init__(self, others: list[float], cores: int = 2) -> None:
        self.budget = CpuBudget(cpus=tuple(range(cores)))
        self._others = others
        self.reads = 0

    @property
    def available(self) -> bool:
        return True

    def read(self, min_window_s: float = 0.0) -> CpuLoad | None:
        self.reads += 1
        others = self._others.pop(0)
        return CpuLoad(window_s=2.0, usable_cores=2.0, busy_cores=others, own_cores=0.0, others_cores=others)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_adaptive_policy_follows_the_load_between_steps_and_reads_it_rarely() -> None:
    set_to: list[int] = []
    clock, meter = FakeClock(), FakeMeter([0.0, 1.0, 0.05])
    policy = ThreadPolicy(ThreadPolicyConfig(recheck_s=2.0), set_threads=set_to.append, clock=clock, meter=meter)
    assert policy.start() == 2 and set_to == [2]
    for _ in range(1000):  # steps within the recheck interval: no reading, no change
        clock.now += 0.001
        policy.between_steps()
    assert meter.reads == 1 and set_to == [2]
    clock.now += 1.5  # a competitor arrived
    policy.between_steps()
    assert meter.reads == 2 and set_to == [2, 1] and policy.threads == 1
    clock.now += 2.5  # it left
    policy.between_steps()
    assert set_to == [2, 1, 2]
    report = policy.report
    assert report is not None and report.source == "free cores" and report.final_threads == 2
    assert [(c.threads, c.others_cores) for c in report.changes] == [(1, 1.0), (2, 0.05)]


def test_a_sudden_slowdown_is_measured_at_once_in_a_fresh_window() -> None:
    set_to: list[int] = []
    clock, meter = FakeClock(), FakeMeter([0.0, 0.2, 1.0])
    policy = ThreadPolicy(
        ThreadPolicyConfig(recheck_s=2.0, quick_window_s=0.3), set_threads=set_to.append, clock=clock, meter=meter
    )
    assert policy.start() == 2
    for _ in range(20):  # steady 10 ms steps
        clock.now += 0.01
        policy.between_steps()
    assert meter.reads == 1
    clock.now += 0.2  # a step 20x slower: a competitor took a core
    policy.between_steps()
    assert meter.reads == 2 and set_to == [2]  # a new window starts; what came before it is dropped
    clock.now += 0.3
    policy.between_steps()
    assert meter.reads == 3 and set_to == [2, 1]
    assert policy.report is not None and policy.report.changes[0].at_s == pytest.approx(0.7)


def test_int8_float32_runs_follow_the_load_with_the_native_kernels() -> None:
    # int8 linears and experts run in flood's kernels, whose rows do not depend on the thread count.
    if kernels() is None:
        pytest.skip(f"flood's native kernels are unavailable here: {why_unavailable()}")
    clock, meter = FakeClock(), FakeMeter([0.0, 0.0])
    policy = ThreadPolicy.for_run(None, "float32", "int8", set_threads=lambda n: None, clock=clock, meter=meter)
    policy.prepare()
    assert policy.start() == 2 and meter.reads == 1


def test_int8_float32_runs_on_one_thread_whatever_the_load_without_the_kernels(monkeypatch) -> None:
    monkeypatch.setenv("LINGCTL_FLOOD_NATIVE", "0")
    kernels.cache_clear()
    try:
        set_to: list[int] = []
        clock, meter = FakeClock(), FakeMeter([0.0, 0.0])
        policy = ThreadPolicy.for_run(None, "float32", "int8", set_threads=set_to.append, clock=clock, meter=meter)
        policy.prepare()
        assert policy.start() == 1
        clock.now += 60
        policy.between_steps()
        assert set(set_to) == {1} and meter.reads == 0
        assert policy.report is not None and policy.report.source.startswith("one thread: float32")
    finally:
        monkeypatch.delenv("LINGCTL_FLOOD_NATIVE")
        kernels.cache_clear()


def test_threads_option_fixes_the_count_and_measures_nothing() -> None:
    set_to: list[int] = []
    meter = FakeMeter([])
    policy = ThreadPolicy.for_run(3, "bfloat16", set_threads=set_to.append, meter=meter)
    policy.prepare()
    assert policy.start() == 3 and set(set_to) == {3} and meter.reads == 0
    policy.between_steps()
    assert meter.reads == 0
    assert policy.report is not None and policy.report.source == "--threads"


def test_threads_zero_means_choose() -> None:
    assert ThreadPolicy.for_run(0, "bfloat16").fixed is None
    # float32 (int8 weights or not) follows the load exactly when the native kernels make its results
    # thread-free
    assert (ThreadPolicy.for_run(0, "float32").fixed is None) == results_follow_load_safely("float32")
    assert (ThreadPolicy.for_run(0, "float32", "int8").fixed is None) == (kernels() is not None)


@needs_proc
def test_with_a_busy_competitor_the_default_leaves_it_a_core(competitor: subprocess.Popen) -> None:
    budget = read_budget()
    if budget.usable_cores < 2:
        pytest.skip("needs at least 2 usable cores")
    deadline = time.monotonic() + 30
    while True:  # the competitor is running flat out once the kernel shows most of a core taken
        load = measure(0.2, budget)
        assert load is not None
        if load.others_cores >= 0.75 or time.monotonic() > deadline:
            break
    assert load.others_cores >= 0.75, f"the competitor never showed: {load}"
    set_to: list[int] = []
    threads = ThreadPolicy.for_run(None, "bfloat16", set_threads=set_to.append).start()
    assert set_to == [threads]
    if budget.usable_cores == 2:
        assert threads == 1
    else:
        assert threads <= budget.usable_cores - 1
    assert competitor.poll() is None


def _logits_of_a_run(model: LingForCausalLM, threads: int) -> list[torch.Tensor]:
    torch.set_num_threads(threads)
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=512))
    captured: list[torch.Tensor] = []
    result = engine.runner.result

    def capture() -> torch.Tensor:
        out = result()
        captured.append(out.clone())
        return out

    engine.runner.result = capture  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(3)
    # 5-11 rows per step: the row counts at which fp32 products take thread-dependent kernels
    reqs = [
        GenRequest(
            key=i,
            prompt_ids=torch.randint(2, 1024, (3 + i,), generator=g).tolist(),
            sampling=SamplingParams(max_tokens=4, temperature=0.0),
        )
        for i in range(9)
    ]
    list(engine.generate(reqs))
    return captured


@pytest.mark.parametrize("dtype", sorted(THREAD_INVARIANT_DTYPES | {"float32"}))
def test_thread_invariant_dtypes_give_the_same_logits_at_one_and_two_threads(dtype: str) -> None:
    """What lets the policy change the count during a run: the same bits whatever the count."""
    if not results_follow_load_safely(dtype):
        pytest.skip(f"{dtype} keeps one thread on this machine (no native kernels)")
    model = tiny_model().to(getattr(torch, dtype)).eval()
    model.normalize_head_()  # as loaders do
    previous = torch.get_num_threads()
    try:
        one, two = _logits_of_a_run(model, 1), _logits_of_a_run(model, 2)
    finally:
        torch.set_num_threads(previous)
    assert len(one) == len(two) >= 4
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_run_reports_its_threads_and_restores_the_count(tiny_ckpt: Path, tmp_path: Path, dtype: str) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "prompt": [5, 6, 7 + i], "max_tokens": 2, "temperature": 0}) + "\n"
            for i in range(2)
        )
    )
    before = torch.get_num_threads()
    summary = run_batch(
        FloodOptions(batch=batch, model=tiny_ckpt, out=tmp_path / "out.jsonl", engine=EngineOptions(dtype=dtype))
    )
    assert torch.get_num_threads() == before
    assert summary.succeeded == 2
    t = summary.threads
    if results_follow_load_safely(dtype):
        assert t["source"] == "free cores" and 1 <= t["threads"] <= read_budget().usable_cores
        assert t["others_cores"] is not None
    else:
        assert t["source"].startswith("one thread") and t["threads"] == 1 and t["others_cores"] is None
    assert t["final_threads"] >= 1


def test_a_negative_thread_count_is_a_usage_error(tiny_ckpt: Path, tmp_path: Path) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "prompt": [5, 6], "max_tokens": 1}) + "\n")
    with pytest.raises(UsageError, match="--threads must be >= 0"):
        run_batch(FloodOptions(batch=batch, model=tiny_ckpt, engine=EngineOptions(threads=-1)))
