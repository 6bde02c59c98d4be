"""flood's native kernels: the function of torch's operators to rounding, a row's bits independent of the
rest of the call, the engine's tokens unchanged, and torch's path when they are switched off."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lingctl.cli import run as cli_run
from lingctl.flood.engine import native
from lingctl.flood.engine.loop import Engine, EngineConfig, GenRequest
from lingctl.flood.engine.sampling import SamplingParams
from lingctl.flood.weights.model_dir import ModelDir
from tests.flood.conftest import tiny_model


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[native.Kernels]:
    """Built into a private cache of this module's own, as a first use would."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LINGCTL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.delenv(native.ENV_SWITCH, raising=False)
    native.kernels.cache_clear()
    k = native.kernels()
    if shutil.which("cc") or shutil.which("gcc"):
        assert k is not None, "a C compiler is present, so the kernels must build"
    else:
        assert k is None
        pytest.skip("no C compiler on this machine: flood runs on torch's operators")
    yield k
    mp.undo()
    native.kernels.cache_clear()


def _moe_reference(x, idx, w, gate_up, down):
    i = down.shape[1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(idx.shape[1]), key=lambda j: int(idx[t, j])):
            e = int(idx[t, j])
            h = x[t] @ gate_up[e]
            y[t] += w[t, j] * ((F.silu(h[:i]) * h[i:]) @ down[e])
    return y


@pytest.mark.parametrize(
    ("e", "d", "i", "k", "t"),
    # 2I and D of 64, 96 and 160 columns: whole 64-column blocks and a 32-column one; one expert with 40 rows,
    # experts with 1-13 (groups of 6 rows and partial groups), one row alone
    [(16, 64, 48, 3, 70), (2, 160, 80, 1, 13), (3, 96, 32, 3, 7), (4, 32, 16, 2, 1)],
)
def test_routed_experts_match_torch_and_each_row_stands_alone(kernels, e, d, i, k, t):
    g = torch.Generator().manual_seed(e + d)
    gate_up = torch.randn(e, d, 2 * i, generator=g) * 0.1
    down = torch.randn(e, i, d, generator=g) * 0.1
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 40:
        idx[:40, 0] = 5  # one expert with many rows, others with few
    w = torch.rand(t, k, generator=g)
    y = kernels.moe(x, idx, w, gate_up, down)
    assert torch.allclose(y, _moe_reference(x, idx, w, gate_up, down), atol=1e-5)
    for row in range(t) if t < 20 else (0, 39, 69):
        alone = kernels.moe(x[row : row + 1], idx[row : row + 1], w[row : row + 1], gate_up, down)
        assert torch.equal(alone[0], y[row])
    with pytest.raises(ValueError):
        kernels.moe(x[:1], torch.tensor([[0, 1, e]] if k == 3 else [[e] * k]), w[:1], gate_up, down)
    # widths whose last column block would be partial are left to torch's operators
    assert not kernels.moe_supported(48, 40) and kernels.moe_supported(2048, 1408)


def _bf16_moe_reference(x, idx, w, gate_up, down):
    """float64 products of the bfloat16 values, the SwiGLU output rounded to bfloat16 as the kernel rounds it."""
    i = down.shape[1]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = x[t].double() @ gate_up[e].double()
            act = (F.silu(h[:i]) * h[i:]).to(torch.bfloat16).double()
            y[t] += w[t, j].double() * (act @ down[e].double())
    return y


