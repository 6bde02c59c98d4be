"""``run_batch`` in process, on the tiny text checkpoint: chat templates that hang or build huge strings fail
only the requests they were rendering, within a bounded time, and ``--resume`` holds the run to its template."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from lingctl.core.errors import LingctlError, NotFoundError, UsageError
from lingctl.flood.batch.run import FloodOptions, run_batch
from lingctl.flood.engine.options import EngineOptions
from lingctl.model.chat_template import TemplateLimits
from tests.flood.conftest import CHAT_TEMPLATE

LIMITS = TemplateLimits(timeout_s=0.5, grace_s=1.0)
# The hostile part runs only for the request whose first message says so; the others render normally.
TEMPLATE = (
    "{% set c = messages[0]['content'] %}"
    "{% if c == 'nested' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% if c == 'range6' %}{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}{% endfor %}"
    "{% endif %}"
    "{% if c == 'huge' %}{{ 'x' * 10**9 }}{% endif %}"
    "{% if c == 'doubling' %}{% set ns = namespace(s=c) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% endif %}" + CHAT_TEMPLATE
)
HOSTILE = ["nested", "range6", "huge", "doubling"]


def _chat(cid: str, content: str) -> dict:
    return {"custom_id": cid, "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def hostile_run(text_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FloodOptions, float]:
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "t.jinja").write_text(TEMPLATE)
    lines = [
        _chat("ok1", "the lazy dog"),
        *(_chat(name, name) for name in HOSTILE),
        _chat("ok2", "the quick"),
        {"custom_id": "text", "prompt": "the quick brown", "max_tokens": 3, "temperature": 0},
    ]
    (tmp / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    opts = FloodOptions(
        batch=tmp / "b.jsonl",
        model=text_ckpt,
        chat_template=tmp / "t.jinja",
        template_limits=LIMITS,
        engine=EngineOptions(threads=1),
    )
    started = time.monotonic()
    summary = run_batch(opts)
    seconds = time.monotonic() - started
    assert (summary.succeeded, summary.failed) == (3, len(HOSTILE))
    return tmp, opts, seconds


def test_hostile_templates_fail_only_their_requests(hostile_run: tuple[Path, FloodOptions, float]) -> None:
    tmp, _, seconds = hostile_run
    assert sorted(r["custom_id"] for r in _records(tmp / "b.output.jsonl")) == ["ok1", "ok2", "text"]
    errors = {e["custom_id"]: e for e in _records(tmp / "b.errors.jsonl")}
    assert sorted(errors) == sorted(HOSTILE)
    for e in errors.values():
        assert e["error"]["code"] == "invalid_prompt" and e["response"]["status_code"] == 400
    assert "took longer than 0.5 s" in errors["nested"]["error"]["message"]
    assert "Range too big" in errors["range6"]["error"]["message"]
    assert "over the limit" in errors["huge"]["error"]["message"]
    assert "MiB" in errors["doubling"]["error"]["message"] or "took longer" in errors["doubling"]["error"]["message"]
    # Each hostile render is bounded by its limit (0.5 s, 1.5 s at most for a killed worker); the rest of
    # the time is a tiny model. Slack for a busy machine.
    assert seconds < 60


def test_resume_renders_nothing_already_answered(hostile_run: tuple[Path, FloodOptions, float]) -> None:
    tmp, opts, _ = hostile_run
    before = (tmp / "b.errors.jsonl").read_bytes(), (tmp / "b.output.jsonl").read_bytes()
    started = time.monotonic()
    summary = run_batch(dataclasses.replace(opts, resume=True))
    assert summary.already_done == 3 + len(HOSTILE) and summary.failed == 0 and summary.succeeded == 0
    assert time.monotonic() - started < 0.5 + 10  # the hanging template was not rendered again
    assert ((tmp / "b.errors.jsonl").read_bytes(), (tmp / "b.output.jsonl").read_bytes()) == before


def test_resume_with_another_chat_template_is_refused(hostile_run: tuple[Path, FloodOptions, float]) -> None:
    tmp, opts, _ = hostile_run
    (tmp / "other.jinja").write_text(CHAT_TEMPLATE)
    before = (tmp / "b.output.jsonl").read_bytes()
    with pytest.raises(UsageError, match="chat_template_sha256") as info:
        run_batch(dataclasses.replace(opts, resume=True, chat_template=tmp / "other.jinja"))
    assert "\n" not in info.value.message
    with pytest.raises(UsageError, match="chat_template_sha256"):  # the model's own template is another one
        run_batch(dataclasses.replace(opts, resume=True, chat_template=None))
    assert (tmp / "b.output.jsonl").read_bytes() == before


def test_a_missing_chat_template_file_is_not_found(hostile_run: tuple[Path, FloodOptions, float]) -> None:
    tmp, opts, _ = hostile_run
    with pytest.raises(NotFoundError, match="--chat-template .*nonexist: no such file"):
        run_batch(dataclasses.replace(opts, chat_template=tmp / "nonexist", out=tmp / "n.jsonl"))
    assert not (tmp / "n.jsonl").exists()


def test_a_template_that_parses_but_does_not_compile_fails_the_run(text_ckpt: Path, tmp_path: Path) -> None:
    nested = "{% for m in messages %}" * 30 + "x" + "{% endfor %}" * 30  # Python allows 20 nested blocks
    (tmp_path / "t.jinja").write_text(nested)
    (tmp_path / "b.jsonl").write_text(json.dumps(_chat("a", "hi")) + "\n")
    with pytest.raises(LingctlError, match="the chat template does not compile: SyntaxError") as info:
        run_batch(
            FloodOptions(
                batch=tmp_path / "b.jsonl",
                model=text_ckpt,
                chat_template=tmp_path / "t.jinja",
                template_limits=LIMITS,
                dry_run=True,
            )
        )
    assert "\n" not in str(info.value)
