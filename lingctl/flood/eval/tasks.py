"""Evaluation task files: one JSON object per line, a task per file (its name is the file's stem).

Two kinds of item, one kind per file::

    {"id": "q1", "context": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0}
    {"id": "g1", "prompt": "2+2=", "answer": "4", "stop": ["\\n"], "max_tokens": 8, "regex": "(\\\\d+)"}

A multiple-choice item is scored by the log-likelihood of each choice's *content* given the context (report
§5.1.2: perplexity-based evaluation of the option text, not of its label). A generation item is answered
greedily until a stop string, EOS or ``max_tokens``; its answer is the whole stripped text, or the first group
of ``regex`` (the item's own, else the file-wide ``--regex``), compared exactly with ``answer``.

Rows of HellaSwag, ARC, MMLU, PIQA and GSM8K as their datasets export them are read too, with lm-evaluation-
harness's prompts (``dataset_rows.py``).

Few-shot prompts are built from the file itself: items marked ``"fewshot": true`` form the pool (and are not
scored); without such items an item's shots are the first K other items of the file. The same shots precede
many items, so the engine computes that block once (prefix sharing).

lm-evaluation-harness task files (``*.yaml``, ``*.yml``) are read into the same tasks (``lm_eval_yaml.py``;
``task_files.py`` reads either kind).
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.errors import UsageError, os_error
from lingctl.core.jsonl import BadLine, parse_json
from lingctl.core.names import printable
from lingctl.flood.eval.dataset_rows import convert_row

CHOICE = "choice"
GENERATE = "generate"
FEWSHOT_DELIMITER = "\n\n"  # between shots, and between the last shot and the item (lm-evaluation-harness's)
DEFAULT_MAX_TOKENS = 32
MAX_ID_CHARS = 256
YAML_SUFFIXES = (".yaml", ".yml")
_CHOICE_KEYS = {"id", "context", "choices", "answer", "fewshot"}
_GENERATE_KEYS = {"id", "prompt", "answer", "stop", "max_tokens", "regex", "fewshot"}


@dataclass(kw_only=True, slots=True)
class EvalItem:
    task: str
    id: str
    kind: str  # CHOICE or GENERATE
    line: int
    context: str = ""  # choice items: what the choices continue
    choices: list[str] = field(default_factory=list)
    answer: int | str = 0  # choice: index into choices; generate: the expected text
    prompt: str = ""  # generate items
    stop: list[str] = field(default_factory=list)
    max_tokens: int = DEFAULT_MAX_TOKENS
    regex: str | None = None
    fewshot: bool = False
    # Set by lm-eval task files (None or '' in flood's own):
    shot: str | None = None  # this item as a solved example, when its file says how (text, delimiter, target)
    description: str = ""  # before the few-shot block, once
    delimiter: str | None = None  # in front of each choice; acc_norm's length leaves it out (else one space)
    match: AnswerMatch | None = None  # generation: lm-eval's filter and exact_match, instead of ``regex``

    @property
    def shot_text(self) -> str:
        """This item as a solved example in another item's few-shot prompt."""
        if self.shot is not None:
            return self.shot
        if self.kind == CHOICE:
            assert isinstance(self.answer, int)
            return self.context + self.choices[self.answer]
        return self.prompt + str(self.answer)


@dataclass(kw_only=True, slots=True)
class Task:
    name: str
    kind: str
    path: Path
    sha256: str  # of the file's bytes (an lm-eval task's: its YAML and data files): what an output answered
    items: list[EvalItem]  # scored items, in file order
    pool: list[EvalItem]  # few-shot examples ("fewshot": true), in file order
    num_fewshot: int = 0  # shots before each item: --num-fewshot, else the task file's own default
    fewshot_delimiter: str = FEWSHOT_DELIMITER

    def shots(self, item: EvalItem, k: int) -> list[EvalItem]:
        """The item's K examples: the pool's first K, or else the first K other scored items."""
        source = self.pool if self.pool else [x for x in self.items if x is not item]
        if k > len(source):
            raise UsageError(
                f"{self.path}: {k}-shot needs {k} examples; the task has {len(source)} "
                + ("marked fewshot" if self.pool else "other items")
            )
        return source[:k]

    def text_before(self, item: EvalItem, k: int) -> str:
        """The item's description and few-shot block, which precede its own context or prompt ('' for a
        flood task with k = 0)."""
        if k == 0:
            return item.description
        return item.description + "".join(s.shot_text + self.fewshot_delimiter for s in self.shots(item, k))


