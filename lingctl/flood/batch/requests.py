"""The batch file: one request per line, read whole and validated before anything runs.

Two forms are accepted. The OpenAI Batch API input form, where ``url`` decides completion or chat and the
request sits under ``body``::

    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 5}}

and a plain form with the body's fields at top level (``messages`` instead of ``prompt`` makes it chat)::

    {"custom_id": "a", "prompt": "hi", "max_tokens": 5}

A bad line never stops the batch: it becomes a ``RequestError`` that names the line, the field and the value.
Validation refuses what the engine could not run, so a bad request fails alone here instead of stopping the
batch later: text that is not valid Unicode (JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which
has no UTF-8 form for the tokenizer or the output file) and sampling values too small to compute with.
Unknown fields are ignored, as vLLM and OpenAI ignore them, so files written for newer APIs still run. The
sampling fields vLLM honours are honoured (``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``frequency_penalty``, ``presence_penalty``, with vLLM's ranges); known fields that would change the answer in a
way flood cannot honour (``best_of``, ``stop_token_ids`` ...) are rejected instead of silently giving a
different result. docs/flood.md has the table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.errors import os_error
from lingctl.core.jsonl import BadLine, parse_json
from lingctl.flood.engine.sampling import SamplingParams

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)

INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 128  # OpenAI's limit on n
MAX_PROMPTS = 2048  # prompts in one completion request (OpenAI's limit on a prompt list)
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI allows 5 for completions, 20 for chat)
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
_SHOW_CHARS = 40
# The smallest positive temperature and top_p. logits / 5e-324 overflows to inf and softmax then gives NaN;
# a top_p below float32's smallest normal compares as 0 against the probabilities and keeps no token. Any
# value down to these floors samples as intended (1e-4 is already indistinguishable from greedy in practice).
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6
# A repetition penalty divides a logit by it: past this a logit of any size is as good as removed, and the
# bound keeps the product finite.
MAX_REPETITION_PENALTY = 1e6

# Field -> (does this value ask for something flood does not do, why). null always means "the default".
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v is not None and (v != 1 or isinstance(v, bool)), "only best_of=1 is supported"),
    "stream": (bool, "a batch is not streamed"),
    "echo": (bool, "echo is not supported"),
    "suffix": (bool, "suffix (insertion) is not supported"),
    "tools": (bool, "tool calling is not supported"),
    "functions": (bool, "function calling is not supported"),
    "response_format": (lambda v: v is not None and v != {"type": "text"}, "only response_format text is supported"),
    "logit_bias": (bool, "logit_bias is not supported"),
    "stop_token_ids": (bool, "stop_token_ids is not supported: give stop strings"),
    "bad_words": (bool, "bad_words is not supported"),
    "allowed_token_ids": (bool, "allowed_token_ids is not supported"),
    "guided_json": (bool, "guided decoding is not supported"),
    "guided_regex": (bool, "guided decoding is not supported"),
    "guided_choice": (bool, "guided decoding is not supported"),
    "guided_grammar": (bool, "guided decoding is not supported"),
    "structured_outputs": (bool, "structured outputs are not supported"),
    "prompt_logprobs": (lambda v: v is not None, "prompt log probabilities are not returned"),
    "use_beam_search": (bool, "beam search is not supported"),
    "length_penalty": (lambda v: v is not None and v != 1, "length_penalty applies to beam search only"),
    "include_stop_str_in_output": (bool, "the stop string is never included in the output"),
    "skip_special_tokens": (lambda v: v is False, "special tokens are always skipped in the text"),
}

# Field -> (default, can the sampler run this value, what the value must be). null means the default.
_NUMBERS: dict[str, tuple[float, Callable[[float], bool], str]] = {
    "temperature": (
        1.0,
        lambda x: x == 0 or MIN_TEMPERATURE <= x <= 2,
        f"0 (greedy) or a number from {MIN_TEMPERATURE:g} to 2",
    ),
    "top_p": (1.0, lambda x: MIN_TOP_P <= x <= 1, f"a number from {MIN_TOP_P:g} to 1"),
    "min_p": (0.0, lambda x: 0 <= x <= 1, "a number from 0 to 1"),
    # vLLM's ranges: any positive repetition penalty, frequency and presence penalties from -2 to 2
    "repetition_penalty": (
        1.0,
        lambda x: 0 < x <= MAX_REPETITION_PENALTY,
        f"above 0, at most {MAX_REPETITION_PENALTY:g}",
    ),
    "frequency_penalty": (0.0, lambda x: -2 <= x <= 2, "a number from -2 to 2"),
    "presence_penalty": (0.0, lambda x: -2 <= x <= 2, "a number from -2 to 2"),
}


@dataclass(kw_only=True, slots=True)
class Request:
    line: int  # 1-based line in the batch file
    custom_id: str
    url: str  # COMPLETIONS or CHAT
    prompt_text: str | None = None  # completions with a string prompt
    prompt_ids: list[int] | None = None  # completions with token ids (>= 0; the vocabulary bound is the model's)
    # completions with a list of prompts (strings or id lists): the others after the first, which the two fields
    # above hold; the answer has n choices per prompt, prompt by prompt, as OpenAI's
    more_prompts: list[tuple[str | None, list[int] | None]] = field(default_factory=list)
    messages: list[dict[str, str]] | None = None  # chat: {"role", "content"}, text parts already joined
    model: str | None = None  # informational: the model is chosen by --model, not per request
    sampling: SamplingParams
    n: int = 1  # answers to generate (the choices of one response)

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT


@dataclass(kw_only=True, slots=True)
class RequestError:
    line: int
    custom_id: str | None  # None when the line has no readable custom_id
    code: str  # INVALID_JSON, INVALID_REQUEST or DUPLICATE_CUSTOM_ID
    message: str


@dataclass(kw_only=True, slots=True)
class Batch:
    requests: list[Request]
    errors: list[RequestError]
    lines: int  # non-empty lines


class _Invalid(ValueError):
    """A field problem inside one request; parse_line turns it into a RequestError."""


def read_batch(path: Path) -> Batch:
    """Every non-empty line of ``path``, parsed. The first line with a custom_id claims it; later lines with
    the same custom_id are errors, so each id names one answer in the output."""
    path = Path(path)
    requests: list[Request] = []
    errors: list[RequestError] = []
    seen: set[str] = set()
    lines = 0
    try:
        # Binary lines split on b"\n" only; text mode would also split on U+2028 etc., which JSON allows
        # unescaped inside strings. Iterating keeps one line in memory at a time.
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte order mark, as some Windows editors write
                if not raw or raw.isspace():  # a blank line
                    continue
                lines += 1
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    errors.append(
                        RequestError(
                            line=number,
                            custom_id=None,
                            code=INVALID_JSON,
                            message=f"line is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                        )
                    )
                    continue
                parsed = parse_line(text, number)
                cid = parsed.custom_id
                if cid is not None and cid in seen:
                    errors.append(
                        RequestError(
                            line=number,
                            custom_id=cid,
                            code=DUPLICATE_CUSTOM_ID,
                            message=f"custom_id {_show(cid)} is used by an earlier line",
                        )
                    )
                    continue
                if cid is not None:
                    seen.add(cid)
                if isinstance(parsed, RequestError):
                    errors.append(parsed)
                else:
                    requests.append(parsed)
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    return Batch(requests=requests, errors=errors, lines=lines)


def parse_line(text: str, line: int) -> Request | RequestError:
    """One line of the batch file; never raises for a bad line."""
    try:
        obj = parse_json(text)
    except BadLine as exc:
        return RequestError(line=line, custom_id=None, code=INVALID_JSON, message=str(exc))
    if not isinstance(obj, dict):
        return RequestError(
            line=line,
            custom_id=None,
            code=INVALID_REQUEST,
            message=f"a request must be a JSON object, got {_show(obj)}",
        )
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        what = "custom_id is missing" if cid is None else f"custom_id must be a non-empty string, got {_show(cid)}"
        return RequestError(line=line, custom_id=None, code=INVALID_REQUEST, message=what)
    try:
        _text(cid, "custom_id")
    except _Invalid as exc:  # an id that cannot be written as UTF-8 is no id to answer under
        return RequestError(line=line, custom_id=None, code=INVALID_REQUEST, message=str(exc))
    try:
        return _request(obj, line, cid)
    except _Invalid as exc:
        return RequestError(line=line, custom_id=cid, code=INVALID_REQUEST, message=str(exc))


def _request(obj: dict[str, Any], line: int, cid: str) -> Request:
    if "body" in obj or "url" in obj or "method" in obj:
        method = obj.get("method")
        if method is not None and method != "POST":
            raise _Invalid(f"method must be POST, got {_show(method)}")
        url = obj.get("url")
        if url not in ENDPOINTS:
            raise _Invalid(f"url must be {COMPLETIONS} or {CHAT}, got {_show(url)}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _Invalid(f"body must be a JSON object, got {_show(body)}")
    else:
        body = obj
        if "prompt" in obj and "messages" in obj:
            raise _Invalid("give prompt (completions) or messages (chat), not both")
        if "prompt" not in obj and "messages" not in obj:
            raise _Invalid("the request has no prompt (completions) or messages (chat), nor url and body")
        url = CHAT if "messages" in obj else COMPLETIONS
    for name, (unsupported, why) in _UNSUPPORTED.items():
        if unsupported(body.get(name)):
            raise _Invalid(f"{name}={_show(body[name])}: {why}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _Invalid(f"model must be a string, got {_show(model)}")
    if model is not None:
        _text(model, "model")
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
        raise _Invalid(f"n must be an integer from 1 to {MAX_N}, got {_show(n)}")
    sampling = _sampling(body, chat=url == CHAT)
    sampling.logprobs = _logprobs(body, chat=url == CHAT)
    request = Request(line=line, custom_id=cid, url=url, model=model, sampling=sampling, n=n or 1)
    if url == CHAT:
        if "messages" not in body:
            raise _Invalid(f"a {CHAT} request needs messages")
        request.messages = _messages(body["messages"])
    else:
        if "prompt" not in body:
            raise _Invalid(f"a {COMPLETIONS} request needs prompt")
        prompts = _prompts(body["prompt"])
        (request.prompt_text, request.prompt_ids), request.more_prompts = prompts[0], prompts[1:]
    return request


def _prompts(value: Any) -> list[tuple[str | None, list[int] | None]]:
    """The prompts of a completion request: one string or id array, or a list of them (OpenAI reads a list of
    strings or of id arrays as several prompts, each with its own choices)."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_PROMPTS:
            raise _Invalid(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} per request")
        return [_prompt(v, f"prompt[{i}]") for i, v in enumerate(value)]
    return [_prompt(value, "prompt")]


