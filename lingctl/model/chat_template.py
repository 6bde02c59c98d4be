"""Chat templates: compiled in Jinja's sandbox, rendered in a worker process under per-request limits.

A chat template is code that comes with the checkpoint (or ``--chat-template``) and runs on every chat
request, in the environment and with the variables that transformers gives it (``chat_environment``).
Jinja's sandbox keeps it away from Python objects it must not touch, but it has no limit on time or size:
nested ``{% for %}`` loops run for hours, and ``{% set s = s ~ s %}`` in a loop doubles a string until memory
runs out. Hooks on calls and attribute reads cannot count a loop whose body has neither, so the limits
are enforced from outside the template, in one long-lived worker process (``python -m
lingctl.model.chat_template``), per request:

- time: an interval timer in the worker interrupts the render after ``timeout_s``; the parent kills a worker
  that has not answered ``grace_s`` later (C code that never returns to Python) and starts a fresh one;
- output: the render is streamed and stopped once it passes ``max_chars`` characters;
- memory: the worker's address space is capped (``RLIMIT_AS``), so a template that builds huge strings gets a
  MemoryError there instead of exhausting this process's memory.

Compiling is evaluation too: Jinja folds constant expressions while it generates code, so ``{{ 'x' *
10**9 }}`` would be built by the compiler. Here the parent only parses (syntax errors are found before any
work, with no evaluation), the worker compiles under the same limits, and ``*`` and ``**`` are not folded but
checked when they run: a repeated string longer than ``max_chars``, or an integer product or power beyond
``MAX_INT_BITS`` (C code that runs for minutes, deaf to the timer), fails its request without being built.

A request that fails or passes a limit fails alone (``RenderError``); a template that does not compile fails
the run (it would fail every request). The worker starts on the first chat request, so a batch without chat
requests never starts it; it costs one interpreter start and a pipe round trip per request.

The same worker, in text mode (``TextTemplates``), renders the prompt templates of lm-evaluation-harness task
files over their data rows, in lm-eval's environment instead of transformers' (``_text_environment``): any
number of templates, each compiled once, and a batch of rows per request under one time limit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from lingctl.core.errors import LingctlError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # interpreter start and imports, on a busy machine
_READ_CHUNK = 1 << 16
_MESSAGE_CHARS = 300
MAX_INT_BITS = 1 << 16  # about 20,000 digits; (10**4096)**4096 took 19 s in C
_Client = TypeVar("_Client", bound="_WorkerClient")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TemplateLimits:
    """Per-request limits. Real chat templates render in well under a millisecond, to at most a few hundred
    thousand characters (a full long context); these leave wide room above that."""

    timeout_s: float = 5.0
    max_chars: int = 4 << 20
    memory_bytes: int = 512 << 20  # address space the worker may grow by
    grace_s: float = 5.0  # beyond timeout_s, before the parent kills a worker that has not answered


class RenderError(ValueError):
    """One request's render failed or passed a limit; the others are unaffected."""