@pytest.mark.parametrize(
    ("e", "d", "i", "k", "t"),
    # as the float32 test; 40 rows of one expert span two sets of 24 rows
    [(16, 64, 48, 3, 70), (2, 160, 80, 1, 13), (3, 96, 32, 3, 7), (4, 32, 16, 2, 1)],
)
def test_bf16_routed_experts_match_the_float64_product_and_each_row_stands_alone(kernels, e, d, i, k, t):
    g = torch.Generator().manual_seed(e * 7 + d)
    gate_up = (torch.randn(e, d, 2 * i, generator=g) * 0.1).bfloat16()
    down = (torch.randn(e, i, d, generator=g) * 0.1).bfloat16()
    x = torch.randn(t, d, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 40:
        idx[:40, 0] = 5
    w = torch.rand(t, k, generator=g)
    y = kernels.moe(x, idx, w, gate_up, down)
    assert y.dtype == torch.float32
    want = _bf16_moe_reference(x, idx, w, gate_up, down)
    # float32 sums of exact bf16 products: about 1e-7 relative; a SwiGLU value that rounds to the other
    # neighbouring bfloat16 in float32 than in float64 moves an output by far less than this bound
    assert torch.allclose(y.double(), want, rtol=0, atol=1e-3 * float(want.abs().max()))
    for row in range(t) if t < 20 else (0, 39, 69):
        alone = kernels.moe(x[row : row + 1], idx[row : row + 1], w[row : row + 1], gate_up, down)
        assert torch.equal(alone[0], y[row])
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.moe(x, idx, w, gate_up.float(), down.float())  # float32 weights with a bfloat16 input


def test_bf16_products_are_the_same_with_and_without_the_bf16_instructions(kernels, tmp_path):
    """The float32 FMAs (odd element first, then even, as VDPBF16PS is defined) give the instruction's results
    on normal numbers: builds without AVX-512 BF16, and without AVX-512 at all, are compared with the build this
    machine uses (the instruction flushes denormals to zero; these values have none)."""
    import ctypes
    import platform
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the BF16 instructions are x86 ones: elsewhere only the portable loop is built")
    cc = native._compiler()
    assert cc is not None
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(6, 96, 2 * 48, generator=g) * 0.1).bfloat16()
    down = (torch.randn(6, 48, 96, generator=g) * 0.1).bfloat16()
    x = torch.randn(31, 96, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(31)])
    w = torch.rand(31, 2, generator=g)
    want = kernels.moe(x, idx, w, gate_up, down)
    builds = {"x86-64-v3": ["-march=x86-64-v3"]}
    if kernels.bf16_dot:
        builds["native without BF16"] = ["-march=native", "-mno-avx512bf16"]
    for name, march in builds.items():
        lib = tmp_path / f"{name.replace(' ', '-')}.so"
        flags = [f for f in native.FLAGS if f != "-march=native"] + march + native._openmp_flags()
        built = subprocess.run([cc, *flags, "-o", str(lib), *map(str, native.SOURCES), "-lm"], capture_output=True)
        assert built.returncode == 0, built.stderr
        other = native.Kernels(ctypes.CDLL(str(lib)))
        assert not other.bf16_dot
        assert torch.equal(other.moe(x, idx, w, gate_up, down), want), name


def _q8(shape, g):
    q = torch.randint(-127, 128, shape, generator=g, dtype=torch.int32).to(torch.int8)
    return q, torch.rand(shape[:-1], generator=g) * 0.02 + 1e-3


