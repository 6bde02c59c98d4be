"""`lingctl flood run` as a real subprocess: output format and order, errors file, resume after SIGKILL,
SIGTERM, text and chat prompts. Dry runs, bad input and the resume checks of settings, which load no weights,
fail before answering anything or answer two tokens, run the CLI in this process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lingctl.cli import run as cli_run
from lingctl.model.presets import preset


def write_batch(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process: exit code, stdout and stderr."""
    code = cli_run(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def greedy(cid: str, ids: list[int], n: int) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0},
    }


def test_output_is_openai_batch_format_in_batch_order(lingctl, tiny_ckpt, tmp_path):
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            greedy("long", [5, 6, 7], 40),
            greedy("short", [8, 9], 1),
            {"custom_id": "plain", "prompt": [3, 4, 5], "max_tokens": 5},
        ],
    )
    res = lingctl("flood", "run", str(batch), "--model", str(tiny_ckpt), "--max-seqs", "8", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["succeeded"] == 3 and summary["failed"] == 0
    out = read_jsonl(tmp_path / "b.output.jsonl")
    # In the batch's order, though "short" and "plain" finished first: the file is the same however it was run.
    assert [r["custom_id"] for r in out] == ["long", "short", "plain"]
    assert len({r["id"] for r in out}) == 3
    for r in out:
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "text_completion"
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        n = {"long": 40, "short": 1, "plain": 5}[r["custom_id"]]
        assert len(choice["token_ids"]) == n == body["usage"]["completion_tokens"]
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + n
    assert out[0]["response"]["body"]["model"] == "tiny"
    assert read_jsonl(tmp_path / "b.errors.jsonl") == []
    assert summary["generated_tokens"] == 46
    # prompt processing and decoding timed apart: both happened in this run
    assert summary["prompt_tokens_per_s"] > 0 and summary["decode_tokens_per_s"] > 0
    assert summary["engine"]["prefill_tokens"] == 8


def test_a_batch_job_log_says_the_plan_first(tiny_ckpt, tmp_path):
    """As a scheduler runs it: stdout and stderr into one log file. The model and memory plan are messages
    (stderr, when the run starts), the summary is the result (stdout, at the end), so the log reads in order."""
    batch = write_batch(tmp_path / "b.jsonl", [greedy("a", [5, 6, 7], 3)])
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        code = subprocess.run(
            [sys.executable, "-m", "lingctl", "flood", "run", str(batch), "-m", str(tiny_ckpt)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=120,
        ).returncode
    text = log.read_text()
    assert code == 0, text
    assert text.index("memory plan:") < text.index("1 answered")


def test_the_plan_is_a_message_and_the_summary_the_result(capsys, tiny_ckpt, tmp_path):
    batch = write_batch(tmp_path / "b.jsonl", [greedy("a", [5, 6, 7], 3)])
    code, out, err = cli(capsys, "flood", "run", str(batch), "-m", str(tiny_ckpt), "-o", str(tmp_path / "o"))
    assert code == 0, err
    assert "memory plan:" in err and "memory plan:" not in out and "1 answered" in out


def test_malformed_lines_go_to_the_errors_file_and_the_rest_run(lingctl, tiny_ckpt, tmp_path):
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            greedy("ok1", [5, 6], 2),
            "{not json",
            {"custom_id": "neg", "prompt": [1], "max_tokens": -1},
            greedy("ok1", [5], 2),
            {"custom_id": "bigid", "prompt": [5, 5000], "max_tokens": 2},
            {"custom_id": "ok2", "prompt": [7], "max_tokens": 2, "temperature": 0},
        ],
    )
    res = lingctl(
        "flood",
        "run",
        str(batch),
        "--model",
        str(tiny_ckpt),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--errors",
        str(tmp_path / "e.jsonl"),
    )
    assert res.returncode == 0, res.stderr
    assert sorted(r["custom_id"] for r in read_jsonl(tmp_path / "o.jsonl")) == ["ok1", "ok2"]
    errors = {(e["error"]["line"], e["custom_id"], e["error"]["code"]) for e in read_jsonl(tmp_path / "e.jsonl")}
    assert (2, None, "invalid_json") in errors
    assert (4, "ok1", "duplicate_custom_id") in errors
    assert any(line == 3 and cid == "neg" for line, cid, _ in errors)
    assert any(line == 5 and cid == "bigid" for line, cid, _ in errors)  # token id outside the vocabulary
    assert "2 answered" in res.stdout


