from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from lingctl.flood.engine import cpu_load
from lingctl.flood.engine.cpu_load import CpuBudget, LoadMeter, busy_ticks, measure, read_budget

needs_proc = pytest.mark.skipif(not cpu_load.PROC_STAT.exists(), reason="needs /proc/stat (Linux)")

STAT = """cpu  900 10 300 5000 40 0 7 3 0 0
cpu0 400 5 100 2500 20 0 3 1 0 0
cpu1 500 5 200 2500 20 0 4 2 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_ticks_counts_only_the_allowed_cpus_and_only_busy_fields() -> None:
    # user + nice + system + irq + softirq + steal; idle and iowait are free time
    assert busy_ticks((0,), STAT) == 400 + 5 + 100 + 0 + 3 + 1
    assert busy_ticks((1,), STAT) == 500 + 5 + 200 + 0 + 4 + 2
    assert busy_ticks((0, 1), STAT) == busy_ticks((0,), STAT) + busy_ticks((1,), STAT)
    assert busy_ticks((7,), STAT) == 0  # not in the file: no cpu7 line, no "cpu" total line


def test_cgroup_quota_files(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_load._v2_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_load._v2_quota(tmp_path) is None
    (tmp_path / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_load._v1_quota(tmp_path) == 0.5
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_load._v1_quota(tmp_path) is None
    assert cpu_load._v2_quota(tmp_path / "missing") is None


def test_a_quota_caps_the_usable_cores() -> None:
    assert CpuBudget(cpus=(0, 1, 2, 3), quota_cores=1.5).usable_cores == 1.5
    assert CpuBudget(cpus=(0, 1), quota_cores=None).usable_cores == 2.0
    assert CpuBudget(cpus=(0, 1), quota_cores=8.0).usable_cores == 2.0


@needs_proc
def test_the_budget_is_the_affinity_mask() -> None:
    budget = read_budget()
    assert set(budget.cpus) == set(cpu_load.os.sched_getaffinity(0))
    assert 0 < budget.usable_cores <= len(budget.cpus)


@needs_proc
def test_a_busy_competitor_shows_as_load_of_others(competitor: subprocess.Popen) -> None:
    budget = read_budget()
    deadline = time.monotonic() + 30
    seen: list[float] = []
    while time.monotonic() < deadline:
        load = measure(0.3, budget)
        assert load is not None
        seen.append(load.others_cores)
        if load.others_cores >= 0.5:
            break
    assert seen[-1] >= 0.5, f"others' load never reached half a core: {seen}"
    assert competitor.poll() is None  # it was measured while it ran
    assert load is not None
    assert load.free_cores == pytest.approx(max(0.0, budget.usable_cores - load.others_cores))


@needs_proc
def test_this_process_own_work_is_not_counted_as_others() -> None:
    meter = LoadMeter()
    assert meter.available
    spent = 0.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # burn CPU in this process until a quarter core-second is on record
        t0 = time.process_time()
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
        spent += time.process_time() - t0
        if spent >= 0.25:
            break
    load = meter.read()
    assert load is not None
    assert load.own_cores * load.window_s == pytest.approx(spent, abs=0.05)


@needs_proc
def test_a_meter_read_too_soon_says_nothing() -> None:
    meter = LoadMeter()
    assert meter.read(min_window_s=60) is None