@pytest.mark.parametrize(
    ("e", "d", "i", "k", "t"),
    [(16, 64, 48, 3, 70), (5, 37, 13, 2, 9), (4, 40, 24, 1, 1), (8, 17, 5, 4, 33)],  # odd widths, one row, many
)
def test_int8_routed_experts_match_the_dequantised_product_and_each_row_stands_alone(kernels, e, d, i, k, t):
    g = torch.Generator().manual_seed(e * 100 + d)
    gate_up_q, gate_up_s = _q8((e, 2 * i, d), g)  # output-major, as Int8Linear and the loader hold them
    down_q, down_s = _q8((e, d, i), g)
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 40:
        idx[:40, 0] = 1  # one expert with many rows, others with few
    w = torch.rand(t, k, generator=g)
    y = kernels.moe(x, idx, w, gate_up_q, down_q, (gate_up_s, down_s))
    gate_up = (gate_up_q.double() * gate_up_s.double()[..., None]).transpose(1, 2)
    down = (down_q.double() * down_s.double()[..., None]).transpose(1, 2)
    want = _moe_reference(x.double(), idx, w.double(), gate_up, down)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for row in {0, t // 2, t - 1}:
        alone = kernels.moe(
            x[row : row + 1], idx[row : row + 1], w[row : row + 1], gate_up_q, down_q, (gate_up_s, down_s)
        )
        assert torch.equal(alone[0], y[row])
    with pytest.raises(ValueError, match="int8"):
        kernels.moe(x, idx, w, gate_up_q.float(), down_q, (gate_up_s, down_s))


@pytest.mark.parametrize(("m", "k", "n"), [(1, 2048, 70), (5, 37, 13), (33, 64, 48), (8, 7, 3)])
def test_int8_linear_matches_the_dequantised_product_at_any_row_count(kernels, m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    wq, scale = _q8((n, k), g)
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    y = kernels.linear_q8(x, wq, scale, bias)
    want = x.double() @ (wq.double() * scale.double()[:, None]).T + bias.double()
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert torch.equal(kernels.linear_q8(x[-1:], wq, scale, bias)[0], y[-1])  # one row alone: the same bits
    no_bias = kernels.linear_q8(x, wq, scale, None)
    assert torch.allclose(no_bias.double(), want - bias.double(), rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    with pytest.raises(ValueError, match="weight_NK"):
        kernels.linear_q8(x, wq[:, :-1], scale, bias)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_bf16_rows_quantize_as_quantize_rows_does_bit_for_bit(kernels, scale_dtype):
    from lingctl.flood.weights.quantize import quantize_rows

    g = torch.Generator().manual_seed(3)
    for shape in [(7, 33), (64, 2048), (3, 1), (5, 1408)]:
        w = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3).to(torch.bfloat16)
        w[0] = 0  # an all-zero row: scale 1
        w[-1, 0] = 1e-40  # a subnormal
        chunk = torch.empty(shape)
        want_scale = quantize_rows(w, scale_dtype, chunk)
        q = torch.empty(shape, dtype=torch.int8)
        scale = kernels.quantize_rows_bf16(w, q, scale_dtype)
        assert scale is not None and torch.equal(scale, want_scale) and torch.equal(q, chunk.to(torch.int8))
    bad = torch.ones(4, 8, dtype=torch.bfloat16)
    bad[1, 3] = float("nan")
    assert kernels.quantize_rows_bf16(bad, torch.empty(4, 8, dtype=torch.int8), scale_dtype) is None


def test_int8_activation_products_are_the_same_with_and_without_vnni(kernels, tmp_path):
    """w8a8's integer dot products are exact, so the portable loop and AVX-512 VNNI give the same results: a
    build without VNNI (and without AVX-512) is compared with the build this machine uses."""
    import ctypes
    import platform
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("VNNI is an x86 instruction set: elsewhere only the portable loop is built")
    cc = native._compiler()
    assert cc is not None
    plain = tmp_path / "portable.so"
    flags = [f for f in native.FLAGS if f != "-march=native"] + ["-march=x86-64-v3", *native._openmp_flags()]
    built = subprocess.run(
        [cc, *flags, "-o", str(plain), *map(str, native.SOURCES), "-lm"], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    portable = native.Kernels(ctypes.CDLL(str(plain)))
    assert not portable.vnni
    g = torch.Generator().manual_seed(11)
    wq, scale = _q8((70, 131), g)
    x = torch.randn(9, 131, generator=g)
    assert torch.equal(
        portable.linear_q8(x, wq, scale, None, act_int8=True), kernels.linear_q8(x, wq, scale, None, act_int8=True)
    )
    gate_up_q, gate_up_s = _q8((6, 2 * 24, 40), g)
    down_q, down_s = _q8((6, 40, 24), g)
    xs = torch.randn(13, 40, generator=g)
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(13)])
    w = torch.rand(13, 2, generator=g)
    args = (xs, idx, w, gate_up_q, down_q, (gate_up_s, down_s))
    assert torch.equal(portable.moe(*args, act_int8=True), kernels.moe(*args, act_int8=True))


def test_int8_and_bf16_kernels_give_the_same_bits_on_one_thread_and_two(kernels):
    g = torch.Generator().manual_seed(7)
    wq, scale = _q8((96, 64), g)
    gate_up_q, gate_up_s = _q8((8, 64, 48), g)
    down_q, down_s = _q8((8, 48, 32), g)
    x = torch.randn(21, 48, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(21)])
    w = torch.rand(21, 2, generator=g)
    gate_up_bf16 = (torch.randn(8, 64, 2 * 32, generator=g) * 0.1).bfloat16()
    down_bf16 = (torch.randn(8, 32, 64, generator=g) * 0.1).bfloat16()
    x_bf16 = torch.randn(21, 64, generator=g).bfloat16()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                (
                    kernels.linear_q8(torch.randn(21, 64, generator=torch.Generator().manual_seed(1)), wq, scale, None),
                    kernels.moe(x, idx, w, gate_up_q, down_q, (gate_up_s, down_s)),
                    kernels.moe(x_bf16, idx, w, gate_up_bf16, down_bf16),
                )
            )
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))


