"""lingctl's S3 commands against a hostile or broken endpoint: a fake S3 on 127.0.0.1 whose chosen operation
misbehaves (tests/support/hostile_http.py), run as real ``lingctl`` processes.

Every failure is one line with its exit code, never a traceback; a process stays small however much the
server offers; a listing that goes round in circles ends; a certificate that fails verification is not
retried; and nothing secret that a server echoes back, or that a user typed into an endpoint URL, is shown.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lingctl.core.errors import LingctlError
from lingctl.core.storage import S3Options, open_store
from tests.conftest import run_lingctl
from tests.support.hostile_http import (
    FakeObject,
    FakeS3,
    HostileServer,
    Request,
    Script,
    Wire,
    answer,
    chunked_forever,
    endless_body,
    error,
    head,
    list_page,
)

GiB, MiB = 1 << 30, 1 << 20
KEY_ID = "AKIDHOSTILETEST00001"
SECRET = "hostile-secret-key-0123456789abcdefABCDEF"
TOKEN = "hostile-session-token-FwoGZXIvYXdzEJr-0123456789"
OBJ_HEAD = ('ETag: "0123456789abcdef0123456789abcdef"', "Last-Modified: Tue, 02 Jan 2024 03:04:05 GMT")
# Peak memory of the whole lingctl process: about 70 MiB for these commands; unbounded, the GiB the server
# offers would be held (1.1 to 3 GB before reads were bounded).
PEAK_MIB = 300
# Bytes the server may hand over per request before lingctl drops the connection: the few MiB the loopback
# socket buffers hold.
TAKEN = 16 * MiB


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
        "LINGCTL_CACHE_DIR": str(tmp_path / "cache"),
    }


@pytest.fixture
def serve() -> Iterator[object]:
    servers: list[HostileServer] = []

    def _serve(script: Script, tls: ssl.SSLContext | None = None) -> HostileServer:
        servers.append(HostileServer(script, tls=tls))
        return servers[-1]

    yield _serve
    for server in servers:
        server.stop()


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if not line.startswith(("lingctl: WARNING", "warning: "))]
    assert lines and lines[0].startswith("lingctl: error: "), stderr
    assert len(lines) <= 2 and all(line.startswith(("lingctl: error: ", "hint: ")) for line in lines), stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return lines[0]


def peak_run(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """``lingctl ARGS`` in a child of a small wrapper process, and its peak resident memory in MiB (the
    wrapper's only child, so nothing else this test session ran counts)."""
    wrapper = (
        "import json, resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(json.dumps({'rc': p.returncode, 'out': p.stdout, 'err': p.stderr, 'peak': peak}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", wrapper, sys.executable, "-m", "lingctl", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    doc = json.loads(out.stdout)
    return subprocess.CompletedProcess(args, doc["rc"], doc["out"], doc["err"]), doc["peak"]


# -- 1. memory -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostile",
    [
        endless_body(head("200 OK", f"Content-Length: {GiB}", *OBJ_HEAD)),
        chunked_forever(),
        endless_body(head("200 OK", *OBJ_HEAD, version="HTTP/1.0")),
        endless_body(head("500 Internal Error", f"Content-Length: {GiB}")),
    ],
    ids=["content-length-1GiB", "endless-chunks", "to-the-close", "500-with-1GiB"],
)
def test_a_get_of_a_small_object_answered_with_a_gib_stays_small(serve, env, tmp_path: Path, hostile: Script) -> None:
    server = serve(FakeS3("bkt", {"obj.bin": FakeObject(1000)}, on_get=hostile))
    r, peak = peak_run("babel", "copy", "s3://bkt/", str(tmp_path / "dst"), "--retries", "1", "--json",
                       "--endpoint-url", server.endpoint, env=env)  # fmt: skip
    assert r.returncode == 5
    assert "could not" not in one_line_error(r.stderr)  # the server was reached; it sent too much
    gets = [q for q in server.requests if q.method == "GET" and q.path == "/bkt/obj.bin"]
    assert gets and server.sent < TAKEN * len(gets) + MiB
    assert peak < PEAK_MIB
    assert json.loads(r.stdout)["copied"] == 0 and not (tmp_path / "dst" / "obj.bin").exists()


def test_a_put_answered_with_a_gib_stays_small(serve, env, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 1000)
    server = serve(FakeS3("bkt", on_put=endless_body(head("200 OK", f"Content-Length: {GiB}"))))
    r, peak = peak_run("babel", "copy", str(src), "s3://bkt/", "--retries", "2", "--endpoint-url", server.endpoint,
                       env=env)  # fmt: skip
    assert r.returncode == 5
    assert "declares a body of 1073741824 bytes, more than the 1048576 this request can need" in one_line_error(
        r.stderr
    )
    puts = [q for q in server.requests if q.method == "PUT"]
    assert len(puts) == 2 and server.sent < TAKEN * len(puts)
    assert peak < PEAK_MIB


# -- 2. time: a listing that goes round in circles -------------------------------------------------------------


def _same_token_for_ever(request: Request, wire: Wire) -> bool:
    return wire.send(list_page({"a.bin": FakeObject(3), "b.bin": FakeObject(4)}, truncated_with="again"))


@pytest.mark.parametrize("recursive", [True, False], ids=["signed-lister", "boto3-listing"])
def test_a_listing_that_repeats_its_continuation_token_ends(serve, env, recursive: bool) -> None:
    server = serve(FakeS3("bkt", on_list=_same_token_for_ever))
    r = run_lingctl("babel", "ls", "s3://bkt/data", *(["-R"] if recursive else []), "--endpoint-url", server.endpoint,
                    env=env)  # fmt: skip
    assert r.returncode == 1
    line = one_line_error(r.stderr)
    assert "repeats a continuation token when listing bkt/data/" in line and "would never end" in line
    lists = [q for q in server.requests if "list-type" in q.query]
    assert 2 <= len(lists) <= 3  # the second page gives it away; no retries either


# -- 3. garbage in headers: one line, never a traceback --------------------------------------------------------


@pytest.mark.parametrize(
    ("raw_head", "exit_code"),
    [
        (head("200 OK", "Content-Length: abc", *OBJ_HEAD), 5),
        (head("200 OK", "Content-Length: -5", *OBJ_HEAD), 5),
        (head("200 OK", "Content-Length: 1000", "Content-Length: 7", *OBJ_HEAD), 5),
        (head("2x0 OK", "Content-Length: 1000"), 5),
        (b"HTTP/1.1 200 OK\r\nContent-Length 1000\r\n\r\n", 5),  # no colon
        (head("200 OK", "Content-Length: 1000", 'ETag: "\xff\xfe\x01"', "Last-Modified: yesterday"), 5),
    ],
    ids=["length-not-a-number", "negative-length", "conflicting-lengths", "status", "no-colon", "garbage-etag-date"],
)
def test_garbage_headers_on_a_get_are_one_line_errors(serve, env, tmp_path: Path, raw_head: bytes, exit_code: int):
    server = serve(FakeS3("bkt", {"obj.bin": FakeObject(1000)}, on_get=answer(raw_head + bytes(1000))))
    r = run_lingctl("babel", "copy", "s3://bkt/", str(tmp_path / "dst"), "--retries", "1", "--endpoint-url",
                    server.endpoint, env=env)  # fmt: skip
    assert r.returncode == exit_code
    one_line_error(r.stderr)


@pytest.mark.parametrize(
    "raw_head",
    [
        head("200 OK", "Content-Length: 12", 'ETag: "e"', "Last-Modified: not a date"),
        head("200 OK", "Content-Length: twelve", 'ETag: "e"', "Last-Modified: Tue, 02 Jan 2024 03:04:05 GMT"),
        head("200 OK", "Content-Length: \xb2", 'ETag: "e"', "Last-Modified: Tue, 02 Jan 2024 03:04:05 GMT"),
        head("200 OK", 'ETag: "e"'),  # neither size nor date
        head("200 OK", "Content-Length: 12", "Last-Modified: Tue, 02 Jan 2024 03:04:05 GMT",
             "x-amz-checksum-crc64nvme: \x01\xff", "x-amz-meta-lingctl-mtime: nan", "x-amz-meta-mtime: 1e999"),
    ],
    ids=["date", "length", "latin-1-digit", "missing", "garbage-checksum-and-mtimes"],
)  # fmt: skip
def test_garbage_in_a_head_answer_is_a_clean_error(serve, monkeypatch, env, raw_head: bytes) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(name, env[name])
    server = serve(FakeS3("bkt", on_head=answer(raw_head)))
    store = open_store("s3://bkt", S3Options(endpoint_url=server.endpoint, max_attempts=1))
    try:
        info = store.head("obj.bin")
    except LingctlError as err:
        assert err.exit_code == 1 and "MalformedReply" in err.message and "\n" not in err.message
    else:  # garbage where a fallback exists: taken as "no checksum", "no recorded mtime"
        assert info is not None and info.size == 12 and info.mtime == 1704164645.0


# -- 4. certificates -----------------------------------------------------------------------------------------


def _certificate(d: Path, name: str, san: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "2", "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Self-signed certificates made by the openssl command: one for 127.0.0.1, one for another host."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")
    return {
        "ip": _certificate(d, "127.0.0.1", "IP:127.0.0.1"),
        "other": _certificate(d, "s3.example", "DNS:s3.example"),
    }


def _tls(pair: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*pair)
    return context


@pytest.mark.parametrize(("recursive", "bundle"), [(False, None), (True, None), (False, "other"), (True, "other")])
def test_a_certificate_that_fails_verification_is_exit_1_and_not_retried(
    serve, env, certificates, recursive: bool, bundle: str | None
) -> None:
    # Unknown CA (the default bundle), or a trusted certificate for another host name.
    server = serve(FakeS3("bkt", {"a.bin": FakeObject(3)}), tls=_tls(certificates["other" if bundle else "ip"]))
    if bundle is not None:
        env = {**env, "AWS_CA_BUNDLE": str(certificates[bundle][0])}
    r = run_lingctl("babel", "ls", "s3://bkt", *(["-R"] if recursive else []), "--endpoint-url", server.endpoint,
                    env=env)  # fmt: skip
    assert r.returncode == 1
    line = one_line_error(r.stderr)
    assert f"the TLS certificate of S3 endpoint {server.endpoint} failed verification" in line
    assert ("self-signed" in line) if bundle is None else ("mismatch" in line)
    assert "AWS_CA_BUNDLE" in r.stderr
    assert server.connections == 1  # the default 5 attempts were not spent on it
    trusted = run_lingctl("babel", "ls", "s3://bkt", "--endpoint-url", server.endpoint,
                          env={**env, "AWS_CA_BUNDLE": str(certificates["ip"][0])})  # fmt: skip
    if bundle is None:  # the same server with its certificate trusted: the listing works
        assert trusted.returncode == 0 and "a.bin" in trusted.stdout, trusted.stderr


# -- 5. secrets ----------------------------------------------------------------------------------------------


def _echo(status: int) -> Script:
    """An error that quotes the request's credentials back: Authorization in the message and in a header,
    the session token, and the secret key itself."""

    def script(request: Request, wire: Wire) -> bool:
        auth = request.headers.get("authorization", "")
        token = request.headers.get("x-amz-security-token", "")
        message = (
            f"denied; token {token}; X-Amz-Security-Token={token}; secret {SECRET}; you sent Authorization: {auth}"
        )
        return wire.send(error(status, "AccessDenied" if status == 403 else "InternalError", message,
                               f"X-Echo-Authorization: {auth}"))  # fmt: skip

    return script


@pytest.mark.parametrize(
    ("command", "operation", "status"),
    [
        (["ls", "s3://bkt", "-R"], "on_list", 403),
        (["ls", "s3://bkt"], "on_list", 403),  # the boto3 listing
        (["ls", "s3://bkt", "-R"], "on_list", 500),
        (["ls", "s3://bkt"], "on_list", 500),
        (["copy", "s3://bkt/", "DST"], "on_get", 403),
        (["copy", "s3://bkt/", "DST"], "on_get", 500),
    ],
)
def test_credentials_a_server_echoes_are_never_shown(
    serve, env, tmp_path: Path, command: list[str], operation: str, status: int
) -> None:
    fake = FakeS3("bkt", {"a.bin": FakeObject(3)})
    setattr(fake, operation, _echo(status))
    server = serve(fake)
    args = [str(tmp_path / "dst") if a == "DST" else a for a in command]
    r = run_lingctl("babel", *args, "--json", "--retries", "1", "--endpoint-url", server.endpoint,
                    env={**env, "AWS_SESSION_TOKEN": TOKEN})  # fmt: skip
    assert r.returncode == (5 if status == 500 else 1)
    line = one_line_error(r.stderr)
    assert "AccessDenied" in line or "denied" in line or "InternalError" in line
    signatures = [q.headers["authorization"].rpartition("Signature=")[2] for q in server.requests]
    shown = r.stdout + r.stderr
    for secret in (SECRET, TOKEN, KEY_ID, *signatures):
        assert secret not in shown


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_query_secrets_in_an_endpoint_url_are_never_shown(env, how: str) -> None:
    endpoint = "http://127.0.0.1:9/?token=SECRET-TOKEN-1&plain=SECRET-VALUE-2#SECRET-FRAGMENT-3"
    if how == "flag":
        r = run_lingctl("babel", "ls", "s3://bkt", "--endpoint-url", endpoint, env=env)
    else:
        r = run_lingctl("babel", "ls", "s3://bkt", env={**env, "AWS_ENDPOINT_URL": endpoint})
    assert r.returncode == 2
    assert "takes no query or fragment" in one_line_error(r.stderr)
    assert "SECRET" not in r.stdout + r.stderr
