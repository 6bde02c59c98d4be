"""flood's CPU kernels (``kernels.c``, ``bf16.c``): routed experts (float32, int8 or bfloat16 weights), int8
linear layers and attention over the segment KV cache, on float32 activations (bfloat16 ones for bfloat16
experts).

Why: a decode step of a fine-grained MoE is hundreds of tiny products. Through torch each expert's
product is an MKL call that packs its 256 KB weight before using it for ~6 rows (measured ~35 us where the
arithmetic needs ~4 us), and each request's attention is one SDPA call (~29 us). These kernels walk the
experts and the requests themselves, reading each weight once per step for all the rows routed to it (up to
24 rows per read), in one call per layer.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lingctl.core.cache import cache_root
from lingctl.core.errors import LingctlError
from lingctl.core.private_dir import ensure_private_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
HEADER = SOURCE.with_name("kernels.h")  # the entry points, documented; kernels.c includes it
# Every source file of the library and what they include (internal.h: what the files share with each other).
SOURCES = (SOURCE, SOURCE.with_name("bf16.c"))
HEADERS = (HEADER, SOURCE.with_name("internal.h"))
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
_f32 = ctypes.c_float
# The routed-expert entry points for float32 and bfloat16 weights take the same arguments.
_EXPERTS_ARGS: list[tuple[str, type[ctypes._SimpleCData]]] = [
    ("x", _ptr),
    ("T", _i64),
    ("D", _i64),
    ("idx", _ptr),
    ("Kt", _i64),
    ("gate_up", _ptr),
    ("down", _ptr),
    ("E", _i64),
    ("I", _i64),
    ("e0", _i64),
    ("e1", _i64),
    ("outs", _ptr),
    ("scratch", _ptr),
    ("slot", _ptr),
]
# Every entry point of kernels.h, its arguments in order (named as there) and its result: ctypes is told all of
# them, so a call with a missing or extra argument fails in Python instead of reading garbage.
_SIGNATURES: dict[str, tuple[type[ctypes._SimpleCData] | None, list[tuple[str, type[ctypes._SimpleCData]]]]] = {
    "flood_moe_experts": (None, _EXPERTS_ARGS),
    "flood_moe_experts_bf16": (None, _EXPERTS_ARGS),
    "flood_moe_experts_q8": (
        None,
        [
            ("x", _ptr),
            ("T", _i64),
            ("D", _i64),
            ("idx", _ptr),
            ("Kt", _i64),
            ("gate_up", _ptr),
            ("gate_up_scale", _ptr),
            ("down", _ptr),
            ("down_scale", _ptr),
            ("E", _i64),
            ("I", _i64),
            ("e0", _i64),
            ("e1", _i64),
            ("outs", _ptr),
            ("scratch", _ptr),
            ("slot", _ptr),
            ("act_int8", ctypes.c_int),
        ],
    ),
    "flood_linear_q8": (
        None,
        [
            ("x", _ptr),
            ("M", _i64),
            ("K", _i64),
            ("w", _ptr),
            ("scale", _ptr),
            ("bias", _ptr),
            ("N", _i64),
            ("y", _ptr),
            ("o0", _i64),
            ("o1", _i64),
            ("qx", _ptr),
            ("qs", _ptr),
        ],
    ),
    "flood_vnni": (ctypes.c_int, []),
    "flood_bf16_dot": (ctypes.c_int, []),
    "flood_quantize_rows_bf16": (
        ctypes.c_int,
        [("src", _ptr), ("rows", _i64), ("K", _i64), ("dst", _ptr), ("scale", _ptr), ("scale_bf16", ctypes.c_int)],
    ),
    "flood_moe_combine": (
        None,
        [
            ("idx", _ptr),
            ("wt", _ptr),
            ("Kt", _i64),
            ("D", _i64),
            ("outs", _ptr),
            ("y", _ptr),
            ("t0", _i64),
            ("t1", _i64),
        ],
    ),
    "flood_attention": (
        None,
        [
            ("q", _ptr),
            ("H", _i64),
            ("Dh", _i64),
            ("kpool", _ptr),
            ("vpool", _ptr),
            ("Kh", _i64),
            ("units", _ptr),
            ("U", _i64),
            ("keys", _ptr),
            ("scale", _f32),
            ("out", _ptr),
            ("scores0", _ptr),
            ("max_keys", _i64),
        ],
    ),
    "flood_openmp": (ctypes.c_int, []),
}


def _declare(lib: ctypes.CDLL) -> dict[str, Any]:
    """The library's entry points, each with its argument and result types set from ``_SIGNATURES``."""
    functions = {}
    for name, (restype, args) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = [kind for _, kind in args]
        functions[name] = fn
    return functions