def _long_batch(path: Path, n: int = 24) -> Path:
    return write_batch(path, [greedy(f"r{i:02d}", [5 + i, 6, 7 + i], 150 + 10 * (i % 4)) for i in range(n)])


def _token_ids(path: Path) -> dict[str, list[int]]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"] for r in read_jsonl(path)}


def test_resume_after_sigkill_loses_and_duplicates_nothing(lingctl, tiny_ckpt, tmp_path):
    batch = _long_batch(tmp_path / "b.jsonl")
    reference = lingctl(
        "flood", "run", str(batch), "--model", str(tiny_ckpt), "-o", str(tmp_path / "ref.jsonl"), "--max-seqs", "3"
    )
    assert reference.returncode == 0, reference.stderr
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lingctl",
            "flood",
            "run",
            str(batch),
            "--model",
            str(tiny_ckpt),
            "-o",
            str(out),
            "--max-seqs",
            "3",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 4):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = out.read_bytes()
    done_before = len(before.splitlines())
    assert 4 <= done_before < 24
    with open(out, "ab") as f:  # as if the kill had torn a line in half
        f.write(b'{"id": "batch_req_x", "custom_id": "r2')
    res = lingctl(
        "flood", "run", str(batch), "--model", str(tiny_ckpt), "-o", str(out), "--resume", "--json", "--max-seqs", "3"
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["already_done"] == done_before
    after = out.read_bytes()
    assert after.startswith(before)  # nothing already written was touched
    ids = [r["custom_id"] for r in read_jsonl(out)]
    assert sorted(ids) == sorted(f"r{i:02d}" for i in range(24))  # each exactly once
    assert _token_ids(out) == _token_ids(tmp_path / "ref.jsonl")


def test_sigterm_stops_cleanly_and_resume_finishes(lingctl, tiny_ckpt, tmp_path):
    batch = _long_batch(tmp_path / "b.jsonl", 12)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lingctl",
            "flood",
            "run",
            str(batch),
            "--model",
            str(tiny_ckpt),
            "-o",
            str(out),
            "--max-seqs",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 2):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "--resume" in err and "Traceback" not in err
    partial = len(read_jsonl(out))
    assert 2 <= partial < 12
    res = lingctl("flood", "run", str(batch), "--model", str(tiny_ckpt), "-o", str(out), "--resume")
    assert res.returncode == 0, res.stderr
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == sorted(f"r{i:02d}" for i in range(12))


def test_resume_refuses_another_model(capsys, tiny_ckpt, text_ckpt, tmp_path):
    batch = write_batch(tmp_path / "b.jsonl", [greedy("a", [5, 6], 2)])
    # A finished run to resume (two tokens: in this process, like the refusals below).
    code, _, err = cli(capsys, "flood", "run", str(batch), "--model", str(tiny_ckpt))
    assert code == 0, err
    code, _, err = cli(capsys, "flood", "run", str(batch), "--model", str(tiny_ckpt))
    assert code == 2 and "--resume" in err
    code, _, err = cli(capsys, "flood", "run", str(batch), "--model", str(text_ckpt), "--resume")
    assert code == 2 and "model_fingerprint" in err
    assert "Traceback" not in err
    # settings that do not change answers may change on resume
    code, _, err = cli(
        capsys, "flood", "run", str(batch), "--model", str(tiny_ckpt), "--resume", "--max-batch-tokens", "64"
    )
    assert code == 0, err


def test_text_chat_and_stop_strings(lingctl, text_ckpt, tmp_path):
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            {"custom_id": "text", "prompt": "the quick brown", "max_tokens": 12, "temperature": 0},
            {
                "custom_id": "chat",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "the lazy dog"}], "max_tokens": 6, "temperature": 0},
            },
        ],
    )
    res = lingctl("flood", "run", str(batch), "--model", str(text_ckpt), "--json")
    assert res.returncode == 0, res.stderr
    out = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(tmp_path / "b.output.jsonl")}
    assert out["chat"]["object"] == "chat.completion"
    assert out["chat"]["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(out["chat"]["choices"][0]["message"]["content"], str)
    text = out["text"]["choices"][0]["text"]
    assert len(text) > 0
    # Stop at a string the unconstrained output contains: the text ends just before it.
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    batch2 = write_batch(
        tmp_path / "c.jsonl",
        [{"custom_id": "text", "prompt": "the quick brown", "max_tokens": 12, "temperature": 0, "stop": [stop]}],
    )
    res2 = lingctl("flood", "run", str(batch2), "--model", str(text_ckpt))
    assert res2.returncode == 0, res2.stderr
    choice = read_jsonl(tmp_path / "c.output.jsonl")[0]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.find(stop)]


