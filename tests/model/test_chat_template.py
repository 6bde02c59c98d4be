"""Chat templates render in a worker process under time, output and memory limits: a template that hangs or
builds huge strings fails the request it was rendering, and the next request renders normally."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from lingctl.core.errors import LingctlError
from lingctl.model.chat_template import RenderError, TemplateLimits, TemplateRenderer, TextTemplates
from tests.flood.conftest import CHAT_TEMPLATE

LIMITS = TemplateLimits(timeout_s=0.5, grace_s=1.0, max_chars=100_000, memory_bytes=256 << 20)
# Each request either renders normally or, when its content says so, runs the hostile part.
HOSTILE = {
    # 10**10 empty iterations: no call, no attribute read, no output for a hook to count.
    "nested": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # The sandbox's own range cap raises (OverflowError); that too is the request's error.
    "range6": "{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 10**9 }}",
    "stream": "{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}",
    # Doubling a string 40 times: C-level joins, stopped by the worker's memory cap.
    "double": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "bigint": "{{ (10**4096)**4096 }}",
    # transformers' tojson is json.dumps, whose indent is built as one string of that many spaces.
    "indent": "{{ messages | tojson(indent=10**9) }}",
}
# Reaching past transformers' globals: namespace refuses underscore names, dict and functions expose no type.
ESCAPES = {
    "ns_init": "{% set ns = namespace(_Namespace__attrs=1) %}",
    "ns_set": "{% set ns = namespace(a=1) %}{% set ns._x = 1 %}",
    "dict_type": "{{ dict.__class__.__subclasses__() }}",
    "fn_globals": "{{ strftime_now.__globals__['os'] }}",
}
TEMPLATE = (
    "{% set c = messages[0]['content'] %}"
    + "".join(f"{{% if c == '{name}' %}}{body}{{% endif %}}" for name, body in (HOSTILE | ESCAPES).items())
    + CHAT_TEMPLATE
)
ERRORS = {
    "nested": "took longer than 0.5 s",
    "range6": "Range too big",
    "repeat": "over the limit of 100,000",
    "stream": "produced more than 100,000 characters",
    "bigint": "integer of about",
    "double": "more than 256 MiB|took longer than",  # whichever limit it reaches first
    "indent": "more than 256 MiB",
}


def _msg(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def renderer() -> Iterator[TemplateRenderer]:
    with TemplateRenderer(TEMPLATE, LIMITS) as r:
        yield r


def test_renders_as_jinja_does(renderer: TemplateRenderer) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi ✓ \U0001f600"}]
    expected = (
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages, add_generation_prompt=True)
    )
    assert renderer.render(messages) == expected == "<|system|>Be brief.\n<|user|>hi ✓ \U0001f600\n<|assistant|>"


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_template_over_a_limit_fails_that_request_only(renderer: TemplateRenderer, name: str) -> None:
    started = time.monotonic()
    with pytest.raises(RenderError, match=ERRORS[name]):
        renderer.render(_msg(name))
    # The worker's own timer ends a render at 0.5 s; the parent's deadline adds 1 s. Slack for a busy machine.
    assert time.monotonic() - started < 10
    assert renderer.render(_msg("fine")) == "<|user|>fine\n<|assistant|>"


def test_the_hostile_renders_cost_no_memory_here(renderer: TemplateRenderer) -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name in ("repeat", "double"):
        with pytest.raises(RenderError):
            renderer.render(_msg(name))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: under 64 MiB


def test_a_worker_that_stops_answering_is_killed_and_replaced() -> None:
    with TemplateRenderer(CHAT_TEMPLATE, LIMITS) as r:
        assert r.render(_msg("a")) == "<|user|>a\n<|assistant|>"
        stuck = r.worker_pid
        assert stuck is not None
        os.kill(stuck, signal.SIGSTOP)  # as C code that never returns to Python would
        started = time.monotonic()
        with pytest.raises(RenderError, match="took longer than 0.5 s"):
            r.render(_msg("b"))
        assert 1.5 <= time.monotonic() - started < 10  # timeout + grace, then killed
        assert r.render(_msg("c")) == "<|user|>c\n<|assistant|>"
        assert r.worker_pid != stuck


def test_a_worker_killed_while_idle_is_replaced_without_failing_a_request() -> None:
    with TemplateRenderer(CHAT_TEMPLATE, LIMITS) as r:
        r.render(_msg("a"))
        first = r.worker_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        os.waitpid(first, 0)
        assert r.render(_msg("b")) == "<|user|>b\n<|assistant|>"
        assert r.worker_pid != first


def test_close_ends_the_worker() -> None:
    r = TemplateRenderer(CHAT_TEMPLATE, LIMITS)
    r.render(_msg("a"))
    pid = r.worker_pid
    assert pid is not None
    r.close()
    assert r.worker_pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("source", ["{% for m in messages %}", "{{ x | }}", "{% if %}" * 2000])
def test_a_template_that_does_not_parse_is_one_error_before_any_work(source: str) -> None:
    with pytest.raises(LingctlError, match="the chat template does not compile") as info:
        TemplateRenderer(source, LIMITS)
    assert "\n" not in info.value.message


@pytest.mark.parametrize("name", list(ESCAPES))
def test_the_globals_transformers_adds_stay_in_the_sandbox(renderer: TemplateRenderer, name: str) -> None:
    with pytest.raises(RenderError, match="chat template failed: .*(underscore|unsafe|undefined)"):
        renderer.render(_msg(name))
    assert renderer.render(_msg("fine")) == "<|user|>fine\n<|assistant|>"


def test_raise_exception_and_template_errors_are_the_request_error(renderer: TemplateRenderer) -> None:
    with TemplateRenderer("{{ raise_exception('only user and assistant roles') }}", LIMITS) as r:
        with pytest.raises(RenderError, match="chat template failed: only user and assistant roles"):
            r.render(_msg("a"))
    with TemplateRenderer("{{ messages.__class__ }}{{ ''.__class__.__mro__ }}", LIMITS) as r:
        with pytest.raises(RenderError, match="chat template failed"):
            r.render(_msg("a"))


def test_text_templates_render_many_rows_in_lm_evals_environment_under_one_time_limit() -> None:
    docs = [{"q": f"q{i}", "opts": ["a", "b"]} for i in range(600)]  # several batches
    with TextTemplates(LIMITS) as templates:
        texts = templates.render_many("Q: {{q}}\n{{ opts[1] | regex_replace('b', 'B') }}\n", docs)
        assert texts[0] == "Q: q0\nB\n" and texts[-1] == "Q: q599\nB\n"  # the final newline kept, as lm-eval
        missing = templates.render_many("{{q}} {{nope}}", docs[:2])
        assert [str(m) for m in missing] == ["template failed: 'nope' is undefined"] * 2
        assert isinstance(missing[0], RenderError)
        with pytest.raises(LingctlError, match="the template does not compile"):
            templates.render_many("{{ q ", docs[:1])
        started = time.monotonic()
        with pytest.raises(RenderError, match="took longer than 0.5 s"):  # the batch's limit, not each row's
            templates.render_many(HOSTILE["nested"], docs[:50])
        assert time.monotonic() - started < LIMITS.timeout_s + LIMITS.grace_s
        assert templates.render_many("{{ q }}", docs[:1]) == ["q0"]
