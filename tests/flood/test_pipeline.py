"""Pipeline stages: the layer split, the same tokens as one process, and failures that neither hang nor leave
stage processes behind. The slow tests start real stage processes (gloo on 127.0.0.1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from lingctl.core.errors import LingctlError
from lingctl.flood.engine.forward import StepBatch
from lingctl.flood.engine.loop import Engine, EngineConfig, GenRequest
from lingctl.flood.engine.pipeline import PipelineRunner, split_layers
from lingctl.flood.engine.sampling import SamplingParams
from lingctl.flood.weights.model_dir import ModelDir
from lingctl.model.checkpoint import save_checkpoint
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset

KV = 2048


# -- split_layers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (4, 3, [(0, 2), (2, 3), (3, 4)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (5, 2, [(0, 3), (3, 5)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (88, 8, [(i * 11, i * 11 + 11) for i in range(8)]),
    ],
)
def test_split_layers(layers: int, stages: int, expected: list[tuple[int, int]]) -> None:
    assert split_layers(layers, stages) == expected


@pytest.mark.parametrize(("layers", "stages"), [(1, 1), (9, 2), (10, 3), (29, 5), (88, 7), (64, 63)])
def test_split_layers_is_contiguous_even_and_spares_the_last_stage(layers: int, stages: int) -> None:
    split = split_layers(layers, stages)
    assert split[0][0] == 0 and split[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(split, split[1:]))
    sizes = [last - first for first, last in split]
    assert max(sizes) - min(sizes) <= 1
    assert sizes[-1] == min(sizes)


def test_split_layers_rejects_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match=r"4 layers.*5 stages"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        split_layers(4, 0)


# -- a tiny checkpoint and what one process makes of it ---------------------------------------------------


def tiny_config() -> LingConfig:
    cfg = preset("tiny")
    cfg.num_hidden_layers = 4
    cfg.norm_head = True
    cfg.initializer_range = 0.2  # large enough that greedy tokens differ from request to request
    return cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = LingForCausalLM(tiny_config())
    model.init_weights(torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("pipeline") / "ckpt"
    save_checkpoint(model, path)
    return path


def requests() -> list[GenRequest]:
    """12 greedy requests: lengths 1..60, half of them behind one shared 40-token prefix."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(1, 1024, (40,), generator=g).tolist()
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in (1, 3, 7, 16, 33, 60)]
    prompts += [prefix + torch.randint(1, 1024, (n,), generator=g).tolist() for n in (1, 2, 9, 16, 17, 20)]
    return [
        GenRequest(key=i, prompt_ids=p, sampling=SamplingParams(max_tokens=12, temperature=0.0))
        for i, p in enumerate(prompts)
    ]


def generate(engine: Engine) -> dict[int, list[int]]:
    return {r.key: r.token_ids for r in engine.generate(requests())}


@pytest.fixture(scope="module")
def one_process(ckpt: Path) -> dict[int, list[int]]:
    engine = Engine.local(ModelDir.open(ckpt).load(dtype=torch.float32), EngineConfig(kv_cache_tokens=KV))
    out = generate(engine)
    assert engine.stats.prefix_hits == 6
    assert len({tuple(t) for t in out.values()}) > 6  # the comparison below means something
    return out


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def gone(pids: set[int]) -> bool:
    """Exited (a zombie whose parent has not reaped it counts: it runs nothing)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def stage_pids(before: set[int]) -> dict[int, int]:
    """Stage number -> pid of the stage processes started since ``before``."""
    out = {}
    for pid in children() - before:
        cmd = psutil.Process(pid).cmdline()
        if "lingctl.flood.engine.pipeline" in cmd:
            out[int(psutil.Process(pid).environ()["RANK"])] = pid
    return out


# -- real stage processes ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_stages_give_the_tokens_of_one_process(ckpt: Path, one_process: dict[int, list[int]], stages: int) -> None:
    before = children()
    runner = PipelineRunner(ckpt, stages=stages, dtype=torch.float32, quantize=None, kv_cache_tokens=KV)
    engine = Engine(EngineConfig(kv_cache_tokens=KV), model_config=tiny_config(), runner=runner, eos_ids=[])
    try:
        assert runner.depth == stages
        pids = stage_pids(before)
        assert sorted(pids) == list(range(1, stages + 1))
        assert generate(engine) == one_process
        assert generate(engine) == one_process  # the KV pools are reused as the engine's allocator says
    finally:
        engine.close()
    assert gone(set(pids.values()))
    assert children() <= before
    engine.close()  # idempotent
    with pytest.raises(LingctlError, match="closed"):
        runner.submit(StepBatch(token_ids=[1], positions=[0], slots=[0], units=[], sample_rows=[]))


@pytest.mark.slow
def test_stage_that_cannot_load_fails_fast_and_leaves_nothing(ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    before = children()
    started = time.monotonic()
    with pytest.raises(LingctlError, match=r"pipeline stage \d \(layers \d-\d\) failed to start: .*truncated"):
        PipelineRunner(bad, stages=2, dtype=torch.float32, quantize=None, kv_cache_tokens=64)
    assert time.monotonic() - started < 30
    assert children() <= before


@pytest.mark.slow
def test_dead_stage_raises_instead_of_hanging(ckpt: Path) -> None:
    before = children()
    runner = PipelineRunner(ckpt, stages=2, dtype=torch.float32, quantize=None, kv_cache_tokens=KV)
    engine = Engine(EngineConfig(kv_cache_tokens=KV), model_config=tiny_config(), runner=runner, eos_ids=[])
    pids = stage_pids(before)
    long = [
        GenRequest(key=i, prompt_ids=[1 + i, 2, 3], sampling=SamplingParams(max_tokens=900, temperature=0.0))
        for i in range(8)
    ]
    killer = threading.Timer(0.5, os.kill, (pids[2], signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(LingctlError, match=r"pipeline stage 2 \(layers 2-3\) was killed by SIGKILL"):
        list(engine.generate(long))
    killer.join()
    assert time.monotonic() - started < 10
    engine.close()
    assert gone(set(pids.values()))
    assert children() <= before


@pytest.mark.slow
def test_stages_exit_when_the_scheduler_dies(ckpt: Path) -> None:
    script = (
        "import os, sys, psutil, torch; from pathlib import Path; "
        "from lingctl.flood.engine.pipeline import PipelineRunner; "
        "r = PipelineRunner(Path(sys.argv[1]), stages=2, dtype=torch.float32, quantize=None, "
        "kv_cache_tokens=64); print(*[c.pid for c in psutil.Process().children()], flush=True); "
        "os.kill(os.getpid(), 9)"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(ckpt)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = {int(pid) for pid in proc.stdout.split()}
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids)
