"""lm-evaluation-harness task files (``*.yaml``, lm-eval 0.4) read into flood tasks, over local data files.

Each document of the scored split becomes the flood item that lm-eval's request for it would be
(``ConfigurableTask.fewshot_context`` and ``construct_requests``):

- ``doc_to_text``, ``doc_to_target``, ``doc_to_choice``: a column name gives the document's value; any other
  string is a Jinja template rendered over the document (a ``doc_to_choice`` rendering is then read as a Python
  literal, ``ast.literal_eval``; a ``doc_to_target`` one that is all digits is a choice index); a YAML list or
  number is itself.
- multiple choice: context ``description + doc_to_text``, each choice ``target_delimiter + choice``, the answer
  the target's index (an index, or one of the choices' texts);
- generation: the same prompt, stopped at ``until``, at most ``max_gen_toks`` tokens, scored by the task's
  regex filter and ``exact_match`` (``AnswerMatch``);
- a few-shot example is ``doc_to_text + target_delimiter + target``, followed by ``fewshot_delimiter``; the
  description precedes the examples once. Examples are the first K rows of the few-shot split (lm-eval samples
  them at random, with a seed), or of the scored split without the item itself.

Templates render in Jinja's sandbox in one worker process under time, size and memory limits (``TextTemplates``),
in lm-eval's environment (a missing variable is an error). Every row is built before any model work, so a
problem anywhere is a usage error naming the file, the row and the key.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError, UsageError
from lingctl.flood.eval.lm_eval_config import TaskSpec, read_spec
from lingctl.flood.eval.lm_eval_data import data_files, fill_columns, read_rows
from lingctl.flood.eval.tasks import CHOICE, EvalItem, Task, check_unicode, parse_item
from lingctl.model.chat_template import RenderError, TextTemplates, check_text_syntax


def read_yaml_task(path: Path, num_fewshot: int | None) -> Task:
    """The task at ``path``: its scored items and, when shots are asked for, the first K of its few-shot split
    (``num_fewshot`` when given, else the file's own, else 0)."""
    spec = read_spec(path)
    k = num_fewshot if num_fewshot is not None else (spec.num_fewshot or 0)
    files = data_files(spec.data_files, path)
    with TextTemplates() as templates:
        docs = _Docs(spec, files, templates)
        rows, wheres = docs.split(spec.scored_split)
        columns = fill_columns(rows)
        if not rows:
            raise UsageError(f"{path}: split {spec.scored_split!r} has no rows to score")
        items = docs.items(rows, wheres, columns, _ids(rows), fewshot=False)
        pool: list[EvalItem] = []
        if k > 0 and spec.shot_split != spec.scored_split:
            shot_rows, shot_wheres = docs.split(spec.shot_split)
            fill_columns(shot_rows)
            if len(shot_rows) < k:
                raise UsageError(f"{path}: {k}-shot needs {k} examples; split {spec.shot_split!r} has {len(shot_rows)}")
            ids = [f"{spec.shot_split}-{i}" for i in range(k)]
            pool = docs.items(shot_rows[:k], shot_wheres[:k], columns, ids, fewshot=True)
        elif k >= len(items):
            raise UsageError(f"{path}: {k}-shot needs {k} examples; the task has {len(items) - 1} other items")
    return Task(
        name=spec.name,
        kind=spec.kind,
        path=path,
        sha256=spec.hasher.hexdigest(),
        items=items,
        pool=pool,
        num_fewshot=k,
        fewshot_delimiter=spec.fewshot_delimiter,
    )


def _ids(rows: list[dict[str, Any]]) -> list[str]:
    """The rows' own ``id`` values when each row has a distinct one, else lm-eval's document numbers."""
    ids = [r.get("id") for r in rows]
    if all(isinstance(v, (str, int)) and not isinstance(v, bool) and str(v) for v in ids):
        if len({str(v) for v in ids}) == len(ids):
            return [str(v) for v in ids]
    return [str(i) for i in range(len(rows))]


class _Docs:
    """A task's data and templates: rows by split, and rows into items."""

    def __init__(self, spec: TaskSpec, files: dict[str, list[Path]], templates: TextTemplates) -> None:
        self.spec, self.files, self.templates = spec, files, templates
        self._read: set[Path] = set()

    def split(self, name: str) -> tuple[list[dict[str, Any]], list[str]]:
        """The split's rows and where each is ("FILE: row N"), its files' bytes added to the task's sha256."""
        if name not in self.files:
            raise UsageError(
                f"{self.spec.path}: split {name!r} has no file in dataset_kwargs.data_files "
                f"(it has: {', '.join(self.files)})"
            )
        rows: list[dict[str, Any]] = []
        wheres: list[str] = []
        for file in self.files[name]:
            found, data = read_rows(self.spec.builder, file, self.spec.path)
            if file not in self._read:
                self._read.add(file)
                self.spec.hasher.update(data)
            rows += found
            wheres += [f"{file}: row {n}" for n in range(1, len(found) + 1)]
        return rows, wheres

    def items(
        self, rows: list[dict[str, Any]], wheres: list[str], columns: list[str], ids: list[str], *, fewshot: bool
    ) -> list[EvalItem]:
        spec = self.spec
        texts, text_rendered = self._values("doc_to_text", spec.text, rows, wheres, columns)
        targets, target_rendered = self._values("doc_to_target", spec.target, rows, wheres, columns)
        choices: list[Any] = [None] * len(rows)
        if spec.choice is not None:
            values, rendered = self._values("doc_to_choice", spec.choice, rows, wheres, columns)
            choices = [_choice_list(v, rendered, where) for v, where in zip(values, wheres, strict=True)]
        descriptions = [""] * len(rows)
        if spec.description and not fewshot:  # lm-eval renders it over the scored document only
            descriptions = self._values("description", spec.description, rows, wheres, columns)[0]
        out = []
        for n, where in enumerate(wheres):
            text = _text(texts[n], text_rendered, spec.choice is not None, where)
            target = _target(targets[n], target_rendered, spec.choice is not None, where)
            item = self._item(ids[n], n + 1, text, target, choices[n], where, fewshot)
            item.description = descriptions[n]
            out.append(item)
        return out

    def _item(
        self, item_id: str, line: int, text: str, target: Any, choices: list[str] | None, where: str, fewshot: bool
    ) -> EvalItem:
        spec = self.spec
        delim = spec.target_delimiter
        obj: dict[str, Any] = {"id": item_id, "fewshot": fewshot}
        if spec.kind == CHOICE:
            assert choices is not None
            answer = _choice_index(target, choices, where)
            obj.update(context=text, choices=[delim + c for c in choices], answer=answer)
            shown = choices[answer]
        else:
            shown = choices[_choice_index(target, choices, where)] if choices is not None else str(target)
            obj.update(prompt=text, answer=shown, stop=spec.stop, max_tokens=spec.max_tokens)
        check_unicode(obj, where)
        item = parse_item(obj, spec.name, line, where, None)
        item.shot = text + (delim + shown if shown != "" else "")
        item.delimiter = delim if spec.kind == CHOICE else None
        item.match = spec.match
        return item

    def _values(
        self, key: str, value: Any, rows: list[dict[str, Any]], wheres: list[str], columns: list[str]
    ) -> tuple[list[Any], bool]:
        """Each row's ``key``, and whether it was rendered from a template (lm-eval then reads it further)."""
        if not isinstance(value, str):
            return [value] * len(rows), False
        if value in columns:
            lacking = next((where for row, where in zip(rows, wheres, strict=True) if value not in row), None)
            if lacking is not None:  # a few-shot split without the scored split's column
                raise UsageError(f"{lacking}: {key}: the row has no column {value!r}")
            return [row[value] for row in rows], False
        if "{" not in value and "\r" not in value:  # no Jinja syntax: it renders to itself
            return [value] * len(rows), True
        problem = check_text_syntax(value)
        if problem is not None:
            raise UsageError(f"{self.spec.path}: {key}: the template does not parse: {problem}")
        try:
            texts = self.templates.render_many(value, rows)
        except (LingctlError, RenderError, TypeError) as exc:
            raise UsageError(f"{self.spec.path}: {key}: {exc}") from None
        for text, where in zip(texts, wheres, strict=True):
            if isinstance(text, RenderError):
                raise UsageError(f"{where}: {key}: {text}")
        return texts, True


def _text(value: Any, rendered: bool, has_choices: bool, where: str) -> str:
    if (rendered and has_choices and value.isdigit()) or not isinstance(value, str):
        raise UsageError(
            f"{where}: doc_to_text gives {value!r}, a choice index (lm-eval's multiple inputs): not supported"
            if has_choices
            else f"{where}: doc_to_text gives {value!r}, not text"
        )
    return value


def _target(value: Any, rendered: bool, has_choices: bool, where: str) -> Any:
    """lm-eval's ``doc_to_target`` reading of a rendered template: digits are an index (with choices), a list
    literal a list of targets; anything else stays text."""
    if rendered:
        if value.isdigit() and has_choices:
            return int(value)
        if len(value) >= 2 and value[0] == "[" and value[-1] == "]":
            try:
                value = ast.literal_eval(value)
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                return value
    if isinstance(value, (list, tuple)):
        raise UsageError(f"{where}: doc_to_target gives a list (several right answers): not supported")
    return value


def _choice_list(value: Any, rendered: bool, where: str) -> list[str]:
    if rendered:
        try:
            value = ast.literal_eval(value)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            raise UsageError(f"{where}: doc_to_choice gives {value[:80]!r}, not a list literal") from None
    if isinstance(value, dict):  # lm-eval takes a mapping's values
        value = list(value.values())
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        raise UsageError(f"{where}: doc_to_choice must give a list of strings")
    return list(value)


def _choice_index(target: Any, choices: list[str] | None, where: str) -> int:
    """The target as an index into the choices: an index, one of the choices' texts, or digits."""
    assert choices is not None
    if isinstance(target, str) and target in choices:
        index = choices.index(target)
    elif isinstance(target, str) and target.strip().isdigit():
        index = int(target)
    elif isinstance(target, int) and not isinstance(target, bool):
        index = target
    else:
        raise UsageError(f"{where}: doc_to_target gives {target!r}: neither a choice's index nor a choice's text")
    if not 0 <= index < len(choices):
        raise UsageError(f"{where}: doc_to_target gives index {index}; there are {len(choices)} choices")
    return index
