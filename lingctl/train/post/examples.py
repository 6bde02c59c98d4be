"""Fine-tuning data: JSONL lines to token ids with a loss mask, every line checked before any training.

SFT lines are ``{"messages": [{"role", "content"}, ...]}`` (OpenAI / Hugging Face chat) or ``{"prompt",
"completion"}``; DPO lines are ``{"prompt" | "messages", "chosen", "rejected"}`` with optional
``"chosen_mask"``/``"rejected_mask"``: character spans ``[start, end)`` of the answer to leave out of the loss
(the format phase of Ling's DPO: valid reasoning inside a rejected answer is not penalised). Prompts and
answers are strings (plain text, the answer ended by the end-of-text token) or message lists, which are
rendered with the checkpoint's chat template by the renderer flood uses, so training sees the tokens inference
will see.

Text is tokenized piece by piece: what the loss skips (a prompt, a user turn) separately from what it trains
on (an assistant turn). A prompt is then tokenized exactly as flood tokenizes it when it asks for an answer,
and the chosen and rejected answers of a pair share their prompt's tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lingctl.core.errors import LingctlError, UsageError
from lingctl.core.jsonl import kind_of
from lingctl.model.chat_template import RenderError, TemplateRenderer
from lingctl.model.tokenizer_files import chat_template, special_tokens
from lingctl.train.data import iter_json_lines

log = logging.getLogger(__name__)

LossOn = Literal["assistant", "all", "last"]
LOSS_ON: tuple[str, ...] = ("assistant", "all", "last")
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class BadExample(ValueError):
    """What is wrong with one line; the reader adds FILE:LINE."""


@dataclass(kw_only=True, slots=True)
class Example:
    """One token sequence. ``loss_mask[t]``: token ``ids[t]`` is a loss target (predicted from ``ids[:t]``);
    ``loss_mask[0]`` is always False."""

    ids: list[int]
    loss_mask: list[bool]
    where: str  # FILE:LINE

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_loss(self) -> int:
        return sum(self.loss_mask)


@dataclass(kw_only=True, slots=True)
class Pair:
    """A preference pair: both answers after the same prompt tokens; their masks cover answer tokens only."""

    chosen: Example
    rejected: Example
    where: str

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


class ChatText:
    """Renders and tokenizes lines for one checkpoint: its tokenizer, chat template and special tokens."""

    def __init__(self, tokenizer: Any, model_dir: Path, eos_id: int) -> None:
        self.tok = tokenizer
        self.template = chat_template(model_dir)
        self.special = special_tokens(model_dir)
        self.eos_id = eos_id
        self._renderer: TemplateRenderer | None = None

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> str:
        if self.template is None:
            raise BadExample(
                "messages need a chat template, and the checkpoint has none (tokenizer_config.json chat_template "
                "or chat_template.jinja); give plain-string prompts and answers instead"
            )
        if self._renderer is None:
            self._renderer = TemplateRenderer(self.template)
        try:
            return self._renderer.render(messages, add_generation_prompt=generation_prompt, special_tokens=self.special)
        except RenderError as exc:
            raise BadExample(f"the chat template failed: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids) if text else []

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if not text:
            return [], []
        enc = self.tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]


# -- lines -------------------------------------------------------------------------------------------


def _messages(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadExample(f"{field!r} must be a non-empty list of messages, got {kind_of(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise BadExample(f"{field}[{i}] must be an object with 'role' and 'content', got {kind_of(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadExample(f"{field}[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role!r}")
        if not isinstance(content, str):
            raise BadExample(f"{field}[{i}].content must be a string, got {kind_of(content)}")
    return value


def _text_or_messages(record: Mapping[str, Any], field: str) -> str | list[dict[str, Any]]:
    if field not in record:
        raise BadExample(f"missing field {field!r}")
    value = record[field]
    return value if isinstance(value, str) else _messages(value, field)


def _spans(value: Any, field: str, length: int) -> list[tuple[int, int]]:
    """``[[start, end], ...]`` character spans within a string of ``length`` characters."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadExample(f"{field!r} must be a list of [start, end] character spans, got {kind_of(value)}")
    spans = []
    for i, span in enumerate(value):
        ok = isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)
        if not ok or not 0 <= span[0] <= span[1] <= length:
            raise BadExample(f"{field}[{i}] must be [start, end] with 0 <= start <= end <= {length}, got {span!r}")
        spans.append((span[0], span[1]))
    return spans