def _limited_class(max_chars: int) -> Any:
    """Jinja's immutable sandbox with ``*`` and ``**`` checked before they run (and so never folded at
    compile time)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right, max_chars)
            return super().call_binop(context, operator, left, right)

    return LimitedEnvironment


def _environment(max_chars: int) -> Any:
    """The environment transformers renders chat templates in (``chat_environment``), limited."""
    from lingctl.model.chat_environment import chat_environment

    return chat_environment(_limited_class(max_chars), optimized=False)


def _text_environment(max_chars: int) -> Any:
    """The environment lm-evaluation-harness renders task templates in (``lm_eval.utils.env``: a missing
    variable is an error, a final newline is kept, a ``regex_replace`` filter), limited and sandboxed."""
    import re

    from jinja2 import StrictUndefined

    env = _limited_class(max_chars)(undefined=StrictUndefined, keep_trailing_newline=True, optimized=False)
    env.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s, count=count)
    return env


def _check_binop(operator: str, left: Any, right: Any, max_chars: int) -> None:
    """SecurityError before ``left operator right`` would build something past the limits."""
    from jinja2.exceptions import SecurityError

    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > max_chars:
                raise SecurityError(
                    f"a {type(seq).__name__} repeated to {len(seq) * n:,} items is over the limit of {max_chars:,}"
                )
        bits = left.bit_length() + right.bit_length() if ints else 0
    else:  # "**"
        bits = left.bit_length() * right if ints and right > 0 and abs(left) > 1 else 0
    if bits > MAX_INT_BITS:
        raise SecurityError(f"an integer of about {bits:,} bits is over the limit of {MAX_INT_BITS:,}")


def check_syntax(source: str) -> None:
    """``LingctlError`` (one line) when the template does not parse. Parsing evaluates nothing."""
    from jinja2.exceptions import TemplateError

    try:
        _environment(0).parse(source)
    except TemplateError as exc:
        raise LingctlError(f"the chat template does not compile: {_one_line(str(exc))}") from None
    except (RecursionError, MemoryError) as exc:  # blocks nested too deeply for the parser
        raise LingctlError(f"the chat template does not compile: {type(exc).__name__}") from None


class _WorkerClient:
    """One worker process (started on first use) and the request/reply exchange with it, under the limits.
    ``label`` names what it renders in messages ("chat template", "template")."""

    def __init__(self, config: dict[str, Any], limits: TemplateLimits | None, label: str) -> None:
        self.limits = limits or TemplateLimits()
        self.label = label
        self._config = config
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = bytearray()
        self._finalizer: weakref.finalize | None = None

    @property
    def worker_pid(self) -> int | None:
        """The worker's process id while one runs."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        self._stop()

    def __enter__(self: _Client) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the worker --------------------------------------------------------------------------------
    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is not None:
            return self._proc
        cmd = [sys.executable, "-m", "lingctl.model.chat_template"]
        # Its stderr only shows with LINGCTL_DEBUG: a template's errors are reported per request instead.
        stderr = None if os.environ.get("LINGCTL_DEBUG", "") not in ("", "0") else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, bufsize=0)
        except OSError as exc:
            raise LingctlError(f"cannot start the {self.label} worker: {exc}") from None
        self._proc = proc
        self._buf.clear()
        self._finalizer = weakref.finalize(self, _kill, proc)
        limits = self.limits
        try:
            _send(proc, _line({**self._config, "label": self.label, **dataclasses.asdict(limits)}))
            reply = self._receive(proc, time.monotonic() + START_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError) as exc:
            status = self._stop()
            raise LingctlError(
                f"the {self.label} worker {status or 'failed'} while starting ({type(exc).__name__})"
            ) from None
        if not reply.get("ready"):
            self._stop()
            raise LingctlError(str(reply.get("error")))
        return proc

    def _receive(self, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
        """The worker's next reply line. TimeoutError past ``deadline``, EOFError when the worker is gone."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        start = 0
        while (end := self._buf.find(b"\n", start)) < 0:
            start = len(self._buf)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, _READ_CHUNK)
                if not chunk:
                    raise EOFError
                self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise EOFError  # not our worker's protocol: treat it as gone
        return reply

    def _stop(self) -> str:
        """End the worker (if any); how it ended, in words."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        _kill(proc)
        code = proc.returncode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def _ask(self, request: bytes) -> dict[str, Any]:
        """The worker's reply to ``request``. ``RenderError`` when the worker is stopped or dies on it;
        ``LingctlError`` when it cannot be started at all."""
        for attempt in (1, 2):
            proc = self._worker()
            try:
                _send(proc, request)
                break
            except OSError:  # the worker exited while idle (killed from outside): start another, once
                self._stop()
                if attempt == 2:
                    raise LingctlError(f"the {self.label} worker exits as soon as it starts") from None
        deadline = time.monotonic() + self.limits.timeout_s + self.limits.grace_s
        try:
            return self._receive(proc, deadline)
        except TimeoutError:
            self._stop()
            log.warning(
                "the %s worker did not answer within %g s; it was stopped and the request it was rendering fails",
                self.label,
                self.limits.timeout_s + self.limits.grace_s,
            )
            raise RenderError(f"the {self.label} took longer than {self.limits.timeout_s:g} s") from None
        except EOFError:
            status = self._stop()
            raise RenderError(
                f"the {self.label} worker {status} while rendering this request (out of "
                f"memory, for example: the limit is {self.limits.memory_bytes >> 20} MiB)"
            ) from None

    def _failed(self, reply: dict[str, Any]) -> RenderError:
        if reply.get("slow"):  # each such request costs the whole time limit: say so as it happens
            log.warning("a %s render was stopped after %g s", self.label, self.limits.timeout_s)
        return RenderError(str(reply["error"]))


class TemplateRenderer(_WorkerClient):
    """Renders one chat template for many requests in a worker process (started on first use)."""

    def __init__(self, source: str, limits: TemplateLimits | None = None) -> None:
        check_syntax(source)  # found before any work: a template that does not parse fails every request
        super().__init__({"template": source}, limits, "chat template")
        self.source = source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        special_tokens: Mapping[str, str] | None = None,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``, rendered with the variables transformers gives a template:
        ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and ``special_tokens`` (``bos_token``,
        ``eos_token``, ...: ``ModelDir.special_tokens``). ``RenderError`` when this request's render fails or
        passes a limit; ``LingctlError`` when the worker cannot be started at all."""
        from lingctl.model.chat_environment import template_messages

        # Special tokens first: as in transformers, a variable of the same name wins over a token.
        variables = {
            **(special_tokens or {}),
            "messages": template_messages(messages),
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        reply = self._ask(_line(variables))
        if "error" in reply:
            raise self._failed(reply)
        return str(reply["text"])


class TextTemplates(_WorkerClient):
    """Renders any number of text templates (lm-evaluation-harness task prompts) over many variable sets, in
    one worker under the same limits, in lm-eval's environment (``_text_environment``). Variable sets go in
    batches (one pipe round trip for many rows; 10,000 rows of three templates take about 0.9 s), and the
    time limit is each batch's."""

    BATCH = 256

    def __init__(self, limits: TemplateLimits | None = None) -> None:
        super().__init__({"mode": "text"}, limits, "template")

    def render_many(self, source: str, docs: Sequence[Mapping[str, Any]]) -> list[str | RenderError]:
        """``source`` rendered with each of ``docs`` as its variables: the text, or that render's
        ``RenderError``. ``LingctlError`` when the template does not compile."""
        out: list[str | RenderError] = []
        for start in range(0, len(docs), self.BATCH):
            batch = list(docs[start : start + self.BATCH])
            reply = self._ask(_line({"source": source, "docs": batch}))
            if "error" in reply:
                if reply.get("compile"):
                    raise LingctlError(str(reply["error"]))
                raise self._failed(reply)
            for result in reply["results"]:
                out.append(RenderError(str(result["error"])) if "error" in result else str(result["text"]))
        return out


def check_text_syntax(source: str) -> str | None:
    """Why a task template does not parse ('' never; None when it parses). Parsing evaluates nothing."""
    from jinja2.exceptions import TemplateError

    try:
        _text_environment(0).parse(source)
    except TemplateError as exc:
        return _one_line(str(exc))
    except (RecursionError, MemoryError) as exc:
        return type(exc).__name__
    return None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Close the pipes and end the worker: it holds nothing worth a graceful exit."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _send(proc: subprocess.Popen[bytes], data: bytes) -> None:
    assert proc.stdin is not None
    view = memoryview(data)
    while view:  # a raw pipe may take part of a large write
        view = view[os.write(proc.stdin.fileno(), view) :]


def _line(obj: dict[str, Any]) -> bytes:
    # ASCII escapes: valid for any str, including a lone surrogate that a template itself produced.
    return json.dumps(obj, ensure_ascii=True).encode("ascii") + b"\n"


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 1] + "…"


