"""The CLI shell, through real subprocesses: exit codes, one-line errors, --json on stdout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lingctl import __version__


def test_version_json(lingctl) -> None:
    r = lingctl("version", "--json")
    assert r.returncode == 0
    assert json.loads(r.stdout)["lingctl"] == __version__
    assert r.stderr == ""


def test_console_script_and_help() -> None:
    exe = __import__("pathlib").Path(sys.executable).parent / "lingctl"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for name in ("train", "babel", "timer", "pcache", "flood", "doctor", "version"):
        assert name in r.stdout


def test_unknown_command_is_a_one_line_usage_error(lingctl) -> None:
    r = lingctl("frobnicate")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("lingctl: error: ") and "frobnicate" in lines[0]
    assert len(lines) <= 2 and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_unknown_option_is_a_usage_error(lingctl) -> None:
    r = lingctl("doctor", "--no-such-flag")
    assert r.returncode == 2
    assert "--no-such-flag" in r.stderr.splitlines()[0]
    assert "hint: try 'lingctl doctor --help'" in r.stderr


@pytest.mark.parametrize("tool", ["babel", "flood", "timer", "pcache"])
def test_each_tool_group_called_bare_shows_its_commands(lingctl, tool: str) -> None:
    r = lingctl(tool)
    assert r.returncode == 0, r.stderr
    assert f"lingctl {tool}" in r.stdout and "Commands" in r.stdout
    assert "Traceback" not in r.stderr


def test_debug_variable_shows_traceback(lingctl, monkeypatch, tmp_path) -> None:
    import os

    env = {**os.environ, "LINGCTL_DEBUG": "1"}
    r = lingctl("doctor", "--probe", "gs://bucket/x", env=env)
    assert r.returncode == 2
    assert "Traceback" in r.stderr and "unsupported URL scheme 'gs'" in r.stderr


def test_version_flag(lingctl) -> None:
    r = lingctl("--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"lingctl {__version__}")


def test_python_dash_m_and_bare_call_shows_help(lingctl) -> None:
    r = lingctl()
    assert r.returncode == 0
    assert "doctor" in r.stdout + r.stderr


def test_building_the_cli_loads_no_heavy_module() -> None:
    # Every command imports lingctl.cli and builds the whole command tree; torch, Rich, pydantic (Typer's
    # parameter coercion) and the tools' own packages load only in the commands that use them.
    code = (
        "import sys, typer, lingctl.cli, lingctl.commands.babel; typer.main.get_command(lingctl.cli.app); "
        "print(' '.join(sorted(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    heavy = {
        "torch",
        "numpy",
        "rich",
        "pydantic",
        "lingctl.train",
        "lingctl.pcache",
        "lingctl.timer",
        "lingctl.doctor",
    }
    assert not heavy & loaded
    # The options of flood's commands are made from the engine's settings, declared once in a module that
    # imports nothing heavy (as train's are in lingctl.runs): that declaration loads, nothing else of flood.
    declaration = {"lingctl.flood", "lingctl.flood.engine", "lingctl.flood.engine.options"}
    assert {m for m in loaded if m.startswith("lingctl.flood")} <= declaration
