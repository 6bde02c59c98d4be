"""lingctl.runs is the run directory's torch-free home: `train status`, the launcher's hang detector, `flood
eval` and the command line read run files through it without loading torch or the training code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_run_directory_package_loads_without_torch_training_or_pcache() -> None:
    code = (
        "import sys, pkgutil, importlib, lingctl.runs\n"
        "for m in pkgutil.walk_packages(lingctl.runs.__path__, 'lingctl.runs.'):\n"
        "    importlib.import_module(m.name)\n"
        "heavy = ('torch', 'lingctl.train', 'lingctl.pcache')\n"
        "print(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + '.' for h in heavy))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
