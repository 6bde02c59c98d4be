"""flood's float32 CPU kernels (``kernels.c``): routed experts and attention over the segment KV cache.

Why: a decode step of a fine-grained MoE is hundreds of tiny products. Through torch each expert's
product is an MKL call that packs its 256 KB weight before using it for ~6 rows (measured ~35 us where the
arithmetic needs ~4 us), and each request's attention is one SDPA call (~29 us). These kernels walk the
experts and the requests themselves, reading each weight row once per 8 rows, in one call per layer.

Built on first use with the system C compiler (``cc -O3 -march=native``, well under a second) into
lingctl's private cache directory (``$LINGCTL_CACHE_DIR/native``, created 0700 and owner-checked), keyed by
the source, the compiler and the CPU, and loaded with ctypes (the GIL is released during a call). Where
there is no compiler, the build fails, the cache directory is refused or cannot be made, or
``LINGCTL_FLOOD_NATIVE=0`` is set, ``kernels()`` returns None and flood uses torch's operators, computing the
same function to rounding. Falling back costs speed, so it is said once per process as a warning (unless
switched off on purpose), and ``why_unavailable()`` tells ``lingctl doctor`` the reason.

Only the source shipped here is compiled: nothing read from models or batches ever reaches the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lingctl.core.cache import cache_root
from lingctl.core.errors import LingctlError
from lingctl.core.private_dir import ensure_private_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=fast: every a*b+c is one fused multiply-add, the same in vector and scalar code, so a
# row's sums do not depend on how the compiler vectorised the loop that computed them.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-fast-math", "-fPIC", "-shared", "-std=gnu11"]
ENV_SWITCH = "LINGCTL_FLOOD_NATIVE"

# What falling back costs, in the warning (flood/threads.py: float32 keeps one thread without them).
_COST = (
    "flood uses torch's operators instead, which is slower, and float32 runs keep to one thread unless "
    f"--threads is given (set {ENV_SWITCH}=0 to choose this without a warning)"
)
_why_not: str | None = None  # the reason the last kernels() call returned None

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def _cache_dir() -> Path:
    base = cache_root()
    ensure_private_dir(base, deny=0o022)  # shared with lingctl's other caches: others may read, not write
    return ensure_private_dir(base / "native")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _openmp_flags() -> list[str]:
    """``-fopenmp`` when torch itself runs on libgomp: the kernels' library then names the same
    ``libgomp.so.1``, which the loader finds already loaded by torch, so both share one OpenMP runtime and
    one thread pool (two runtimes would each keep spinning threads on the same cores)."""
    lib = Path(torch.__file__).parent / "lib"
    return ["-fopenmp"] if (lib / "libgomp.so.1").exists() or "GNU OpenMP" in torch.__config__.parallel_info() else []


def _build() -> Path | None:
    cc = _compiler()
    if cc is None:
        _fall_back("no C compiler was found (cc, gcc or clang on PATH, or CC)")
        return None
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        _fall_back(f"the C compiler {cc} does not run ({exc})")
        return None
    flags = FLAGS + _openmp_flags()
    key = hashlib.sha256(
        b"\0".join(
            [source, " ".join(flags).encode(), version.encode(), _cpu_id().encode(), platform.machine().encode()]
        )
    ).hexdigest()[:20]
    try:
        directory = _cache_dir()
    except (LingctlError, RuntimeError) as exc:  # refused (not private, not ours), missing (~/.cache), no home
        _fall_back(f"their cache directory cannot be used: {exc} (set LINGCTL_CACHE_DIR to a directory of your own)")
        return None
    target = directory / f"flood_kernels-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=".flood_kernels-", suffix=".so.tmp", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            last = result.stderr.strip().splitlines()[-1:]
            _fall_back(f"building them with {cc} failed" + (f": {last[0]}" if last else ""))
            return None
        os.replace(tmp, target)  # atomic: a concurrent build of the same key wins or loses whole
        return target
    except (OSError, subprocess.SubprocessError) as exc:
        _fall_back(f"building them with {cc} failed ({exc})")
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


MAX_TOP_K = 64  # the combine step sorts a token's slots in a fixed-size buffer


class Kernels:
    """The loaded library. A call spreads its work over ``torch.get_num_threads()`` threads (the count the
    thread policy chose): through OpenMP inside the library when it was built with it, else split here into
    contiguous ranges run on a small thread pool. Either way each expert or unit is computed whole by one
    thread with the same code, so the results are the same bits at any thread count."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._experts = lib.flood_moe_experts
        self._experts.restype = None
        self._experts.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]
        self._combine = lib.flood_moe_combine
        self._combine.restype = None
        self._combine.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64]
        self._attn = lib.flood_attention
        self._attn.restype = None
        self._attn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_float, _ptr, _ptr, _i64]
        # With OpenMP the library spreads each call over torch's threads itself.
        self.openmp = bool(lib.flood_openmp())
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def _run(self, calls: list[Callable[[], None]]) -> None:
        """Run the calls, one per thread (ctypes releases the GIL during each)."""
        if len(calls) == 1:
            calls[0]()
            return
        if self._pool is None or self._pool_size < len(calls) - 1:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = ThreadPoolExecutor(max_workers=len(calls) - 1, thread_name_prefix="flood-kernel")
            self._pool_size = len(calls) - 1
        futures = [self._pool.submit(c) for c in calls[1:]]
        calls[0]()
        for f in futures:
            f.result()

    @staticmethod
    def moe_supported(hidden: int, width: int, top_k: int = 1) -> bool:
        """Widths the expert kernel computes with one code path per output column: every column block full
        (32 floats). Otherwise a row's last columns could round differently alone and in a crowd."""
        return hidden % 32 == 0 and (2 * width) % 32 == 0 and hidden > 0 and width > 0 and top_k <= MAX_TOP_K

    def moe(
        self,
        x_TD: torch.Tensor,
        idx_TK: torch.Tensor,
        weight_TK: torch.Tensor,
        gate_up_EDX: torch.Tensor,
        down_EID: torch.Tensor,
    ) -> torch.Tensor:
        """Routed experts' weighted sum [T, D] (float32, contiguous inputs; ids checked in range)."""
        t, d = x_TD.shape
        k = idx_TK.shape[1]
        e, _, x2 = gate_up_EDX.shape
        i = x2 // 2
        assert x_TD.dtype == gate_up_EDX.dtype == down_EID.dtype == torch.float32
        assert gate_up_EDX.is_contiguous() and down_EID.is_contiguous() and down_EID.shape == (e, i, d)
        assert self.moe_supported(d, i, k)
        x = x_TD.contiguous()
        idx = idx_TK.to(torch.int64).contiguous()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= e):
            raise ValueError("expert id out of range")
        w = weight_TK.to(torch.float32).contiguous()
        n = t * k
        outs = torch.empty(n, d, dtype=torch.float32)
        y = torch.empty(t, d, dtype=torch.float32)
        ranges = (
            [(0, e)]
            if self.openmp
            else _split(torch.bincount(idx.view(-1), minlength=e).cumsum(0).tolist(), torch.get_num_threads())
        )

        def experts(e0: int, e1: int) -> Callable[[], None]:
            scratch = torch.empty((n + 8) * (d + 3 * i), dtype=torch.float32)
            slot = torch.empty(max(1, n), dtype=torch.int64)
            return lambda: self._experts(
                x.data_ptr(),
                t,
                d,
                idx.data_ptr(),
                k,
                gate_up_EDX.data_ptr(),
                down_EID.data_ptr(),
                e,
                i,
                e0,
                e1,
                outs.data_ptr(),
                scratch.data_ptr(),
                slot.data_ptr(),
            )

        self._run([experts(a, b) for a, b in ranges])
        rows = [(0, t)] if self.openmp else _split(list(range(1, t + 1)), len(ranges))
        self._run(
            [
                functools.partial(
                    self._combine, idx.data_ptr(), w.data_ptr(), k, d, outs.data_ptr(), y.data_ptr(), a, b
                )
                for a, b in rows
            ]
        )
        return y

    def attention(
        self,
        q_THD: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        units_U4: torch.Tensor,
        keys: torch.Tensor,
        scale: float,
        out_THD: torch.Tensor,
        max_keys: int,
    ) -> None:
        """Fill the rows of ``out_THD`` that the units cover (see kernels.c for the unit layout)."""
        t, h, dh = q_THD.shape
        assert q_THD.dtype == k_pool.dtype == v_pool.dtype == out_THD.dtype == torch.float32
        assert q_THD.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()
        assert out_THD.is_contiguous() and units_U4.dtype == keys.dtype == torch.int64
        units = units_U4.contiguous()
        # work of a unit ~ queries x keys
        work = (units[:, 1] * units[:, 3]).cumsum(0).tolist() if units.shape[0] else []

        def part(a: int, b: int) -> Callable[[], None]:
            scores = torch.empty(max(1, max_keys), dtype=torch.float32)
            return lambda: self._attn(
                q_THD.data_ptr(),
                h,
                dh,
                k_pool.data_ptr(),
                v_pool.data_ptr(),
                k_pool.shape[1],
                units[a:].data_ptr(),
                b - a,
                keys.data_ptr(),
                scale,
                out_THD.data_ptr(),
                scores.data_ptr(),
                max(1, max_keys),
            )

        parts = [(0, len(work))] if self.openmp else _split(work, torch.get_num_threads())
        self._run([part(a, b) for a, b in parts if b > a] or [lambda: None])