def test_chat_without_a_template_is_a_per_request_error(lingctl, text_ckpt, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in text_ckpt.iterdir():
        if f.name != "tokenizer_config.json":
            (bare / f.name).symlink_to(f)
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            {"custom_id": "chat", "messages": [{"role": "user", "content": "hi"}]},
            {"custom_id": "text", "prompt": "the", "max_tokens": 2},
        ],
    )
    res = lingctl("flood", "run", str(batch), "--model", str(bare))
    assert res.returncode == 0, res.stderr
    errors = read_jsonl(tmp_path / "b.errors.jsonl")
    assert [e["custom_id"] for e in errors] == ["chat"] and "chat template" in errors[0]["error"]["message"]
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "b.output.jsonl")] == ["text"]


@pytest.mark.parametrize("case", ["missing", "file", "no_config", "bad_config", "bad_weights"])
def test_bad_model_directory_is_one_line(capsys, tiny_ckpt, tmp_path, case):
    batch = write_batch(tmp_path / "b.jsonl", [greedy("a", [5], 2)])
    model = tmp_path / "m"
    if case == "file":
        model.write_text("x")
    elif case != "missing":
        model.mkdir()
        if case == "bad_config":
            (model / "config.json").write_text("{not json")
        elif case == "bad_weights":
            (model / "config.json").write_bytes((tiny_ckpt / "config.json").read_bytes())
            (model / "model.safetensors").write_bytes(b"\x00" * 5)
    code, _, err = cli(capsys, "flood", "run", str(batch), "--model", str(model))
    assert code in (1, 2, 3)
    if case in ("missing", "no_config"):
        assert code == 3
    assert "Traceback" not in err
    assert err.startswith("lingctl: error: ") and len(err.strip().splitlines()) <= 2
    assert not (tmp_path / "b.output.jsonl").exists() or case == "bad_weights"


def test_missing_batch_file_and_bad_options(capsys, tiny_ckpt, tmp_path):
    code, _, err = cli(capsys, "flood", "run", str(tmp_path / "nope.jsonl"), "--model", str(tiny_ckpt))
    assert code == 3 and "Traceback" not in err
    batch = write_batch(tmp_path / "b.jsonl", [greedy("a", [5], 2)])
    for args in (["--stages", "0"], ["--quantize", "int4"], ["--dtype", "float64"], ["--max-batch-tokens", "2"]):
        code, _, err = cli(capsys, "flood", "run", str(batch), "--model", str(tiny_ckpt), *args)
        assert code == 2, (args, err)
        assert "Traceback" not in err


def _config_only(path: Path, name: str) -> Path:
    path.mkdir()
    cfg = preset(name)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return path


def test_dry_run_plans_ling_lite_from_its_config_alone(capsys, tmp_path):
    model = _config_only(tmp_path / "ling-lite", "ling-lite")
    batch = write_batch(tmp_path / "b.jsonl", [greedy(f"r{i}", [5] * 100, 200) for i in range(8)])
    code, _, err = cli(capsys, "flood", "run", str(batch), "--model", str(model), "--dtype", "bfloat16", "--dry-run")
    assert code == 1 and "quantize int8" in err and "Traceback" not in err
    code, out, err = cli(
        capsys,
        "flood",
        "run",
        str(batch),
        "--model",
        str(model),
        "--dtype",
        "bfloat16",
        "--quantize",
        "int8",
        "--dry-run",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert 16.5e9 < plan["params"] < 17.1e9
    assert plan["weights_bytes"] < 18e9
    assert plan["kv_tokens"] >= 8 * 300 - 7 * 96  # the batch fits (the shared 96-token prefix counted once)
    assert not (tmp_path / "b.output.jsonl").exists()  # a dry run writes nothing
    code, _, err = cli(
        capsys,
        "flood",
        "run",
        str(batch),
        "--model",
        str(model),
        "--quantize",
        "int8",
        "--dry-run",
        "--kv-cache-tokens",
        "100000000",
    )
    assert code == 1 and "--kv-cache-tokens" in err


def test_dry_run_resume_counts_what_is_already_answered_and_changes_nothing(capsys, tiny_ckpt, tmp_path):
    batch = write_batch(tmp_path / "b.jsonl", [greedy(f"r{i}", [5 + i, 6], 2) for i in range(3)])
    code, _, err = cli(capsys, "flood", "run", str(batch), "--model", str(tiny_ckpt))
    assert code == 0, err
    write_batch(batch, [greedy(f"r{i}", [5 + i, 6], 2) for i in range(5)])  # two more requests
    with open(tmp_path / "b.output.jsonl", "ab") as f:  # and a torn line, as a crash leaves one
        f.write(b'{"id": "batch_req_x", "custom_id": "r3", "resp')
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    args = ("flood", "run", str(batch), "--model", str(tiny_ckpt), "--dry-run", "--resume")
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["requests"], summary["already_done"]) == (5, 3)
    code, out, err = cli(capsys, *args)
    assert code == 0 and "5 requests (0 invalid lines, 3 already answered)" in out, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files  # the torn line is left for the run


