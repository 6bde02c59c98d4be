"""The task files ``flood eval`` is given, read whole before anything runs: flood's own JSONL tasks
(``tasks.py``) and lm-evaluation-harness YAML task files (``lm_eval_yaml.py``)."""

from __future__ import annotations

from pathlib import Path

from lingctl.core.errors import UsageError
from lingctl.flood.eval.lm_eval_yaml import read_yaml_task
from lingctl.flood.eval.tasks import GENERATE, YAML_SUFFIXES, Task, compile_regex, read_task_file


def read_tasks(paths: list[Path], *, regex: str | None = None, num_fewshot: int | None = None) -> list[Task]:
    """Every task file, validated whole before anything runs: a bad line is a usage error naming it. Each task's
    ``num_fewshot`` is ``num_fewshot`` when given, else its file's own (an lm-eval task's), else 0."""
    if not paths:
        raise UsageError("no task file given")
    if regex is not None:
        compile_regex(regex, "--regex")
    tasks: list[Task] = []
    seen: dict[str, Path] = {}
    for path in paths:
        if Path(path).suffix.lower() in YAML_SUFFIXES:
            task = read_yaml_task(Path(path), num_fewshot)
            if regex is not None and task.kind == GENERATE:
                raise UsageError(f"{path}: --regex does not apply to an lm-eval task file (its filter_list does)")
        else:
            task = read_task_file(Path(path), regex)
            task.num_fewshot = num_fewshot or 0
        if task.name in seen:
            raise UsageError(
                f"two task files are both named {task.name!r}: {seen[task.name]} and {path}",
                hint="a task is named by its file's stem (an lm-eval task file's by its 'task'); rename one",
            )
        seen[task.name] = task.path
        tasks.append(task)
    return tasks
