"""How many compute threads flood uses: the cores that other processes leave free.

Every OpenMP parallel region ends in a barrier, and a decode step of a small MoE model is hundreds of small
regions. When another process holds one of the cores, the thread on it misses each barrier by a scheduler
slice: with one busy competitor on 2 cores, 2 threads ran the tiny MoE 8.7-25x slower than 1 thread. The cure
is not to use a core that someone else is using: the default count is the number of *free* cores
(``core.cpu_load`` measures what other processes take), re-decided every few seconds between engine steps,
and ``--threads N`` fixes it.

Peers decide once and ignore load: llama.cpp takes the physical core count (``cpu_get_num_math``; its own
thread pool polls, ``--poll`` 50 by default, and its OpenMP build waits in ``#pragma omp barrier``), vLLM-CPU
binds one OpenMP thread per physical core of its NUMA node and keeps one core back for its scheduler process
(``VLLM_CPU_OMP_THREADS_BIND=auto``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``). Neither notices a competitor.

Results and thread count. Outputs must not depend on machine load, so the count may follow the load only
where results do not depend on the count. bf16 steps give the same bits at any count (products, grouped
products and attention, measured at 1, 2, 3, 4 and 8 threads; whole engine runs at 1 and 2 threads; the routed
experts' native kernel computes each expert whole on one thread). fp32
steps do not: with 2 threads MKL's sgemm gives other bits for products of 5-7 and 9-11 rows (so a row's result
then also depends on how many rows share its step), and so does SDPA's fp32 kernel for decode shapes. Products
padded to a multiple of 4 rows and the math attention kernel made fp32 runs bit-identical at 1, 2 and
alternating counts; until the forward pass does that, fp32 runs on one thread unless ``--threads`` says
otherwise: one thread is the count at which fp32 is batch-invariant, and it cannot collapse.

OpenMP's wait policy stays libgomp's default (spin, then sleep). Measured on the tiny MoE, fp32, 2 cores:
idle, 2 spinning threads 1.08-1.35x one thread, 2 passive (``OMP_WAIT_POLICY=PASSIVE``) threads 0.7x (each
region pays a futex wake-up); beside a busy process 2 threads ran at 0.01-0.05x one thread spinning, 0.47x
passive. Passive waiting would make a second thread useless here, and the policy avoids the busy case.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lingctl.flood.engine.cpu_load import CpuLoad, LoadMeter, cores_text, measure, read_budget

log = logging.getLogger(__name__)

# Activation dtypes whose engine results are bit-identical at any thread count (see the module docstring;
# tests/flood/test_threads.py checks it): for these the count follows the machine's load during a run.
THREAD_INVARIANT_DTYPES = frozenset({"bfloat16"})


def results_follow_load_safely(dtype_name: str, quantize: str | None = None) -> bool:
    """Whether a run's results are the same bits at any thread count, so the count may follow the load.

    bfloat16: always (measured per operation and for whole runs). float32: when flood's native kernels are
    active (experts, attention and every int8 linear then run in kernels whose rows do not depend on the
    thread count, and every other product is a packed oneDNN one, which does not either; asserted by
    tests/flood/test_native.py). Without the kernels (float32 products then go through MKL, which rounds
    5-7 and 9-11 row products differently on 2 threads), float32 keeps one thread."""
    if dtype_name in THREAD_INVARIANT_DTYPES:
        return True
    if dtype_name == "float32":
        from lingctl.flood.engine.native import kernels

        return kernels() is not None
    return False


def choose_threads(
    usable_cores: float, others_cores: float, *, margin: float = 0.25, max_threads: int | None = None
) -> int:
    """Whole cores left free by others: ``floor(usable - others + margin)``, at least 1, at most the usable
    cores (or ``max_threads``). ``margin``: how much of a core others may use while it still counts as free
    (a shell, a logger); above it the core goes to them."""
    if usable_cores <= 0:
        return 1
    cap = max(1, math.floor(usable_cores + 1e-9))
    if max_threads is not None:
        cap = max(1, min(cap, max_threads))
    return max(1, min(cap, math.floor(usable_cores - others_cores + margin)))


@dataclass(kw_only=True, slots=True)
class ThreadPolicyConfig:
    recheck_s: float = 2.0  # between re-decisions; each reads /proc/stat once
    probe_s: float = 0.2  # the shortest window for the first decision (20 ticks of /proc/stat per core)
    margin: float = 0.25  # see choose_threads
    max_threads: int | None = None
    # A competitor that arrives mid-run makes every step of a multi-threaded run several times slower at once;
    # a step this many times the recent typical one starts a fresh measurement of ``quick_window_s`` instead
    # of waiting for the next recheck (a clock read per step; /proc/stat only when it fires).
    slow_step_factor: float = 3.0
    quick_window_s: float = 0.3


@dataclass(kw_only=True, slots=True)
class ThreadChange:
    at_s: float  # seconds since the policy started
    threads: int
    others_cores: float


@dataclass(kw_only=True, slots=True)
class ThreadReport:
    """What the run used, for the summary."""

    threads: int  # at the start
    source: str  # "--threads", "free cores" (re-decided during the run) or "one thread: <why>"
    others_cores: float | None  # measured at the start (None when nothing was measured)
    usable_cores: float
    final_threads: int = 0
    changes: list[ThreadChange] = field(default_factory=list)


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


class ThreadPolicy:
    """Sets torch's thread count: :meth:`prepare` before loading the model, :meth:`start` before the first
    step, :meth:`between_steps` after each step (cheap: a clock read, and one /proc/stat read every
    ``recheck_s`` at most). A count given up front (``fixed``) is set and never changed."""

    def __init__(
        self,
        config: ThreadPolicyConfig | None = None,
        *,
        fixed: int | None = None,
        why_fixed: str = "--threads",
        set_threads: Callable[[int], None] = _torch_set_threads,
        clock: Callable[[], float] = time.monotonic,
        meter: LoadMeter | None = None,
    ) -> None:
        self.config = config or ThreadPolicyConfig()
        self.fixed = fixed
        self.why_fixed = why_fixed
        self._set = set_threads
        self._clock = clock
        self._meter = meter
        self._started = 0.0
        self._next = math.inf
        self._last_step = 0.0
        self._typical_step: float | None = None
        self._quick_at = -math.inf  # when a quick measurement was last started
        self.threads = 0
        self.report: ThreadReport | None = None

    @staticmethod
    def for_run(
        threads: int | None,
        dtype_name: str,
        quantize: str | None = None,
        *,
        max_threads: int | None = None,
        **kwargs: Any,
    ) -> ThreadPolicy:
        """``--threads N`` (N > 0) fixes the count; None or 0 chooses: the free cores where results do not
        depend on the count (at most ``max_threads``: the cores a cluster engine was given), else one thread."""
        if threads:
            return ThreadPolicy(fixed=threads, **kwargs)
        if results_follow_load_safely(dtype_name, quantize):
            return ThreadPolicy(ThreadPolicyConfig(max_threads=max_threads), **kwargs)
        what = f"{dtype_name}{' int8' if quantize else ''}"
        return ThreadPolicy(fixed=1, why_fixed=f"one thread: {what} results depend on the thread count", **kwargs)

    def prepare(self) -> None:
        """Start measuring (the model's load then serves as the window, so :meth:`start` rarely waits); a
        fixed count is set at once, so the load runs with it too."""
        if self.fixed is not None:
            self._set(self.fixed)
        elif self._meter is None:
            self._meter = LoadMeter()

    def start(self) -> int:
        """Decide and set the thread count; returns it."""
        self._started = self._clock()
        if self.fixed is not None:
            self.threads = self.fixed
            self.report = ThreadReport(
                threads=self.fixed,
                source=self.why_fixed,
                others_cores=None,
                usable_cores=read_budget().usable_cores,
                final_threads=self.fixed,
            )
            self._set(self.fixed)
            if self.why_fixed != "--threads":
                log.info("compute threads: %d (%s; give --threads to choose)", self.fixed, self.why_fixed)
            return self.fixed
        self.prepare()
        assert self._meter is not None
        load = self._meter.read(min_window_s=self.config.probe_s)
        if load is None and self._meter.available:  # the window so far is too short to say anything
            time.sleep(self.config.probe_s)
            load = self._meter.read()
        usable = self._meter.budget.usable_cores
        self.threads = self.decide(load, usable)
        self.report = ThreadReport(
            threads=self.threads,
            source="free cores",
            others_cores=None if load is None else round(load.others_cores, 2),
            usable_cores=usable,
            final_threads=self.threads,
        )
        self._set(self.threads)
        log.info(
            "compute threads: %d of %g usable cores (%s; re-decided every %g s)",
            self.threads,
            usable,
            cores_text(load),
            self.config.recheck_s,
        )
        if load is not None:
            self._next = self._started + self.config.recheck_s
        self._last_step = self._started
        return self.threads

    def decide(self, load: CpuLoad | None, usable_cores: float) -> int:
        others = 0.0 if load is None else load.others_cores
        return choose_threads(usable_cores, others, margin=self.config.margin, max_threads=self.config.max_threads)

    def between_steps(self) -> None:
        now = self._clock()
        step, self._last_step = now - self._last_step, now
        if self._next == math.inf:  # fixed, or nothing measurable
            return
        if now < self._next:
            if self.threads > 1 and self._slow(step) and now - self._quick_at >= self.config.recheck_s:
                # Start a window that holds only what came after the slowdown (a longer one would dilute it).
                assert self._meter is not None
                self._meter.read()
                self._quick_at = now
                self._next = now + self.config.quick_window_s
            return
        self._next = now + self.config.recheck_s
        assert self._meter is not None
        load = self._meter.read()
        if load is None:
            return
        n = self.decide(load, load.usable_cores)
        if n == self.threads:
            return
        log.info("compute threads: %d -> %d (%s)", self.threads, n, cores_text(load))
        self.threads = n
        self._set(n)
        self._typical_step = None  # another count, other step times
        if self.report is not None:
            self.report.final_threads = n
            self.report.changes.append(
                ThreadChange(at_s=round(now - self._started, 2), threads=n, others_cores=round(load.others_cores, 2))
            )

    def _slow(self, step: float) -> bool:
        """Whether this step took far longer than the recent ones (whose typical time it then joins)."""
        typical = self._typical_step
        self._typical_step = step if typical is None else 0.8 * typical + 0.2 * step
        return typical is not None and step > self.config.slow_step_factor * typical


def stage_threads(stages: int, dtype_name: str, quantize: str | None = None) -> int:
    """Threads per pipeline stage process, fixed for the run: the free cores shared among the stages where
    results do not depend on the count, else one."""
    if not results_follow_load_safely(dtype_name, quantize):
        return 1
    budget = read_budget()
    load = measure(0.2, budget)
    free = choose_threads(budget.usable_cores, 0.0 if load is None else load.others_cores)
    n = max(1, free // stages)
    log.info("pipeline: %d threads per stage for %d stages (%s)", n, stages, cores_text(load))
    return n