def test_attention_matches_sdpa_for_decode_and_prompt_units(kernels):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dh = 4, 2, 32
    k_pool = torch.randn(400, kv_heads, dh, generator=g)
    v_pool = torch.randn(400, kv_heads, dh, generator=g)
    q = torch.randn(20, heads, dh, generator=g)
    # unit 0: 1 query over slots 10..59; unit 1: 16 queries (causal) over slots 200..229 then 100..149
    keys0 = list(range(10, 60))
    keys1 = list(range(200, 230)) + list(range(100, 150))
    units = torch.tensor([[0, 1, 0, len(keys0)], [1, 16, len(keys0), len(keys1)]])
    keys = torch.tensor(keys0 + keys1)
    out = torch.zeros(20, heads, dh)
    kernels.attention(q, k_pool, v_pool, native.UnitTable.of(units, keys, len(keys1)), dh**-0.5, out)

    def sdpa(rows, slots, causal):
        kk = k_pool[slots].transpose(0, 1)[None]
        vv = v_pool[slots].transpose(0, 1)[None]
        n = len(rows)
        mask = torch.ones(n, len(slots), dtype=torch.bool).tril(len(slots) - n) if causal else None
        return F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], kk, vv, attn_mask=mask, enable_gqa=True)[
            0
        ].transpose(0, 1)

    assert torch.allclose(out[0:1], sdpa([0], keys0, False), atol=1e-5)
    assert torch.allclose(out[1:17], sdpa(list(range(1, 17)), keys1, True), atol=1e-5)
    assert torch.equal(out[17:], torch.zeros(3, heads, dh))  # rows no unit covers are left alone
    alone = torch.zeros(20, heads, dh)
    kernels.attention(q, k_pool, v_pool, native.UnitTable.of(units[:1], keys, len(keys0)), dh**-0.5, alone)
    assert torch.equal(alone[0], out[0])
    assert math.isfinite(float(out.abs().sum()))


# Run with ``python -O``, which strips ``assert``: each call breaks one precondition of the kernels and must
# still be refused before the library touches memory.
_BAD_CALLS = """
import sys
import torch
from lingctl.flood.engine import native

if not sys.flags.optimize:
    raise SystemExit("not running under -O")
k = native.kernels()
if k is None:
    raise SystemExit(f"the kernels did not build: {native.why_unavailable()}")
gate_up, down = torch.zeros(4, 32, 64), torch.zeros(4, 32, 32)
x, idx, w = torch.zeros(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
q, pool, out = torch.zeros(2, 4, 32), torch.zeros(10, 2, 32), torch.zeros(2, 4, 32)
units, keys = torch.tensor([[0, 2, 0, 3]]), torch.tensor([1, 2, 3])
table = native.UnitTable.of(units, keys, 3)
calls = {
    "float64 input": lambda: k.moe(x.double(), idx, w, gate_up, down),
    "down of another shape": lambda: k.moe(x, idx, w, gate_up, down[:, :16]),
    "weights not contiguous": lambda: k.moe(x, idx, w, torch.zeros(4, 64, 32).transpose(1, 2), down),
    "routing weights of another shape": lambda: k.moe(x, idx, w[:2], gate_up, down),
    "float64 queries": lambda: k.attention(q.double(), pool, pool, table, 0.1, out),
    "output of another shape": lambda: k.attention(q, pool, pool, table, 0.1, out[:1]),
    "queries past the rows": lambda: k.attention(q[:1], pool, pool, table, 0.1, out[:1]),
    "a key past the pool": lambda: k.attention(q, pool[:3], pool[:3], table, 0.1, out),
    "int32 units": lambda: native.UnitTable.of(units.int(), keys, 3),
    "more keys than the buffer": lambda: native.UnitTable.of(units, keys, 2),
    "keys past the table": lambda: native.UnitTable.of(torch.tensor([[0, 2, 1, 3]]), keys, 3),
}
for name, call in calls.items():
    try:
        call()
    except ValueError as exc:
        print(f"{name}: {exc}")
    else:
        raise SystemExit(f"{name}: no ValueError")
print(f"refused {len(calls)}")
"""