# -- the worker process ----------------------------------------------------------------------------


class _TimeUp(BaseException):
    """Raised by the interval timer inside a compile or a render. A BaseException, so that no ``except
    Exception`` on the way (Jinja's own error handling included) can swallow it."""


_timed = False  # whether the interval timer may interrupt now


def _on_alarm(signum: int, frame: Any) -> None:
    if _timed:
        raise _TimeUp


def _start_timer(seconds: float) -> None:
    global _timed
    _timed = True
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _stop_timer() -> None:
    global _timed
    _timed = False  # first: a tick that lands between these two lines is ignored, not raised outside a try
    signal.setitimer(signal.ITIMER_REAL, 0)


def _compile(source: str, limits: dict[str, Any]) -> Any:
    """The compiled template, or a one-line ``LingctlError``."""
    from jinja2.exceptions import TemplateError

    label = limits.get("label", "chat template")
    what = f"the {label} does not compile"
    environment = _text_environment if limits.get("mode") == "text" else _environment
    try:
        _start_timer(limits["timeout_s"])
        try:
            return environment(limits["max_chars"]).from_string(source)
        finally:
            _stop_timer()
    except _TimeUp:
        raise LingctlError(f"{what}: compiling took longer than {limits['timeout_s']:g} s") from None
    except MemoryError:
        raise LingctlError(f"{what}: it needed more than {limits['memory_bytes'] >> 20} MiB of memory") from None
    except TemplateError as exc:
        raise LingctlError(f"{what}: {_one_line(str(exc))}") from None
    except Exception as exc:  # e.g. blocks nested too deeply for Python's compiler
        raise LingctlError(f"{what}: {type(exc).__name__}: {_one_line(str(exc))}") from None


