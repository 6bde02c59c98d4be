"""How much CPU other processes take from the cores this process may run on.

A compute loop that splits every operation across N threads waits, at the end of each parallel region, for its
slowest thread. When another process holds one of those cores, that thread waits for a scheduler slice and so
does the whole region: with one busy competitor on 2 cores, 2 threads ran a small MoE model 8.7x slower than
1 thread. Choosing the thread count therefore needs the load of *others*, not the machine's load average
(which counts this process too, and lags by a minute).

The figure is read from the kernel's counters, with no helper process and no sampling thread:

- ``/proc/stat``: busy time of each CPU (user, nice, system, irq, softirq, steal; idle and iowait are free)
  summed over the CPUs in this process's affinity mask. Steal counts as taken: a hypervisor that runs
  someone else on our virtual CPU stalls a barrier exactly as a local process does.
- ``os.times()``: this process's own CPU time (all its threads), subtracted from the busy time.
- the cgroup CPU quota (``cpu.max`` on cgroup v2, ``cpu.cfs_quota_us`` on v1), which caps the cores usable
  even where the affinity mask shows more.

Two samples a window apart give the load over that window (:func:`measure` sleeps for it; :class:`LoadMeter`
reuses its previous sample, so a loop can ask every few seconds without waiting). Where ``/proc/stat`` cannot
be read (not Linux) the load is ``None`` and callers fall back to the allowed core count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Fields of a /proc/stat cpu line after the name: user nice system idle iowait irq softirq steal guest guest_nice.
# guest time is already inside user (and guest_nice inside nice), so it is not added again.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """The CPUs this process may use: its affinity mask, capped by a cgroup quota when there is one."""

    cpus: tuple[int, ...]  # CPU ids in the affinity mask
    quota_cores: float | None = None  # cgroup CPU quota in cores; None when unlimited

    @property
    def usable_cores(self) -> float:
        n = float(len(self.cpus))
        return n if self.quota_cores is None else min(n, self.quota_cores)


@dataclass(frozen=True, slots=True)
class LoadSample:
    at: float  # time.monotonic() when taken
    busy_ticks: int  # busy clock ticks of the budget's CPUs, all processes
    own_s: float  # this process's CPU seconds (user + system, all threads)


@dataclass(frozen=True, slots=True)
class CpuLoad:
    """CPU use over one window, in cores (1.0 = one CPU busy for the whole window)."""

    window_s: float
    usable_cores: float
    busy_cores: float  # every process, on the allowed CPUs
    own_cores: float  # this process
    others_cores: float  # busy minus own, never below zero

    @property
    def free_cores(self) -> float:
        """Cores that other processes leave to this one."""
        return max(0.0, self.usable_cores - self.others_cores)


def read_budget() -> CpuBudget:
    if hasattr(os, "sched_getaffinity"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    else:
        cpus = tuple(range(os.cpu_count() or 1))
    return CpuBudget(cpus=cpus, quota_cores=cgroup_quota_cores())


def cgroup_quota_cores() -> float | None:
    """The tightest CPU quota on this process's cgroup path, in cores; None when there is none (or no cgroup
    information is readable). A quota anywhere up the path applies, so ancestors are read too."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: "0::/path"
            for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                quotas += _walk_up(mount, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                quotas += _walk_up(CGROUP_ROOT / name, path, _v1_quota)
    return min(quotas) if quotas else None


def _walk_up(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    out: list[float] = []
    rel = Path(path.lstrip("/"))
    for d in [rel, *rel.parents]:
        q = read(mount / d)
        if q is not None:
            out.append(q)
    return out


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def busy_ticks(cpus: tuple[int, ...], stat_text: str) -> int:
    """Busy clock ticks of ``cpus`` from the text of ``/proc/stat``."""
    wanted = {f"cpu{i}" for i in cpus}
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = rest.split()
            total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total


def sample(budget: CpuBudget) -> LoadSample | None:
    try:
        text = PROC_STAT.read_text()
    except OSError:
        return None
    t = os.times()
    return LoadSample(at=time.monotonic(), busy_ticks=busy_ticks(budget.cpus, text), own_s=t.user + t.system)


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def load_between(a: LoadSample, b: LoadSample, budget: CpuBudget) -> CpuLoad:
    window = max(b.at - a.at, 1e-6)
    busy = (b.busy_ticks - a.busy_ticks) * _TICK_S / window
    own = (b.own_s - a.own_s) / window
    # Both counters tick at 100 Hz, so over a short window each is off by up to a tick; clamp to what is
    # possible rather than report a negative or impossible load.
    cap = float(len(budget.cpus))
    busy = min(max(busy, 0.0), cap)
    own = min(max(own, 0.0), cap)
    return CpuLoad(
        window_s=window,
        usable_cores=budget.usable_cores,
        busy_cores=busy,
        own_cores=own,
        others_cores=max(0.0, busy - own),
    )


def measure(window_s: float = 0.3, budget: CpuBudget | None = None) -> CpuLoad | None:
    """The load over the next ``window_s`` seconds (this call sleeps for it); None where it cannot be read."""
    budget = budget or read_budget()
    a = sample(budget)
    if a is None:
        return None
    time.sleep(window_s)
    b = sample(budget)
    return None if b is None else load_between(a, b, budget)


class LoadMeter:
    """Load since the previous reading, for loops that check every few seconds without waiting."""

    def __init__(self, budget: CpuBudget | None = None) -> None:
        self.budget = budget or read_budget()
        self._last = sample(self.budget)

    @property
    def available(self) -> bool:
        return self._last is not None

    def read(self, min_window_s: float = 0.0) -> CpuLoad | None:
        """The load since the last reading (None if unreadable, or if less than ``min_window_s`` has passed:
        a 10 ms window holds one tick and says nothing)."""
        if self._last is None:
            return None
        if time.monotonic() - self._last.at < min_window_s:
            return None
        now = sample(self.budget)
        if now is None:
            return None
        load = load_between(self._last, now, self.budget)
        self._last = now
        return load


def cores_text(load: CpuLoad | None) -> str:
    """One line for logs: what was measured."""
    if load is None:
        return "CPU load not measurable here"
    return (
        f"{load.usable_cores:g} usable cores, others use {load.others_cores:.2f}, this process "
        f"{load.own_cores:.2f} (over {load.window_s:.2f} s)"
    )
