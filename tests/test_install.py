"""The install the README documents: `make`'s torch step and lingctl's own dependencies, resolved by pip in a
fresh virtual environment (``pip install --dry-run --report``: nothing is installed). On a machine without an
NVIDIA GPU nothing of CUDA may come in: PyPI's Linux torch wheels pull about 2.8 GB of nvidia-* packages."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _resolve(venv: Path, args: list[str], report: Path) -> list[dict]:
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    res = subprocess.run(
        [*pip, "install", "--dry-run", "--ignore-installed", "--report", str(report), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(report.read_text())["install"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU index choice is made for Linux")
def test_a_fresh_install_on_a_cpu_machine_resolves_the_cpu_torch_and_no_cuda(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA GPU: the CUDA build is the one wanted here")
    make = shutil.which("make")
    assert make is not None, "make is needed for the README's commands"
    torch_args = subprocess.run(
        [make, "-s", "torch-args"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "https://download.pytorch.org/whl/cpu" in torch_args
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # the Makefile's two steps in one resolution: torch with its index, then lingctl itself
    resolved = _resolve(venv, [*torch_args, "."], tmp_path / "report.json")
    names = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in resolved}
    assert "lingctl" in names and names["torch"].endswith("+cpu"), names.get("torch")
    cuda = sorted(n for n in names if n.startswith(("nvidia-", "triton", "cuda-")))
    assert cuda == [], f"CUDA packages resolved on a CPU machine: {cuda}"
