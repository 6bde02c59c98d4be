"""The import rules of docs/architecture.md, read from the code itself so that neither can drift.

    cli -> commands -> tools (train, flood, babel, pcache, timer, doctor) -> runs, model -> core

Layers import only downwards; a tool uses another tool only where the table below allows it (through that
tool's public functions); only cli and commands import Typer; no two modules import each other, directly or
round a loop; lingctl.runs and lingctl.core load without torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lingctl"

# Which top-level parts of lingctl each part may import ("lingctl" itself: the version in lingctl/__init__.py).
ALLOWED: dict[str, set[str]] = {
    "lingctl": set(),  # lingctl/__init__.py: the version only
    "__main__": {"cli"},
    "cli": {"commands", "core", "lingctl"},
    "commands": {"babel", "core", "doctor", "flood", "lingctl", "model", "pcache", "runs", "timer", "train"},
    "doctor": {"core", "lingctl"},
    "train": {"core", "model", "runs", "pcache", "timer"},  # checkpoints through pcache; stacks through timer
    "flood": {"core", "model", "runs", "babel"},  # s3:// models copied through babel's sync
    "pcache": {"core", "model", "babel"},  # uploads through babel's transfer
    "babel": {"core"},
    "timer": {"core"},
    "runs": {"core", "model"},
    "model": {"core"},
    "core": {"lingctl"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The lingctl modules ``module`` imports (at any depth of the file, lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in modules] or [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, modules) for m, p in modules.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lingctl"


def test_every_part_imports_only_what_its_layer_allows() -> None:
    broken = defaultdict(list)
    for module, targets in _graph().items():
        part = _part(module)
        assert part in ALLOWED, f"{module}: a new top-level part; add it to ALLOWED and docs/architecture.md"
        for target in targets:
            if _part(target) != part and _part(target) not in ALLOWED[part]:
                broken[module].append(target)
    assert dict(broken) == {}


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def _importers(package: str) -> set[Path]:
    """lingctl's files that import ``package`` or one of its modules (lazy imports included)."""
    users = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(n == package or n.startswith(package + ".") for n in names):
                users.add(path.relative_to(ROOT))
    return users


def test_only_the_command_layer_imports_typer() -> None:
    users = [p for p in _importers("typer") if _part(".".join(p.with_suffix("").parts)) not in ("cli", "commands")]
    assert users == []


def test_only_flood_s_cluster_package_imports_ray() -> None:
    """Ray is an optional extra: everything else must load, and run, without it."""
    cluster = Path("lingctl", "flood", "cluster")
    users = _importers("ray")
    assert users and all(p.parent == cluster for p in users), sorted(map(str, users))


def test_the_run_directory_and_core_load_without_torch_training_or_pcache() -> None:
    """`train status`, the launcher's hang detector, `flood eval` and the command line read run files through
    lingctl.runs without loading torch or the training code."""
    code = (
        "import sys, pkgutil, importlib, lingctl.runs, lingctl.core\n"
        "for pkg in (lingctl.runs, lingctl.core):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "heavy = ('torch', 'lingctl.train', 'lingctl.pcache')\n"
        "print(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + '.' for h in heavy))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_command_map_of_docs_architecture_names_modules_and_entries_that_exist() -> None:
    """Each row of the command table names a wrapper and a library entry as `path.py` `function`: both exist."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc.split("## Every command and its entry point", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `lingctl")]
    assert len(rows) >= 17, rows
    missing = []
    for row in rows:
        for cell in row.split("|")[2:4]:
            for path, names in re.findall(r"`([a-z_/]+\.py)`((?: `\w+`,?)*)", cell):
                source = PACKAGE / path
                if not source.exists():
                    missing.append(path)
                    continue
                text = source.read_text(encoding="utf-8")
                for name in re.findall(r"`(\w+)`", names):
                    if not re.search(rf"^(?:def|class) {name}\b", text, re.M):
                        missing.append(f"{path}: {name}")
    assert missing == []