def _split(cumulative: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous index ranges over ``len(cumulative)`` items with about equal shares of the total, given the
    running totals; at most ``parts`` ranges, none empty of items (an item's work may be zero)."""
    n = len(cumulative)
    if n == 0:
        return []
    parts = max(1, min(parts, n))
    total = cumulative[-1]
    bounds = [0]
    for p in range(1, parts):
        target = total * p / parts
        cut = bounds[-1] + 1
        while cut < n - (parts - p) and cumulative[cut - 1] < target:
            cut += 1
        bounds.append(cut)
    bounds.append(n)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _fall_back(reason: str, *, warn: bool = True) -> None:
    """Record why the kernels are not used, and say it (``kernels()`` is cached: once per process)."""
    global _why_not
    _why_not = reason
    if warn:
        log.warning("flood's native kernels are unavailable: %s; %s", reason, _COST)
    else:
        log.info("flood's native kernels are not used: %s", reason)


def why_unavailable() -> str | None:
    """Why ``kernels()`` returned None (None when it did not, or was not called yet)."""
    return _why_not


@functools.lru_cache(maxsize=1)
def kernels() -> Kernels | None:
    """The loaded kernels, or None (no compiler, a failed build, the cache directory refused, or switched off
    by the environment)."""
    global _why_not
    _why_not = None
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        _fall_back(f"switched off by {ENV_SWITCH}={os.environ[ENV_SWITCH]}", warn=False)
        return None
    try:
        path = _build()
        return Kernels(ctypes.CDLL(str(path))) if path is not None else None
    except Exception as exc:  # any failure here only costs speed
        _fall_back(f"loading them failed ({exc})")
        return None
