"""`lingctl doctor`: report what this machine offers and whether storage answers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from lingctl.commands.options import (
    DEFAULT_RETRIES,
    EndpointOpt,
    JsonOpt,
    PathStyleOpt,
    ProfileOpt,
    RegionOpt,
    RetriesOpt,
    s3_options,
)
from lingctl.core.errors import UsageError
from lingctl.core.output import Output
from lingctl.core.units import parse_size

if TYPE_CHECKING:
    from rich.console import Console

    from lingctl.doctor import Check, DoctorReport

_MAX_PROBE = 1 << 30
_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "-"}
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def doctor(
    probe: Annotated[
        str | None,
        typer.Option(
            "--probe",
            metavar="URL",
            help="Round-trip a test object through URL (s3://bucket/prefix or a path): put, list, get, verify, delete "
            "(default: no probe).",
        ),
    ] = None,
    probe_size: Annotated[str, typer.Option("--probe-size", metavar="SIZE", help="Size of the probe object.")] = "8MiB",
    path: Annotated[Path, typer.Option("--path", metavar="PATH", help="Where to check free disk space.")] = Path("."),
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    retries: RetriesOpt = DEFAULT_RETRIES,
    json: JsonOpt = False,
) -> None:
    """Check Python, torch and devices, CPU, memory, disk, rclone and the S3 endpoint; optionally probe a store.

    Exits with the code of the first failed check (5: endpoint unreachable, 3: bucket missing, 1: credentials).
    """
    # Loaded here, not at start-up: every lingctl command imports this module to register `doctor`.
    from lingctl.doctor import run_doctor

    out = Output(json)
    size = parse_size(probe_size)
    if size > _MAX_PROBE:
        raise UsageError(f"--probe-size {probe_size} is larger than the 1 GiB limit (the probe is held in memory)")
    report = run_doctor(
        s3=s3_options(endpoint_url, region, profile, path_style, retries),
        disk_path=path,
        probe_url=probe,
        probe_size=size,
        tool_checks=[flood_kernels_check],
    )
    out.result(report.to_json(), lambda console: _render(report, console))
    if report.first_error is not None:
        raise report.first_error


def flood_kernels_check() -> Check:
    """Whether flood's compiled CPU kernels build and load here, and if not, why (flood then runs slower)."""
    from lingctl.doctor import Check
    from lingctl.flood.engine import native

    loaded = native.kernels()  # builds them on first use, as a flood run would
    if loaded is not None:
        how = "OpenMP" if loaded.openmp else "a thread pool"
        return Check("flood-kernels", "ok", f"built and loaded ({how})", {"available": True, "reason": None})
    reason = native.why_unavailable() or "unknown"
    return Check(
        "flood-kernels",
        "warn",
        f"unavailable: {reason}; flood uses torch's operators (slower)",
        {"available": False, "reason": reason},
    )


def _render(report: DoctorReport, console: Console) -> None:
    from rich.table import Table

    table = Table(title=f"lingctl {report.lingctl}", show_header=False, box=None, pad_edge=False)
    for check in report.checks:
        table.add_row(check.name, f"[{_STYLE[check.status]}]{_MARK[check.status]}[/]", check.detail)
    console.print(table)
    if report.probe is not None:
        steps = Table(title=f"round trip {report.probe.url}", box=None, pad_edge=False)
        for column in ("step", "ms", "result"):
            steps.add_column(column)
        for step in report.probe.steps:
            steps.add_row(step.step, f"{step.seconds * 1000:.1f}", step.detail)
        console.print(steps)
