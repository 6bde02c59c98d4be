"""Shared fixtures: a real S3-compatible server on 127.0.0.1, fresh buckets, and a way to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lingctl.core.local_s3 import LocalS3Server, serve_s3
from lingctl.core.storage import S3Options
from lingctl.core.storage.s3.store import make_client

# Variables that could point a test at a real account or another endpoint; tests set their own.
AWS_VARS = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_aws(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test reads the developer's AWS config or credentials."""
    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path_factory.getbasetemp() / "no-aws-config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(autouse=True)
def _isolated_hf_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test reads or writes the developer's Hugging Face cache or token, and none reports telemetry."""
    home = tmp_path_factory.getbasetemp() / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    if "HF_HUB_CACHE" in os.environ:
        monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    for var in ("HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3Server]:
    """``rclone serve s3`` on a free port for the whole session; stopped by pid at the end."""
    root = tmp_path_factory.mktemp("s3") / "root"
    root.mkdir()
    with serve_s3(root) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The standard AWS variables pointing at the test server, set in this process; returned for subprocesses."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return dict(os.environ)


@pytest.fixture
def s3_bucket(s3_server: LocalS3Server, s3_env: dict[str, str]) -> str:
    """A fresh, empty bucket created through the S3 API (the server caches directory listings)."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    make_client(S3Options(endpoint_url=s3_server.endpoint)).create_bucket(Bucket=name)
    return name


def run_lingctl(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m lingctl ARGS`` as a real subprocess, capturing stdout and stderr separately."""
    return subprocess.run(
        [sys.executable, "-m", "lingctl", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture
def lingctl():
    return run_lingctl


@pytest.fixture
def competitor() -> Iterator[subprocess.Popen]:
    """Another process keeping one core busy, as on a shared machine."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real corpus (~300 KB of standard-library source in a few files): tokenizer training and
    packing take well under a second, so training tests spend their time training."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    names = [
        "argparse.py",
        "json/decoder.py",
        "json/encoder.py",
        "textwrap.py",
        "string.py",
        "heapq.py",
        "bisect.py",
        "shlex.py",
        "fnmatch.py",
        "functools.py",
        "calendar.py",
    ]
    for name in names:
        src = root / name
        if src.exists():
            (out / name.replace("/", "_")).write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    return out