def _render(template: Any, request: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    from jinja2.exceptions import TemplateError

    label = limits.get("label", "chat template")
    parts: list[str] = []
    size = 0
    try:
        _start_timer(limits["timeout_s"])
        try:
            for chunk in template.generate(request):
                size += len(chunk)
                if size > limits["max_chars"]:
                    return {"error": f"the {label} produced more than {limits['max_chars']:,} characters"}
                parts.append(chunk)
        finally:
            _stop_timer()
    except _TimeUp:
        return {"error": f"the {label} took longer than {limits['timeout_s']:g} s", "slow": True}
    except MemoryError:
        parts.clear()
        return {"error": f"the {label} needed more than {limits['memory_bytes'] >> 20} MiB of memory"}
    except TemplateError as exc:
        return {"error": f"{label} failed: {_one_line(str(exc))}"}
    except Exception as exc:  # the template's own error (a bad operation, a sandbox refusal, range too big)
        return {"error": f"{label} failed: {type(exc).__name__}: {_one_line(str(exc))}"}
    text = "".join(parts)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return {
            "error": f"the {label} produced text that is not valid Unicode (a lone surrogate at character {exc.start})"
        }
    return {"text": text}


def _render_batch(request: dict[str, Any], compiled: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    """Text mode: one template (compiled once, then kept) over a batch of variable sets."""
    source = request["source"]
    if source not in compiled:
        try:
            compiled[source] = _compile(source, limits)
        except LingctlError as exc:
            return {"error": exc.message, "compile": True}
    template = compiled[source]
    # The time limit is the batch's, so that the parent's deadline stays timeout_s + grace_s for any batch size.
    deadline = time.monotonic() + limits["timeout_s"]
    results = []
    for doc in request["docs"]:
        left = {**limits, "timeout_s": max(deadline - time.monotonic(), 1e-3)}
        result = _render(template, doc, left)
        if result.get("slow"):
            return {**result, "error": f"the {limits['label']} took longer than {limits['timeout_s']:g} s"}
        results.append(result)
    return {"results": results}


def _limit_memory(extra: int) -> None:
    """Cap the address space at what the worker uses now plus ``extra``."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        now = 256 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = now + extra
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft == resource.RLIM_INFINITY or want < soft:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def worker_main() -> int:
    """The worker: a config line (limits, and the chat template unless ``mode`` is "text"), then one request
    line in, one reply line out. A text-mode request names its template and carries a batch of variable sets."""
    # Ctrl-C reaches the whole process group; stopping is the parent's decision, which then closes our input.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def reply(obj: dict[str, Any]) -> None:
        stdout.write(_line(obj))
        stdout.flush()

    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        config = json.loads(stdin.readline())
        _limit_memory(int(config["memory_bytes"]))
        text_mode = config.get("mode") == "text"
        template = None if text_mode else _compile(config["template"], config)
    except (ValueError, KeyError, TypeError) as exc:
        reply({"error": f"the chat template worker got a bad configuration: {_one_line(str(exc))}"})
        return 1
    except LingctlError as exc:
        reply({"error": exc.message})
        return 1
    reply({"ready": True})
    compiled: dict[str, Any] = {}
    for raw in stdin:
        try:
            request = json.loads(raw)
            out = _render_batch(request, compiled, config) if text_mode else _render(template, request, config)
        except MemoryError:  # decoding the request itself
            out = {"error": f"the {config.get('label')} worker needed more than {config['memory_bytes'] >> 20} MiB"}
        try:
            reply(out)
        except MemoryError:
            reply({"error": f"the {config.get('label')}'s output did not fit in the worker's memory"})
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
