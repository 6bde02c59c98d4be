"""The answer to one request of ``flood run``: a completion or chat completion body in OpenAI's format, or
the error line of a request that the engine refused or that failed while it ran."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lingctl.core.names import printable
from lingctl.flood.batch.output import BatchOutput
from lingctl.flood.batch.requests import Request
from lingctl.flood.engine.loop import GenResult
from lingctl.model.hub import parse_repo_id

log = logging.getLogger(__name__)


def answer_body(
    req: Request,
    results: list[GenResult],
    texts: list[str],
    model: str,
    token_text: Callable[[int], str] | None = None,
    *,
    answer_id: str,
) -> dict[str, Any]:
    """The ``body`` of a finished request: a chat completion for a chat request, else a completion, with one
    choice per answer (``n``). ``model``: the answer's model when the request names none. ``token_text``: a
    token's text, for the log-probabilities a request asked for. ``answer_id``: the hex part of its ``id``."""
    prefix, kind = ("chatcmpl", "chat.completion") if req.is_chat else ("cmpl", "text_completion")
    choices = []
    for index, (res, text) in enumerate(zip(results, texts, strict=True)):
        content = {"message": {"role": "assistant", "content": text}} if req.is_chat else {"text": text}
        logprobs = None
        if res.token_logprobs is not None and token_text is not None:
            logprobs = _logprobs(req.is_chat, res.token_ids, res.token_logprobs, token_text)
        choice = {**content, "finish_reason": res.finish_reason, "logprobs": logprobs, "token_ids": res.token_ids}
        choices.append({"index": index, **choice})
    firsts = results[:: req.n]  # each prompt is counted once (not once per answer), as OpenAI and vLLM count it
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
    }
    return {
        "id": f"{prefix}-{answer_id}",
        "object": kind,
        "created": answer_time(),
        "model": req.model or model,
        "choices": choices,
        "usage": usage,
    }


def request_digest(req: Request) -> str:
    """sha256 of everything a request asks (its custom_id, line, prompt, sampling): what its answer's ids are
    derived from, so they are the same wherever and whenever the request is answered."""
    fields = json.dumps(dataclasses.asdict(req), sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(fields.encode("ascii")).hexdigest()


def answer_time() -> int:
    """An answer's ``created``: now, or ``SOURCE_DATE_EPOCH`` when set (the reproducible-builds convention), so
    that two runs of one batch can be compared byte for byte."""
    fixed = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    return int(fixed) if fixed.isdigit() else int(time.time())


def _logprobs(
    chat: bool,
    ids: list[int],
    entries: list[tuple[float, list[tuple[int, float]]]],
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object: for chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``; for a
    completion ``{tokens, token_logprobs, top_logprobs, text_offset}`` (offsets into the answer's text)."""
    if chat:

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                for t, (lp, top) in zip(ids, entries, strict=True)
            ]
        }
    tokens = [token_text(t) for t in ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [{token_text(i): v for i, v in top} for _, top in entries],
        "text_offset": offsets,
    }


def model_name(spec: Path | str, path: Path) -> str:
    """The ``model`` field of answers to requests that name none: a Hub id as given (``org/name``, as vLLM
    serves it), not its snapshot's commit hash; a local directory by its name."""
    hub_id = None if Path(spec).exists() else parse_repo_id(str(spec))
    return hub_id.repo_id if hub_id is not None else path.name


def write_failure(output: BatchOutput, req: Request, res: GenResult) -> None:
    """A request the engine refused (code invalid_request, status 400) or that failed while running (code
    internal_error, status 500, as the Batch API reports a server-side failure of one request)."""
    message = res.error or "failed"
    digest = request_digest(req)
    if res.internal:
        log.warning("request %s failed: %s", printable(req.custom_id), message)
        output.write_error(
            custom_id=req.custom_id,
            line=req.line,
            code="internal_error",
            message=message,
            status_code=500,
            digest=digest,
        )
    else:
        output.write_error(
            custom_id=req.custom_id, line=req.line, code="invalid_request", message=message, digest=digest
        )