def test_stages_2_gives_the_same_answers_as_one(lingctl, tiny_ckpt, tmp_path):
    batch = write_batch(tmp_path / "b.jsonl", [greedy(f"r{i}", [5 + i] * (3 + 7 * i), 10) for i in range(6)])
    one = lingctl("flood", "run", str(batch), "--model", str(tiny_ckpt), "-o", str(tmp_path / "one.jsonl"))
    assert one.returncode == 0, one.stderr
    two = lingctl(
        "flood",
        "run",
        str(batch),
        "--model",
        str(tiny_ckpt),
        "-o",
        str(tmp_path / "two.jsonl"),
        "--stages",
        "2",
        env={**os.environ, "LINGCTL_DEBUG": "1"},
    )
    assert two.returncode == 0, two.stderr
    assert _token_ids(tmp_path / "one.jsonl") == _token_ids(tmp_path / "two.jsonl")


def test_requests_the_engine_cannot_run_fail_alone_and_resume_survives_them(capsys, lingctl, text_ckpt, tmp_path):
    """A lone surrogate (valid JSON "\\ud800") in a prompt or a custom_id, and a temperature or top_p too small
    to compute with, each get their error line; the other requests are answered, the exit code is 0 (failures
    one by one are counted, not fatal), and --resume over those files continues."""
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            {"custom_id": "ok", "prompt": "the quick brown", "max_tokens": 3, "temperature": 0},
            {"custom_id": "chat", "messages": [{"role": "user", "content": "the lazy dog"}], "max_tokens": 3},
            {"custom_id": "sur-prompt", "prompt": "the \ud800 quick", "max_tokens": 3},
            {"custom_id": "s\ud800", "prompt": "the", "max_tokens": 3},
            {"custom_id": "cold", "prompt": "the", "temperature": 5e-324},
            {"custom_id": "narrow", "prompt": "the", "top_p": 1e-100},
            {"custom_id": "sampled", "prompt": [5, 6], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9},
        ],
    )
    assert "\\ud800" in batch.read_text()  # json.dumps wrote the surrogates as escapes: valid JSON, valid UTF-8
    res = lingctl("flood", "run", str(batch), "--model", str(text_ckpt), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert (summary["succeeded"], summary["invalid_lines"]) == (3, 4)
    out_path, err_path = tmp_path / "b.output.jsonl", tmp_path / "b.errors.jsonl"
    assert sorted(r["custom_id"] for r in read_jsonl(out_path)) == ["chat", "ok", "sampled"]
    errors = {e["error"]["line"]: e for e in read_jsonl(err_path)}
    assert sorted(errors) == [3, 4, 5, 6]
    assert errors[3]["custom_id"] == "sur-prompt" and "prompt is not valid Unicode" in errors[3]["error"]["message"]
    assert errors[3]["response"]["status_code"] == 400
    assert errors[4]["custom_id"] is None and errors[4]["response"] is None  # an id that cannot be written back
    assert "custom_id is not valid Unicode" in errors[4]["error"]["message"]
    assert "temperature must be" in errors[5]["error"]["message"] and errors[5]["custom_id"] == "cold"
    assert "top_p must be" in errors[6]["error"]["message"] and errors[6]["custom_id"] == "narrow"
    for path in (out_path, err_path):
        path.read_bytes().decode("utf-8")  # both files stay valid UTF-8

    # An answer under a surrogate custom_id, as an older lingctl could write it, and one more request.
    with open(out_path, "ab") as f:
        f.write(b'{"id": "batch_req_old", "custom_id": "old\\ud800", "response": null, "error": null}\n')
    with open(batch, "a") as f:
        f.write(json.dumps({"custom_id": "late", "prompt": [7, 8], "max_tokens": 2}) + "\n")
    before_out, before_err = out_path.read_bytes(), err_path.read_bytes()
    again = lingctl("flood", "run", str(batch), "--model", str(text_ckpt), "--resume", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["already_done"] == 3
    assert out_path.read_bytes().startswith(before_out) and err_path.read_bytes() == before_err
    assert [r["custom_id"] for r in read_jsonl(out_path)][-1] == "late"

    # A template file that is not there is one line (a different template on resume: tests/flood/test_run.py).
    code, _, err = cli(
        capsys,
        "flood",
        "run",
        str(batch),
        "--model",
        str(text_ckpt),
        "-o",
        str(tmp_path / "n.jsonl"),
        "--chat-template",
        str(tmp_path / "nonexist"),
    )
    assert code == 3 and "nonexist: no such file or directory" in err
    assert "Traceback" not in err and err.startswith("lingctl: error: ")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "n.jsonl").exists()


def test_n_answers_come_as_the_choices_of_one_line(capsys, tiny_ckpt, tmp_path):
    """n samples per request, as vLLM's: choice j draws from seed + j, so choice 0 is the n=1 answer and a
    request asking n=2 with seed 8 gets, as its second choice, the answer of seed 9."""
    sampled = {"max_tokens": 6, "temperature": 1.0}
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            {"custom_id": "three", "prompt": [5, 6, 7], "n": 3, "seed": 8, **sampled},
            {"custom_id": "one", "prompt": [5, 6, 7], "seed": 8, **sampled},
            {"custom_id": "nine", "prompt": [5, 6, 7], "seed": 9, **sampled},
            {"custom_id": "greedy", "prompt": [5, 6, 7], "n": 2, "max_tokens": 6, "temperature": 0},
        ],
    )
    code, out, err = cli(capsys, "flood", "run", str(batch), "-m", str(tiny_ckpt), "--json")
    assert code == 0, err
    assert json.loads(out)["succeeded"] == 4
    answers = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(tmp_path / "b.output.jsonl")}
    three = answers["three"]["choices"]
    assert [c["index"] for c in three] == [0, 1, 2]
    assert three[0]["token_ids"] == answers["one"]["choices"][0]["token_ids"]
    assert three[1]["token_ids"] == answers["nine"]["choices"][0]["token_ids"]
    usage = answers["three"]["usage"]
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == sum(len(c["token_ids"]) for c in three)
    g = answers["greedy"]["choices"]
    assert len(g) == 2 and g[0]["token_ids"] == g[1]["token_ids"]


