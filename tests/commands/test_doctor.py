"""`lingctl doctor` against a real S3 server: the report, the probe, and the documented exit codes. One test runs
it as a subprocess; the others run the CLI in this process, where torch is already loaded."""

from __future__ import annotations

import json
import os

import pytest

from lingctl.cli import run as cli_run
from lingctl.core.net import free_port


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process: exit code, stdout and stderr."""
    code = cli_run(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def without_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("AWS_ACCESS", "AWS_SECRET")):
            monkeypatch.delenv(key)


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert lines and lines[0].startswith("lingctl: error: "), stderr
    assert len(lines) <= 2 and all(line.startswith(("lingctl: error: ", "hint: ")) for line in lines), stderr
    return lines[0]


def test_report_json(lingctl, tmp_path) -> None:
    r = lingctl("doctor", "--json", "--path", str(tmp_path))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True
    assert checks["torch"]["data"]["version"].startswith("2.")
    assert checks["cpu"]["data"]["logical_cores"] >= 1
    assert checks["disk"]["data"]["free_gib"] > 0
    assert checks["rclone"]["status"] == "ok"
    assert checks["s3"]["status"] == "skip"  # nothing configured in the test environment


def test_human_report(capsys) -> None:
    code, out, err = cli(capsys, "doctor")
    assert code == 0, err
    assert "torch" in out and "rclone" in out


def test_doctor_says_why_flood_runs_without_its_kernels(capsys, tmp_path, monkeypatch) -> None:
    from lingctl.flood.engine import native

    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)  # the private-directory check refuses a cache others can write
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(cache))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    native.kernels.cache_clear()
    try:
        code, out, err = cli(capsys, "doctor", "--json", "--path", str(tmp_path))
        human_code, human, _ = cli(capsys, "doctor", "--path", str(tmp_path))
    finally:
        native.kernels.cache_clear()
    assert code == 0 and human_code == 0, err  # a warning: flood still runs, slower
    check = {c["name"]: c for c in json.loads(out)["checks"]}["flood-kernels"]
    assert check["status"] == "warn" and check["data"]["available"] is False
    assert f"{cache} is open to other users" in check["data"]["reason"] and "slower" in check["detail"]
    line = next(line for line in human.splitlines() if line.startswith("flood-kernels"))
    assert "WARN" in line and "unavailable" in line


@pytest.mark.slow
def test_probe_round_trip_through_s3(capsys, s3_env, s3_bucket, s3_server) -> None:
    code, out, err = cli(capsys, "doctor", "--json", "--probe", f"s3://{s3_bucket}/probe", "--probe-size", "2MiB")
    assert code == 0, err
    report = json.loads(out)
    assert report["probe"]["verified"] is True
    assert [s["step"] for s in report["probe"]["steps"]] == ["put", "list", "get", "verify", "download", "delete"]
    assert {c["name"]: c["status"] for c in report["checks"]}["s3"] == "ok"
    assert list((s3_server.root / s3_bucket).rglob("*.bin")) == []  # the probe object was removed


def test_probe_round_trip_local(capsys, tmp_path) -> None:
    code, out, err = cli(capsys, "doctor", "--json", "--probe", str(tmp_path / "store"), "--probe-size", "100KiB")
    assert code == 0, err
    assert json.loads(out)["probe"]["size"] == 100 * 1024
    assert list((tmp_path / "store").iterdir()) == []


def test_missing_bucket_exits_3(capsys, s3_env) -> None:
    code, _, err = cli(capsys, "doctor", "--probe", "s3://no-such-bucket/x")
    assert code == 3
    assert "no-such-bucket" in one_line_error(err)


def test_wrong_credentials_exit_1_without_the_secret(capsys, monkeypatch, s3_env, s3_bucket) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "definitely-wrong-secret")
    code, out, err = cli(capsys, "doctor", "--json", "--probe", f"s3://{s3_bucket}")
    assert code == 1
    assert "credentials" in one_line_error(err)
    assert "definitely-wrong-secret" not in err + out
    assert json.loads(out)["ok"] is False  # the report still comes, on stdout


def test_unreachable_endpoint_exits_5(capsys, s3_env) -> None:
    code, _, err = cli(capsys, "doctor", "--endpoint-url", f"http://127.0.0.1:{free_port()}", "--retries", "2")
    assert code == 5
    assert "could not reach S3 endpoint" in one_line_error(err)


@pytest.mark.parametrize(
    "args",
    [
        ["--probe", "s3://"],
        ["--probe", "ftp://x/y"],
        ["--endpoint-url", "not-a-url"],
        ["--probe-size", "lots"],
        ["--probe-size", "2GiB"],
        ["--retries", "0"],
    ],
)
def test_bad_input_exits_2(capsys, s3_env, args) -> None:
    code, _, err = cli(capsys, "doctor", *args)
    assert code == 2
    one_line_error(err)


def test_unreachable_endpoint_without_credentials_still_exits_5(capsys, monkeypatch, s3_env) -> None:
    without_credentials(monkeypatch)
    code, _, err = cli(capsys, "doctor", "--endpoint-url", f"http://127.0.0.1:{free_port()}", "--retries", "1")
    assert code == 5
    one_line_error(err)


def test_endpoint_without_credentials_exits_1(capsys, monkeypatch, s3_env) -> None:
    without_credentials(monkeypatch)
    code, _, err = cli(capsys, "doctor")
    assert code == 1
    assert "no S3 credentials" in one_line_error(err)


def test_probe_below_a_file_is_a_one_line_error(capsys, tmp_path) -> None:
    (tmp_path / "file.txt").write_text("keep me")
    code, _, err = cli(capsys, "doctor", "--probe", str(tmp_path / "file.txt" / "store"))
    assert code == 2
    assert "not a directory" in one_line_error(err)
    assert (tmp_path / "file.txt").read_text() == "keep me"


def test_endpoint_password_is_not_in_the_report_or_the_error(capsys, s3_env, s3_server, s3_bucket) -> None:
    with_password = s3_server.endpoint.replace("http://", "http://admin:hunter2@")
    code, out, err = cli(
        capsys,
        "doctor",
        "--json",
        "--endpoint-url",
        with_password,
        "--probe",
        f"s3://{s3_bucket}/p",
        "--probe-size",
        "4KiB",
    )
    assert code == 0, err
    assert "hunter2" not in out + err and "admin" not in out
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["s3"]["data"]["endpoint"] == s3_server.endpoint  # the password is dropped, the server found
    assert checks["probe"]["status"] == "ok"


def test_library_check_redacts_an_endpoint_it_is_given(s3_env) -> None:
    # Library callers pass S3Options straight in: the check itself must not show the password either.
    from lingctl.core.storage import S3Options
    from lingctl.doctor import check_s3_endpoint

    check = check_s3_endpoint(
        S3Options(endpoint_url=f"http://admin:hunter2@127.0.0.1:{free_port()}", max_attempts=1, connect_timeout=2)
    )
    assert check.status == "fail" and check.error is not None and check.error.exit_code == 5
    # The user info is dropped before any request or message is built from the endpoint.
    assert "could not reach S3 endpoint http://127.0.0.1:" in check.detail
    assert "hunter2" not in check.detail + check.error.message + json.dumps(check.to_json())
    broken = check_s3_endpoint(S3Options(endpoint_url="http://[::1"))
    assert broken.status == "fail" and broken.error is not None and broken.error.exit_code == 2