def read_task_file(path: Path, regex: str | None) -> Task:
    """One flood task file (JSONL of items; see the module docstring)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise os_error(exc, str(path)) from None
    name = path.name.removesuffix(".jsonl").removesuffix(".json")
    items: list[EvalItem] = []
    ids: dict[str, int] = {}
    kind: str | None = None
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = parse_json(raw)
        except BadLine as exc:
            reason = str(exc)
            raise UsageError(
                f"{where}: {reason}" if "nested" in reason else f"{where}: not a JSON object ({reason})"
            ) from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: not a JSON object")
        check_unicode(obj, where)
        obj = convert_row(obj, number, where) or obj  # a HellaSwag, ARC, MMLU, PIQA or GSM8K row as exported
        item = parse_item(obj, name, number, where, regex)
        if kind is None:
            kind = item.kind
        elif item.kind != kind:
            raise UsageError(
                f"{where}: a {item.kind} item in a file of {kind} items",
                hint="put multiple-choice and generation items in separate task files",
            )
        if item.id in ids:
            raise UsageError(f"{where}: id {printable(item.id)} was already used on line {ids[item.id]}")
        ids[item.id] = number
        items.append(item)
    scored = [i for i in items if not i.fewshot]
    if not scored:
        raise UsageError(f"{path}: no items to score")
    assert kind is not None
    return Task(
        name=name,
        kind=kind,
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        items=scored,
        pool=[i for i in items if i.fewshot],
    )


def parse_item(obj: dict[str, Any], task: str, line: int, where: str, default_regex: str | None) -> EvalItem:
    """One item in flood's form, each field checked; a usage error naming ``where`` otherwise."""
    item_id = obj.get("id")
    if not isinstance(item_id, str) or not item_id or len(item_id) > MAX_ID_CHARS:
        raise UsageError(f"{where}: 'id' must be a non-empty string of at most {MAX_ID_CHARS} characters")
    fewshot = obj.get("fewshot", False)
    if not isinstance(fewshot, bool):
        raise UsageError(f"{where}: 'fewshot' must be true or false")
    if "choices" in obj:
        return _choice_item(obj, EvalItem(task=task, id=item_id, kind=CHOICE, line=line, fewshot=fewshot), where)
    if "prompt" in obj:
        item = EvalItem(task=task, id=item_id, kind=GENERATE, line=line, fewshot=fewshot)
        return _generation_item(obj, item, where, default_regex)
    raise UsageError(
        f"{where}: neither a multiple-choice item (context, choices, answer) nor a generation item (prompt, answer)"
    )