def test_logprobs_in_completion_and_chat_answers(capsys, text_ckpt, tmp_path):
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            {"custom_id": "c", "prompt": "the quick brown", "max_tokens": 4, "temperature": 0, "logprobs": 2},
            {
                "custom_id": "m",
                "messages": [{"role": "user", "content": "the quick"}],
                "max_tokens": 3,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 1,
            },
        ],
    )
    code, _, err = cli(capsys, "flood", "run", str(batch), "-m", str(text_ckpt))
    assert code == 0, err
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in read_jsonl(tmp_path / "b.output.jsonl")}
    c = answers["c"]
    lp = c["logprobs"]
    n = len(c["token_ids"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(x <= 0 for x in lp["token_logprobs"]) and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]).strip() == c["text"].strip()
    content = answers["m"]["logprobs"]["content"]
    assert len(content) == len(answers["m"]["token_ids"])
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"} and len(first["top_logprobs"]) == 1
    assert bytes(first["bytes"]).decode("utf-8") == first["token"]
    assert first["top_logprobs"][0]["logprob"] >= first["logprob"] - 1e-6


def test_a_list_of_prompts_gets_n_choices_per_prompt_in_order(capsys, tiny_ckpt, tmp_path):
    batch = write_batch(
        tmp_path / "b.jsonl",
        [
            {"custom_id": "many", "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3, "temperature": 0},
            {"custom_id": "first", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0},
            {"custom_id": "second", "prompt": [8, 9], "max_tokens": 3, "temperature": 0},
        ],
    )
    code, _, err = cli(capsys, "flood", "run", str(batch), "-m", str(tiny_ckpt))
    assert code == 0, err
    answers = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(tmp_path / "b.output.jsonl")}
    choices = answers["many"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt 0's two answers, then prompt 1's
    first, second = answers["first"]["choices"][0]["token_ids"], answers["second"]["choices"][0]["token_ids"]
    assert [c["token_ids"] for c in choices] == [first, first, second, second]
    assert answers["many"]["usage"]["prompt_tokens"] == 5  # each prompt once