def test_bad_calls_are_refused_even_under_python_O(kernels, tmp_path):
    env = {**os.environ, "LINGCTL_CACHE_DIR": str(tmp_path)}
    env.pop(native.ENV_SWITCH, None)
    res = subprocess.run([sys.executable, "-O", "-c", _BAD_CALLS], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "refused 11" in res.stdout
    assert list((tmp_path / "native").glob("flood_kernels-*.so"))  # built afresh, header and all


def _tokens(model, prompts):
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=4096))
    reqs = [
        GenRequest(key=i, prompt_ids=p, sampling=SamplingParams(max_tokens=8, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    return {r.key: r.token_ids for r in engine.generate(reqs)}


def test_the_engine_gives_the_same_tokens_with_and_without_the_kernels(kernels, monkeypatch):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 1024, (int(n),), generator=g).tolist() for n in (3, 17, 40, 64, 5, 33)]
    with_kernels = _tokens(tiny_model(), prompts)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.kernels.cache_clear()
    try:
        assert native.kernels() is None
        without = _tokens(tiny_model(), prompts)
    finally:
        monkeypatch.delenv(native.ENV_SWITCH)
        native.kernels.cache_clear()
    assert with_kernels == without


def test_the_build_is_cached_in_a_private_directory(kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(tmp_path))
    first = native._build()
    assert first is not None and first.parent == tmp_path / "native"
    assert (tmp_path / "native").stat().st_mode & 0o077 == 0
    mtime = first.stat().st_mtime_ns
    assert native._build() == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt


@pytest.mark.parametrize("variant", ["float32", "int8", "w8a8"])
def test_logits_are_the_same_bits_at_one_and_two_threads(kernels, tiny_ckpt, variant):
    """What lets the thread count follow the machine's load during a run (flood/engine/threads.py): float
    weights, int8 weights and int8 weights with int8 activations alike."""
    seen: dict[int, list[torch.Tensor]] = {}

    class Recording(Engine):
        def _on_sample(self, sched, seq, logits_V, done, **kwargs):
            seen.setdefault(seq.key.key, []).append(logits_V.clone())
            super()._on_sample(sched, seq, logits_V, done, **kwargs)

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 1024, (int(n),), generator=g).tolist() for n in (7, 21, 50, 3, 64, 12, 30)]
    if variant == "float32":
        model = tiny_model()
        model.normalize_head_()  # as every loader does (an unbaked NormHead reduces over the vocabulary per call)
    else:
        model = ModelDir.open(tiny_ckpt).load(dtype=torch.float32, quantize=variant)

    def logits(threads: int) -> dict[int, list[torch.Tensor]]:
        seen.clear()
        torch.set_num_threads(threads)
        engine = Engine.local(model, EngineConfig(kv_cache_tokens=4096))
        engine.__class__ = Recording
        list(
            engine.generate(
                [
                    GenRequest(key=i, prompt_ids=p, sampling=SamplingParams(max_tokens=6, temperature=0.0))
                    for i, p in enumerate(prompts)
                ]
            )
        )
        return {k: list(v) for k, v in seen.items()}

    try:
        one, two = logits(1), logits(2)
    finally:
        torch.set_num_threads(1)
    assert one.keys() == two.keys() and len(one) == len(prompts)
    assert all(torch.equal(a, b) for k in one for a, b in zip(one[k], two[k]))


def test_the_kernels_share_torchs_openmp_runtime(kernels):
    """Two OpenMP runtimes in one process would each keep threads spinning on the same cores."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc on this platform")
    runtimes = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes
    if kernels.openmp:
        assert runtimes


@pytest.mark.parametrize("place", ["open to others", "another user's", "no ~/.cache"])
def test_a_refused_cache_directory_is_said_once_and_the_run_still_answers(
    capsys, tiny_ckpt, tmp_path, monkeypatch, place
):
    """Falling back to torch's operators costs speed, so it is one warning per process saying why; the doctor
    line for it: tests/commands/test_doctor.py."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if place == "open to others":
        cache.chmod(0o777)
    elif place == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(cache, 65534, 65534)
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    if place == "no ~/.cache":
        monkeypatch.delenv("LINGCTL_CACHE_DIR", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))  # a home without .cache/
    else:
        monkeypatch.setenv("LINGCTL_CACHE_DIR", str(cache))
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        "".join(json.dumps({"custom_id": f"r{i}", "prompt": [5, 6 + i], "max_tokens": 2}) + "\n" for i in range(2))
    )
    native.kernels.cache_clear()
    try:
        code = cli_run(["flood", "run", str(batch), "--model", str(tiny_ckpt), "--threads", "1"])
    finally:
        native.kernels.cache_clear()  # the next user builds or loads them again, in its own cache
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("native kernels are unavailable") == 1, err
    reason = {"open to others": "open to other users", "another user's": "belongs to uid 65534"}
    assert reason.get(place, "no such file or directory") in err and "slower" in err
    assert len((tmp_path / "b.output.jsonl").read_text().splitlines()) == 2  # answered all the same
    assert not (tmp_path / ".cache").exists() and not any(cache.iterdir())  # nothing made where it was refused