def _pieces_to_example(pieces: list[tuple[list[int], bool]], where: str) -> Example:
    ids: list[int] = []
    mask: list[bool] = []
    for piece_ids, trained in pieces:
        ids.extend(piece_ids)
        mask.extend([trained] * len(piece_ids))
    if mask:
        mask[0] = False  # the first token has nothing to be predicted from
    return Example(ids=ids, loss_mask=mask, where=where)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _assistant_spans(
    text: ChatText, messages: list[dict[str, Any]], trained: list[int]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the messages at ``trained`` (indices).

    A message's span starts where the conversation before it, rendered with the generation prompt, ends
    (what flood sends the model) and ends after its end-of-turn text: where the conversation rendered up to
    it stops being a prefix of the whole, or, for templates that close only the last turn (Ling's ends it
    with the end-of-text token), right after its content."""
    full = text.render(messages, generation_prompt=False)
    spans = []
    for i in trained:
        before = text.render(messages[:i], generation_prompt=True) if i else ""
        if not full.startswith(before):
            raise BadExample(
                f"the chat template does not render message {i} after the conversation before it as that "
                "conversation plus a generation prompt; give {prompt, completion} lines instead"
            )
        upto = text.render(messages[: i + 1], generation_prompt=False)
        end = _common_prefix(upto, full)
        if end < len(upto):
            content = messages[i]["content"]
            found = full.find(content, len(before))
            if found < 0:
                raise BadExample(f"the chat template does not keep message {i}'s content as written")
            end = found + len(content)
        spans.append((len(before), end))
    return full, spans


def _chat_example(text: ChatText, messages: list[dict[str, Any]], trained: list[int], where: str) -> Example:
    full, spans = _assistant_spans(text, messages, trained)
    pieces: list[tuple[list[int], bool]] = []
    at = 0
    for start, end in spans:
        pieces += [(text.encode(full[at:start]), False), (text.encode(full[start:end]), True)]
        at = end
    pieces.append((text.encode(full[at:]), False))
    return _pieces_to_example(pieces, where)


def sft_example(text: ChatText, record: Mapping[str, Any], where: str, loss_on: LossOn) -> Example:
    """One SFT line: a conversation, or a prompt and its completion."""
    if "messages" in record:
        messages = _messages(record["messages"], "messages")
        first = 0
    elif "prompt" in record or "completion" in record:
        prompt, completion = _text_or_messages(record, "prompt"), _text_or_messages(record, "completion")
        if isinstance(prompt, str) != isinstance(completion, str):
            raise BadExample("'prompt' and 'completion' must both be strings or both be message lists")
        if isinstance(prompt, str) and isinstance(completion, str):
            pieces = [(text.encode(prompt), loss_on == "all"), (text.encode(completion) + [text.eos_id], True)]
            return _checked(_pieces_to_example(pieces, where))
        messages, first = [*prompt, *completion], len(prompt)
    else:
        raise BadExample("expected 'messages', or 'prompt' and 'completion'")
    if loss_on == "all":
        ids = text.encode(text.render(messages, generation_prompt=False))
        return _checked(Example(ids=ids, loss_mask=[False] + [True] * (len(ids) - 1), where=where))
    trained = [i for i, m in enumerate(messages) if i >= first and m["role"] == "assistant"]
    if not trained:
        raise BadExample("no assistant message to train on")
    return _checked(_chat_example(text, messages, trained[-1:] if loss_on == "last" else trained, where))


def _answer(
    text: ChatText, prompt: str | list[dict[str, Any]], before: str, answer: Any, field: str, excluded: Any
) -> tuple[list[int], list[bool]]:
    """An answer's token ids and loss mask (``excluded`` spans of its content off)."""
    if isinstance(prompt, str):
        if not isinstance(answer, str):
            raise BadExample(f"{field!r} must be a string when the prompt is one, got {kind_of(answer)}")
        ids, offsets = text.encode_with_offsets(answer)
        ids, offsets, shift, content = ids + [text.eos_id], offsets + [(len(answer), len(answer))], 0, answer
    else:
        messages = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else _messages(answer, field)
        full = text.render([*prompt, *messages], generation_prompt=False)
        if not full.startswith(before):
            raise BadExample(f"the chat template does not render the prompt of {field!r} as a prefix of it")
        tail = full[len(before) :]
        ids, offsets = text.encode_with_offsets(tail)
        content = messages[-1]["content"]
        shift = tail.rfind(content) if content else len(tail)
    spans = _spans(excluded, f"{field}_mask", len(content))
    if spans and shift < 0:
        raise BadExample(f"{field}_mask: the chat template does not keep the answer's content as written")
    cut = [(shift + a, shift + b) for a, b in spans if b > a]
    mask = [not any(s < b and a < e for a, b in cut) for s, e in offsets]
    return ids, mask


def dpo_pair(text: ChatText, record: Mapping[str, Any], where: str) -> Pair:
    """One DPO line: a prompt (or messages) and a chosen and a rejected answer."""
    if "messages" in record and "prompt" in record:
        raise BadExample("give 'prompt' or 'messages', not both")
    prompt = _text_or_messages(record, "messages" if "messages" in record else "prompt")
    before = prompt if isinstance(prompt, str) else text.render(prompt, generation_prompt=True)
    prompt_ids = text.encode(before)
    sides = []
    for field in ("chosen", "rejected"):
        if field not in record:
            raise BadExample(f"missing field {field!r}")
        ids, mask = _answer(text, prompt, before, record[field], field, record.get(f"{field}_mask"))
        example = _pieces_to_example([(prompt_ids, False)], where)
        example.ids += ids
        example.loss_mask += mask
        if not prompt_ids and example.loss_mask:
            example.loss_mask[0] = False
        sides.append(_checked(example, field))
    return Pair(chosen=sides[0], rejected=sides[1], where=where)


def _checked(example: Example, what: str = "the example") -> Example:
    if example.n_loss == 0:
        raise BadExample(f"{what} has no token to train on")
    return example


# -- files -------------------------------------------------------------------------------------------


def _records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, record in iter_json_lines(path):
        if not isinstance(record, dict):
            raise LingctlError(f"{where}: expected a JSON object, got {kind_of(record)}")
        yield where, record


def read_lines(paths: Sequence[Path], text: ChatText, *, kind: str, loss_on: LossOn = "assistant") -> list[Any]:
    """Every line of ``paths`` as an Example (``kind`` "sft") or a Pair ("dpo"); the first bad line is one
    error naming FILE:LINE, before anything is trained."""
    if loss_on not in LOSS_ON:
        raise UsageError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    items: list[Any] = []
    for path in paths:
        for where, record in _records(Path(path)):
            try:
                items.append(
                    sft_example(text, record, where, loss_on) if kind == "sft" else dpo_pair(text, record, where)
                )
            except BadExample as exc:
                raise LingctlError(f"{where}: {exc}") from None
    if not items:
        raise UsageError("the fine-tuning data holds no examples: " + ", ".join(str(p) for p in paths))
    return items


def read_examples(path: Path, model_dir: Path, *, kind: str, loss_on: LossOn = "assistant") -> list[Any]:
    """``read_lines`` for one file with a checkpoint's tokenizer and chat template (benchmarks, tests)."""
    from lingctl.model.checkpoint_files import TOKENIZER
    from lingctl.model.tokenizer import eos_id, load_tokenizer

    tok = load_tokenizer(Path(model_dir) / TOKENIZER)
    text = ChatText(tok, Path(model_dir), eos_id(tok))
    try:
        return read_lines([Path(path)], text, kind=kind, loss_on=loss_on)
    finally:
        text.close()