def _choice_item(obj: dict[str, Any], item: EvalItem, where: str) -> EvalItem:
    """``item`` with the fields of a multiple-choice line, each checked."""
    _only(obj, _CHOICE_KEYS, where)
    context, choices, answer = obj.get("context"), obj["choices"], obj.get("answer")
    if not isinstance(context, str):
        raise UsageError(f"{where}: 'context' must be a string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise UsageError(f"{where}: 'choices' must be a list of at least two non-empty strings")
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise UsageError(f"{where}: 'answer' must be the index of the right choice (0..{len(choices) - 1})")
    item.context, item.choices, item.answer = context, choices, answer
    return item


def _generation_item(obj: dict[str, Any], item: EvalItem, where: str, default_regex: str | None) -> EvalItem:
    """``item`` with the fields of a generation line, each checked."""
    _only(obj, _GENERATE_KEYS, where)
    prompt, answer = obj["prompt"], obj.get("answer")
    stop = obj.get("stop", [])
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    regex = obj.get("regex", default_regex)
    if not isinstance(prompt, str) or not prompt:
        raise UsageError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(answer, str):
        raise UsageError(f"{where}: 'answer' must be a string (the expected text)")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise UsageError(f"{where}: 'stop' must be a list of at most 8 non-empty strings")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise UsageError(f"{where}: 'max_tokens' must be a positive integer")
    if regex is not None:
        if not isinstance(regex, str):
            raise UsageError(f"{where}: 'regex' must be a string")
        compile_regex(regex, where)
    item.prompt, item.answer, item.stop, item.max_tokens, item.regex = prompt, answer, stop, max_tokens, regex
    return item


def check_unicode(obj: dict[str, Any], where: str) -> None:
    """Refuse a line whose text is not valid Unicode. JSON's ``"\\ud800"`` escape decodes to a lone surrogate,
    which has no UTF-8 form: the tokenizer, the results file and the terminal would each fail on it later."""
    for key, value in obj.items():
        if _lone_surrogate(key) is not None:
            raise UsageError(f"{where}: a field name is not valid Unicode: a lone surrogate {_lone_surrogate(key)}")
        bad = _lone_surrogate(value)
        if bad is not None:
            raise UsageError(f"{where}: '{printable(key)}' is not valid Unicode: a lone surrogate {bad}")


def _lone_surrogate(value: Any) -> str | None:
    """The escape (``\\ud800``) of the first lone surrogate in ``value``'s strings, lists and objects; None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return ascii(value[exc.start])[1:-1]
        return None
    if isinstance(value, list):
        return next((bad for v in value if (bad := _lone_surrogate(v)) is not None), None)
    if isinstance(value, dict):
        return next((bad for kv in value.items() for v in kv if (bad := _lone_surrogate(v)) is not None), None)
    return None


def _only(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise UsageError(f"{where}: unknown field {printable(extra[0])} (allowed: {', '.join(sorted(allowed))})")


def compile_regex(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"{where}: regex {pattern!r} does not compile: {exc}") from None


def extract_answer(text: str, regex: str | None) -> str:
    """What a generation answered: the first group of the regex's first match (the whole match when it has no
    group; '' when nothing matches), or the whole text; stripped either way."""
    if regex is None:
        return text.strip()
    match = re.search(regex, text)
    if match is None:
        return ""
    return (match.group(1) if match.re.groups else match.group(0) or "").strip()


@dataclass(kw_only=True, slots=True, frozen=True)
class AnswerMatch:
    """How an lm-eval ``generate_until`` task scores an output: its ``regex`` filter then ``take_first`` (the
    output's ``re.findall`` matches, the ``group_select``-th, its first non-empty group, stripped; ``fallback``
    when nothing matches; the raw output without a filter), then ``exact_match``'s options applied to that
    answer and to the target alike (``lm_eval.api.metrics.exact_match_hf_evaluate``)."""

    regex: str | None = None
    group_select: int = 0
    fallback: str = "[invalid]"
    regexes_to_ignore: tuple[str, ...] = ()
    ignore_case: bool = False
    ignore_punctuation: bool = False
    ignore_numbers: bool = False

    def answer(self, text: str) -> str:
        if self.regex is None:
            return text
        found = re.findall(self.regex, text)
        if not found or not -len(found) <= self.group_select < len(found):
            return self.fallback
        match = found[self.group_select]
        if isinstance(match, tuple):
            match = next((m for m in match if m), self.fallback)
        return str(match).strip()

    def normalize(self, text: str) -> str:
        for pattern in self.regexes_to_ignore:
            text = re.sub(pattern, "", text)
        if self.ignore_case:
            text = text.lower()
        if self.ignore_punctuation:
            text = text.translate(str.maketrans("", "", string.punctuation))
        if self.ignore_numbers:
            text = text.translate(str.maketrans("", "", string.digits))
        return text