def _require(ok: bool, what: str) -> None:
    """A precondition of a kernel call: a ValueError naming it when it does not hold (never an ``assert``,
    which ``python -O`` strips: the kernels read and write raw memory on the strength of these checks)."""
    if not ok:
        raise ValueError(f"flood kernel call: {what}")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    """``t`` is a contiguous CPU tensor of ``shape`` and ``dtype`` (float32 unless said), else a ValueError."""
    _require(t.dtype == dtype, f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")
    _require(tuple(t.shape) == shape, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(t.device.type == "cpu", f"{name} must be on the CPU, got {t.device}")


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
    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
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
            [cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True, timeout=300
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
        functions = _declare(lib)
        self._experts = functions["flood_moe_experts"]
        self._experts_q8 = functions["flood_moe_experts_q8"]
        self._experts_bf16 = functions["flood_moe_experts_bf16"]
        self._linear_q8 = functions["flood_linear_q8"]
        self._quantize_rows = functions["flood_quantize_rows_bf16"]
        self._combine = functions["flood_moe_combine"]
        self._attn = functions["flood_attention"]
        # With OpenMP the library spreads each call over torch's threads itself.
        self.openmp = bool(functions["flood_openmp"]())
        # int8 x int8 products on AVX-512 VNNI, or the portable loop (the same integers either way).
        self.vnni = bool(functions["flood_vnni"]())
        # bfloat16 pair products on AVX-512 BF16, or float32 FMAs in the same order.
        self.bf16_dot = bool(functions["flood_bf16_dot"]())
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
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        act_int8: bool = False,
    ) -> torch.Tensor:
        """Routed experts' weighted sum [T, D] (float32) of a float32 input (``act_int8``: int8 weights only, each
        row quantized to int8 for exact integer products, see kernels.h): float32 weights input-major (``[E, D,
        2I]``, ``[E, I, D]``; bfloat16 ones in the same layout take a bfloat16 input), or int8 weights output-major (``[E, 2I, D]``, ``[E, D, I]``: the names then mean the
        transposes) with ``scales`` (float32 ``[E, 2I]`` and ``[E, D]``, one per output); the input and the
        routing are made contiguous here, expert ids checked in range; a ValueError for anything the kernels
        cannot take."""
        x, idx, w = _moe_inputs(x_TD, idx_TK, weight_TK, gate_up_EDX, down_EID, scales)
        t, d = x.shape
        k = idx.shape[1]
        e = gate_up_EDX.shape[0]
        i = down_EID.shape[2] if scales is not None else down_EID.shape[1]
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

            # The call holds the tensors, not their addresses alone: scratch and slot must live until it runs.
            def call() -> None:
                common = (e, i, e0, e1, outs.data_ptr(), scratch.data_ptr(), slot.data_ptr())
                if scales is not None:
                    g, dn = gate_up_EDX.data_ptr(), down_EID.data_ptr()
                    gs, ds = scales[0].data_ptr(), scales[1].data_ptr()
                    self._experts_q8(x.data_ptr(), t, d, idx.data_ptr(), k, g, gs, dn, ds, *common, int(act_int8))
                elif x.dtype == torch.bfloat16:
                    self._experts_bf16(
                        x.data_ptr(), t, d, idx.data_ptr(), k, gate_up_EDX.data_ptr(), down_EID.data_ptr(), *common
                    )
                else:
                    self._experts(
                        x.data_ptr(), t, d, idx.data_ptr(), k, gate_up_EDX.data_ptr(), down_EID.data_ptr(), *common
                    )

            return call

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

    def linear_q8(
        self,
        x_MK: torch.Tensor,
        weight_NK: torch.Tensor,
        scale_N: torch.Tensor,
        bias_N: torch.Tensor | None,
        *,
        act_int8: bool = False,
    ) -> torch.Tensor:
        """``x @ (weight * scale[:, None]).T + bias`` [M, N] for int8 ``weight_NK`` (Int8Linear's layout) and a
        float32 input, ``scale_N`` and ``bias_N``; each output summed in a fixed order (see kernels.h).
        ``act_int8``: the rows of x are quantized to int8 (one scale per row) and the products are exact
        integer ones."""
        _require(x_MK.dim() == 2 and weight_NK.dim() == 2, "x_MK and weight_NK must be 2-D")
        m, k = x_MK.shape
        n = weight_NK.shape[0]
        x = x_MK.contiguous()
        _check("x_MK", x, (m, k))
        _check("weight_NK", weight_NK, (n, k), torch.int8)
        _check("scale_N", scale_N, (n,))
        if bias_N is not None:
            _check("bias_N", bias_N, (n,))
        y = torch.empty(m, n, dtype=torch.float32)
        bias = bias_N.data_ptr() if bias_N is not None else None
        args = (x.data_ptr(), m, k, weight_NK.data_ptr(), scale_N.data_ptr(), bias, n, y.data_ptr())
        if act_int8:
            # The call quantizes the rows itself, so it takes every output column (kernels.h).
            qx, qs = torch.empty(m, k, dtype=torch.uint8), torch.empty(m, dtype=torch.float32)
            self._linear_q8(*args, 0, n, qx.data_ptr(), qs.data_ptr())
        elif self.openmp or n == 0:
            self._linear_q8(*args, 0, n, None, None)
        else:
            parts = _split(list(range(1, n + 1)), torch.get_num_threads())
            self._run([functools.partial(self._linear_q8, *args, a, b, None, None) for a, b in parts])
        return y

    def quantize_rows_bf16(
        self, src_OI: torch.Tensor, out_OI: torch.Tensor, scale_dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``quantize_rows`` for bfloat16 rows in one pass: int8 into ``out_OI``, the scales returned in
        ``scale_dtype`` (float32 or bfloat16), the same bits; None (nothing to use) when a row is not finite."""
        _require(src_OI.dim() == 2, "src_OI must be 2-D")
        rows, k = src_OI.shape
        _check("src_OI", src_OI, (rows, k), torch.bfloat16)
        _check("out_OI", out_OI, (rows, k), torch.int8)
        _require(scale_dtype in (torch.float32, torch.bfloat16), f"scales in {scale_dtype} are not supported")
        scale = torch.empty(rows, dtype=torch.float32)
        bf16 = int(scale_dtype == torch.bfloat16)
        if self._quantize_rows(src_OI.data_ptr(), rows, k, out_OI.data_ptr(), scale.data_ptr(), bf16) != 0:
            return None
        return scale.to(scale_dtype)  # exact: already rounded to scale_dtype

    def attention(
        self,
        q_THD: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        table: UnitTable,
        scale: float,
        out_THD: torch.Tensor,
    ) -> None:
        """Fill the rows of ``out_THD`` that the table's units cover; a ValueError for anything the kernel
        cannot take (the table itself was checked when it was made)."""
        _require(q_THD.dim() == 3 and k_pool.dim() == 3, "q_THD and the KV pools must be 3-D")
        t, h, dh = q_THD.shape
        capacity, kh, _ = k_pool.shape
        _check("q_THD", q_THD, (t, h, dh))
        _check("out_THD", out_THD, (t, h, dh))
        _check("k_pool", k_pool, (capacity, kh, dh))
        _check("v_pool", v_pool, (capacity, kh, dh))
        _require(kh > 0 and h % kh == 0, f"{h} query heads cannot share {kh} KV heads")
        _require(table.rows <= t, f"the units cover {table.rows} rows; the step has {t}")
        _require(table.slots <= capacity, f"the units read slot {table.slots - 1}; the pool holds {capacity}")
        units, keys, max_keys = table.units_U4, table.keys, table.max_keys

        def part(a: int, b: int) -> Callable[[], None]:
            scores = torch.empty(max(1, max_keys), dtype=torch.float32)
            return lambda: self._attn(
                q_THD.data_ptr(),
                h,
                dh,
                k_pool.data_ptr(),
                v_pool.data_ptr(),
                kh,
                units[a:].data_ptr(),
                b - a,
                keys.data_ptr(),
                scale,
                out_THD.data_ptr(),
                scores.data_ptr(),
                max(1, max_keys),
            )

        work = table.work
        parts = [(0, len(work))] if self.openmp else _split(work, torch.get_num_threads())
        self._run([part(a, b) for a, b in parts if b > a] or [lambda: None])


def _moe_inputs(
    x_TD: torch.Tensor,
    idx_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    gate_up_EDX: torch.Tensor,
    down_EID: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert kernel's input rows, expert ids (int64) and routing weights (float32), contiguous, once
    every shape, dtype and id is checked against the weights (int8 ones with their scales)."""
    _require(x_TD.dim() == 2 and idx_TK.dim() == 2, "x_TD and idx_TK must be 2-D")
    _require(gate_up_EDX.dim() == 3 and down_EID.dim() == 3, "the expert weights must be 3-D")
    t, d = x_TD.shape
    k = idx_TK.shape[1]
    e = gate_up_EDX.shape[0]
    dtype = torch.bfloat16 if scales is None and x_TD.dtype == torch.bfloat16 else torch.float32
    if scales is None:
        i = down_EID.shape[1]
        _check("gate_up_EDX", gate_up_EDX, (e, d, 2 * i), dtype)
        _check("down_EID", down_EID, (e, i, d), dtype)
        _require(Kernels.moe_supported(d, i, k), f"widths D={d}, 2I={2 * i} and top-k {k} are not supported")
    else:
        i = down_EID.shape[2]
        _check("gate_up_EXD", gate_up_EDX, (e, 2 * i, d), torch.int8)
        _check("down_EDI", down_EID, (e, d, i), torch.int8)
        _check("gate_up_scale", scales[0], (e, 2 * i))
        _check("down_scale", scales[1], (e, d))
        _require(d > 0 and i > 0 and k <= MAX_TOP_K, f"widths D={d}, I={i} and top-k {k} are not supported")
    x = x_TD.contiguous()
    _check("x_TD", x, (t, d), dtype)
    _require(tuple(weight_TK.shape) == (t, k), f"weight_TK must have shape {[t, k]}, got {list(weight_TK.shape)}")
    _require(not idx_TK.is_floating_point(), f"idx_TK must hold integers, got {idx_TK.dtype}")
    idx = idx_TK.to(torch.int64).contiguous()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= e):
        raise ValueError("expert id out of range")
    return x, idx, weight_TK.to(torch.float32).contiguous()


@dataclass(frozen=True, slots=True)
class UnitTable:
    """A step's attention units as ``flood_attention`` reads them (see kernels.h), checked once when made:
    every layer of the step reuses it. Made by ``of``, from copies that nothing else can change."""

    units_U4: torch.Tensor  # int64 [U, 4]: (q_start, q_len, key_offset, key_len)
    keys: torch.Tensor  # int64 slots, each unit's in position order
    max_keys: int  # the most keys of any unit: the size of the score buffers
    rows: int  # one past the last step row a unit covers
    slots: int  # one past the largest slot a unit reads
    work: list[int]  # running totals of queries x keys, unit by unit (splits the units between threads)

    @staticmethod
    def of(units_U4: torch.Tensor, keys: torch.Tensor, max_keys: int) -> UnitTable:
        _require(units_U4.dtype == torch.int64 and keys.dtype == torch.int64, "units and keys must be int64")
        _require(units_U4.dim() == 2 and units_U4.shape[1] == 4, f"units must be [U, 4], got {list(units_U4.shape)}")
        _require(keys.dim() == 1, f"keys must be one row of slots, got shape {list(keys.shape)}")
        units, keys = units_U4.clone(memory_format=torch.contiguous_format), keys.clone().contiguous()
        if units.shape[0] == 0:
            return UnitTable(units_U4=units, keys=keys, max_keys=max_keys, rows=0, slots=0, work=[])
        q_start, q_len, key_offset, key_len = units.unbind(1)
        _require(int(units.min()) >= 0, "a unit has a negative entry")
        _require(int((key_offset + key_len).max()) <= keys.numel(), f"a unit's keys run past the {keys.numel()} keys")
        _require(int(key_len.max()) <= max_keys, f"a unit has more than max_keys={max_keys} keys")
        _require(not bool((key_len < q_len).any()), "a unit has fewer keys than queries")
        _require(keys.numel() == 0 or int(keys.min()) >= 0, "a key slot is negative")
        return UnitTable(
            units_U4=units,
            keys=keys,
            max_keys=max_keys,
            rows=int((q_start + q_len).max()),
            slots=int(keys.max()) + 1 if keys.numel() else 0,
            work=(q_len * key_len).cumsum(0).tolist(),  # work of a unit ~ queries x keys
        )


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