def _prompt(value: Any, where: str) -> tuple[str | None, list[int] | None]:
    if isinstance(value, str):
        if not value:
            raise _Invalid(f"{where} must not be empty")
        return _text(value, where), None
    if not isinstance(value, list) or any(isinstance(v, (str, list)) for v in value):
        raise _Invalid(f"{where} must be a string, an array of token ids, or a list of them, got {_show(value)}")
    if not value:
        raise _Invalid(f"{where} must not be empty")
    for i, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise _Invalid(f"{where}[{i}] must be a token id (an integer >= 0), got {_show(token)}")
    return None, value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"messages must be a non-empty array, got {_show(value)}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _Invalid(f"messages[{i}] must be an object, got {_show(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _Invalid(f"messages[{i}].role must be a non-empty string, got {_show(role)}")
        out.append(
            {
                "role": _text(role, f"messages[{i}].role"),
                "content": _content(message.get("content"), f"messages[{i}].content"),
            }
        )
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return _text(value, where)
    if not isinstance(value, list):
        raise _Invalid(f"{where} must be a string or an array of text parts, got {_show(value)}")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise _Invalid(f"{where}[{j}] must be a text part, got {_show(part)}")
        if not isinstance(part.get("text"), str):
            raise _Invalid(f"{where}[{j}].text must be a string, got {_show(part.get('text'))}")
        texts.append(_text(part["text"], f"{where}[{j}].text"))
    # Joined with newlines, as vLLM does for templates that take string content.
    return "\n".join(texts)


def _sampling(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    # Chat renamed max_tokens to max_completion_tokens; the new name wins when both are given.
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = None if chat else 16
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise _Invalid(f"{name} must be an integer >= 1, got {_show(max_tokens)}")
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    top_k = body.get("top_k")
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k) or top_k < -1:
        raise _Invalid(f"top_k must be an integer >= 1, or -1 or 0 for off, got {_show(top_k)}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]):
        raise _Invalid(f"seed must be a 64-bit integer, got {_show(seed)}")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _Invalid(f"ignore_eos must be true or false, got {_show(ignore_eos)}")
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    elif not _is_int(min_tokens) or min_tokens < 0:
        raise _Invalid(f"min_tokens must be an integer >= 0, got {_show(min_tokens)}")
    elif max_tokens is not None and min_tokens > max_tokens:
        raise _Invalid(f"min_tokens={min_tokens} must not exceed {name}={max_tokens}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        min_p=_number(body, "min_p"),
        seed=seed,
        stop=_stop(body.get("stop")),
        ignore_eos=bool(ignore_eos),
        min_tokens=min_tokens,
        repetition_penalty=_number(body, "repetition_penalty"),
        frequency_penalty=_number(body, "frequency_penalty"),
        presence_penalty=_number(body, "presence_penalty"),
    )


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many top log-probabilities each new token gets (0: only its own), or None (not asked). Completions:
    ``logprobs`` is that number; chat: ``logprobs: true`` asks, ``top_logprobs`` is the number (OpenAI's forms,
    up to vLLM's default limit of MAX_LOGPROBS)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise _Invalid(f"logprobs must be true or false for a chat request, got {_show(value)}")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
            raise _Invalid(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {_show(top)}")
        if top is not None and not value:
            raise _Invalid("top_logprobs needs logprobs: true")
        return (top or 0) if value else None
    if top is not None:
        raise _Invalid("top_logprobs is for chat requests; a completion request gives the number as logprobs")
    if value is None or value is False:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise _Invalid(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {_show(value)}")
    return int(value)


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise _Invalid(f"stop must be a non-empty string or an array of up to {MAX_STOP} of them, got {_show(value)}")
    return [_text(s, "stop" if isinstance(value, str) else f"stop[{i}]") for i, s in enumerate(stops)]


def _number(body: dict[str, Any], name: str) -> float:
    default, ok, what = _NUMBERS[name]
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise _Invalid(f"{name} must be {what}, got {_show(value)}")
    return float(value)


def _text(value: str, where: str) -> str:
    """``value`` when it is valid Unicode. A lone surrogate (from a ``"\\ud800"`` escape) has no UTF-8 form:
    the tokenizer, the chat template and the output file would each fail on it."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _Invalid(
                f"{where} is not valid Unicode: a lone surrogate "
                f"{ascii(value[exc.start])[1:-1]} at character {exc.start}"
            ) from None
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A value as it appeared in the JSON, cut short so an error stays one readable line."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except RecursionError:
        return "(a deeply nested value)"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: shown as its JSON escape, so the message stays UTF-8
            text = json.dumps(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 1] + "…"
