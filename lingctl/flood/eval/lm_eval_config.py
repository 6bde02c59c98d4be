"""The keys of an lm-evaluation-harness task file (lm-eval 0.4's ``TaskConfig``), read and checked.

What each key does here is data: ``HONOURED`` keys are read as lm-eval reads them, ``IGNORED`` ones do not
change what is scored, ``REFUSED`` ones (and any key not named here) stop the run with the reason. A file's
``include`` is read first and its keys overridden by the including file's, as lm-eval does.

Nothing in a task file runs as Python: YAML is read with a safe loader where lm-eval's ``!function module.fn``
tag becomes a marker (``FunctionTag``), and a task that holds one is refused.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lingctl.core.errors import UsageError, os_error
from lingctl.flood.eval.lm_eval_data import BUILDERS
from lingctl.flood.eval.tasks import CHOICE, FEWSHOT_DELIMITER, GENERATE, AnswerMatch

HONOURED = {
    "task", "output_type", "dataset_path", "dataset_kwargs", "test_split", "validation_split", "training_split",
    "fewshot_split", "doc_to_text", "doc_to_target", "doc_to_choice", "description", "target_delimiter",
    "fewshot_delimiter", "num_fewshot", "generation_kwargs", "filter_list", "metric_list", "repeats",
    "fewshot_config",
}  # fmt: skip
IGNORED = {  # they name, group or describe a task; none changes a prompt or a score
    "group", "tag", "task_alias", "metadata", "dataset_name", "should_decontaminate",
    "doc_to_decontamination_query",
}  # fmt: skip
_NO_CODE = "Python functions in task files are not run"
REFUSED = {
    "process_docs": _NO_CODE,
    "process_results": _NO_CODE,
    "custom_dataset": _NO_CODE,
    "unsafe_code": "tasks that run the model's code are not supported",
    "use_prompt": "promptsource prompts are not supported",
    "doc_to_image": "images are not supported",
    "doc_to_audio": "audio is not supported",
    "gen_prefix": "an answer prefix is not supported",
}
_CONVERT_HINT = "convert the data to flood's JSONL items (docs/flood.md), or write the prompt as a Jinja template"
OUTPUT_TYPES = {"multiple_choice": CHOICE, "generate_until": GENERATE}
METRICS = {CHOICE: {"acc", "acc_norm"}, GENERATE: {"exact_match"}}
_MATCH_OPTIONS = {"ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore"}
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HFLM
DEFAULT_REGEX = r"#### (\-?[0-9\.\,]+)"  # lm-eval's RegexFilter
MAX_STOPS = 8
MAX_INCLUDE_DEPTH = 8


class FunctionTag(str):
    """The target of a ``!function module.fn`` tag: read, never imported."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: FunctionTag(loader.construct_scalar(node)))


@dataclass(kw_only=True, slots=True)
class TaskSpec:
    """A task file's keys as flood uses them."""

    path: Path
    name: str
    kind: str  # CHOICE or GENERATE
    builder: str  # json, csv or parquet
    data_files: Any  # dataset_kwargs.data_files as written
    scored_split: str
    shot_split: str  # where few-shot examples come from (the scored split itself: its other items)
    text: Any
    target: Any
    choice: Any = None
    description: str = ""
    target_delimiter: str = " "
    fewshot_delimiter: str = FEWSHOT_DELIMITER
    num_fewshot: int | None = None
    stop: list[str] = field(default_factory=list)
    max_tokens: int = DEFAULT_MAX_GEN_TOKS
    match: AnswerMatch | None = None
    hasher: Any = None  # sha256 of the files read so far (the task file and what it includes)


def read_spec(path: Path) -> TaskSpec:
    """The task file at ``path`` (with what it includes), checked whole; a usage error naming the key."""
    hasher = hashlib.sha256()
    config = _load(path, hasher, 0)
    _check_keys(config, path)
    where = f"{path}:"
    output_type = config.get("output_type", "generate_until")
    kind = OUTPUT_TYPES.get(output_type, "") if isinstance(output_type, str) else ""
    if not kind:
        raise UsageError(
            f"{where} output_type {config['output_type']!r} is not supported (multiple_choice and generate_until are)"
        )
    for key in ("doc_to_text", "doc_to_target") + (("doc_to_choice",) if kind == CHOICE else ()):
        if config.get(key) is None:
            raise UsageError(f"{where} {key} is missing")
    scored = config.get("test_split") or config.get("validation_split")
    if not isinstance(scored, str):
        raise UsageError(f"{where} neither test_split nor validation_split names the split to score")
    # lm-eval's few-shot source: fewshot_split, else the training, validation or test split, in that order.
    shots = next(
        config[k] for k in ("fewshot_split", "training_split", "validation_split", "test_split") if config.get(k)
    )
    spec = TaskSpec(
        path=path,
        name=_string(config, "task", path.stem, where),
        kind=kind,
        builder=_builder(config, where),
        data_files=_data_files(config, where),
        scored_split=scored,
        shot_split=str(shots),
        text=config["doc_to_text"],
        target=config["doc_to_target"],
        choice=config.get("doc_to_choice"),
        description=_string(config, "description", "", where),
        target_delimiter=_string(config, "target_delimiter", " ", where),
        fewshot_delimiter=_string(config, "fewshot_delimiter", FEWSHOT_DELIMITER, where),
        hasher=hasher,
    )
    spec.num_fewshot = config.get("num_fewshot")
    if spec.num_fewshot is not None and (not _is_int(spec.num_fewshot) or spec.num_fewshot < 0):
        raise UsageError(f"{where} num_fewshot must be a whole number >= 0")
    if config.get("repeats", 1) != 1:
        raise UsageError(f"{where} repeats {config['repeats']!r}: flood answers each item once, greedily")
    _check_fewshot_config(config.get("fewshot_config"), where)
    options = _metrics(config.get("metric_list"), kind, where)
    if kind == GENERATE:
        spec.stop, spec.max_tokens = _generation(config.get("generation_kwargs"), spec.fewshot_delimiter, where)
        spec.match = AnswerMatch(**_filter(config.get("filter_list"), where), **options)
    elif config.get("filter_list"):
        raise UsageError(f"{where} filter_list: filters on multiple-choice tasks are not supported")
    return spec


def _load(path: Path, hasher: Any, depth: int) -> dict[str, Any]:
    """The file's keys over those of the files it includes (the first named wins among those)."""
    if depth > MAX_INCLUDE_DEPTH:
        raise UsageError(f"{path}: includes nest deeper than {MAX_INCLUDE_DEPTH} files (a cycle?)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise os_error(exc, str(path)) from None
    hasher.update(data)
    try:
        config = yaml.load(data, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise UsageError(f"{path}: not an lm-eval task file (a mapping of keys)")
    kwargs = config.get("dataset_kwargs")
    if isinstance(kwargs, dict) and "data_files" in kwargs:
        try:
            kwargs["data_files"] = _anchored(kwargs["data_files"], path.parent)
        except RecursionError:  # a YAML alias that holds itself
            raise UsageError(f"{path}: dataset_kwargs.data_files nests without end") from None
    include = config.pop("include", None)
    if include is None:
        return config
    names = [include] if isinstance(include, str) else include
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise UsageError(f"{path}: include must be a file name or a list of them")
    merged: dict[str, Any] = {}
    for name in reversed(names):
        merged.update(_load(path.parent / name, hasher, depth + 1))
    merged.update(config)
    return merged


def _anchored(files: Any, directory: Path) -> Any:
    """``data_files`` with each relative path made relative to ``directory``: the file that names it."""
    if isinstance(files, str):
        return str(directory / files)
    if isinstance(files, list):
        return [_anchored(f, directory) for f in files]
    if isinstance(files, dict):
        return {split: _anchored(f, directory) for split, f in files.items()}
    return files  # refused when read


def _check_keys(config: dict[str, Any], path: Path) -> None:
    for key, value in config.items():
        tagged = _function_in(value)
        if tagged is not None:
            raise UsageError(f"{path}: {key}: !function {tagged}: {_NO_CODE}", hint=_CONVERT_HINT)
        if key in REFUSED and value not in (None, False):
            raise UsageError(f"{path}: {key}: {REFUSED[key]}", hint=_CONVERT_HINT if REFUSED[key] == _NO_CODE else None)
        if key not in HONOURED and key not in IGNORED and key not in REFUSED:
            raise UsageError(f"{path}: unknown key {key!r}", hint="docs/flood.md lists the keys flood reads")


def _function_in(value: Any, seen: set[int] | None = None) -> str | None:
    """The first ``!function`` target inside ``value``. Each container is looked at once: YAML aliases can
    make a small file a structure that repeats (or holds) itself."""
    if isinstance(value, FunctionTag):
        return str(value)
    seen = set() if seen is None else seen
    if not isinstance(value, (dict, list)) or id(value) in seen:
        return None
    seen.add(id(value))
    values = list(value.values()) if isinstance(value, dict) else value
    return next((found for v in values if (found := _function_in(v, seen)) is not None), None)


def _builder(config: dict[str, Any], where: str) -> str:
    builder = config.get("dataset_path")
    if builder in BUILDERS:
        return str(builder)
    if builder == "jsonl":
        raise UsageError(f"{where} dataset_path: write json (it reads JSON Lines too)")
    raise UsageError(
        f"{where} dataset_path {builder!r}: only local data files are read (json, csv, parquet); no Hub datasets",
        hint="write 'dataset_path: json' and 'dataset_kwargs: {data_files: {test: rows.jsonl}}'",
    )


def _data_files(config: dict[str, Any], where: str) -> Any:
    kwargs = config.get("dataset_kwargs")
    if not isinstance(kwargs, dict) or kwargs.get("data_files") is None:
        raise UsageError(f"{where} dataset_kwargs.data_files must name the local data files")
    extra = sorted(set(kwargs) - {"data_files", "trust_remote_code"})  # the latter: no code runs for local files
    if extra:
        raise UsageError(f"{where} dataset_kwargs.{extra[0]} is not supported (data_files is)")
    return kwargs["data_files"]


def _check_fewshot_config(value: Any, where: str) -> None:
    if value is None:
        return
    # "default" samples at random (lm-eval seeds it), "first_n" takes the first rows: flood takes the first rows.
    if not isinstance(value, dict) or set(value) - {"sampler"} or value.get("sampler") not in ("default", "first_n"):
        raise UsageError(f"{where} fewshot_config: only 'sampler: first_n' (or default) is supported")


def _metrics(value: Any, kind: str, where: str) -> dict[str, Any]:
    """The exact_match options (generation) of ``metric_list``; every metric checked."""
    options: dict[str, Any] = {}
    for entry in value if value is not None else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("metric"), str):
            raise UsageError(f"{where} metric_list: each entry must be a mapping with a 'metric' name")
        name = entry["metric"]
        if name not in METRICS[kind]:
            raise UsageError(
                f"{where} metric_list: metric {name!r} is not supported here ({', '.join(sorted(METRICS[kind]))} are)"
            )
        if entry.get("aggregation", "mean") != "mean" or entry.get("higher_is_better", True) is not True:
            raise UsageError(f"{where} metric_list: {name}: only aggregation mean, higher_is_better true")
        extra = (
            set(entry) - {"metric", "aggregation", "higher_is_better"} - (_MATCH_OPTIONS if kind == GENERATE else set())
        )
        if extra:
            raise UsageError(f"{where} metric_list: {name}: option {sorted(extra)[0]!r} is not supported")
        for key in _MATCH_OPTIONS & set(entry):
            options[key] = _match_option(key, entry[key], where)
    return options


def _match_option(key: str, value: Any, where: str) -> Any:
    if key != "regexes_to_ignore":
        if not isinstance(value, bool):
            raise UsageError(f"{where} metric_list: exact_match: {key} must be true or false")
        return value
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise UsageError(f"{where} metric_list: exact_match: regexes_to_ignore must be a list of patterns")
    for pattern in value:
        _compile(pattern, f"{where} metric_list: exact_match: regexes_to_ignore")
    return tuple(value)


def _generation(value: Any, fewshot_delimiter: str, where: str) -> tuple[list[str], int]:
    """Stop strings and the token limit of ``generation_kwargs`` (lm-eval's defaults without it)."""
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise UsageError(f"{where} generation_kwargs must be a mapping")
    extra = sorted(set(value) - {"until", "max_gen_toks", "do_sample", "temperature"})
    if extra:
        raise UsageError(f"{where} generation_kwargs.{extra[0]} is not supported (flood eval decodes greedily)")
    temperature = value.get("temperature", 0)
    if value.get("do_sample", False) is not False or not isinstance(temperature, (int, float)) or temperature > 0:
        raise UsageError(f"{where} generation_kwargs: sampling is not supported (flood eval decodes greedily)")
    until = value.get("until", [fewshot_delimiter])
    until = [until] if isinstance(until, str) else until
    if not isinstance(until, list) or not all(isinstance(s, str) for s in until):
        raise UsageError(f"{where} generation_kwargs.until must be a string or a list of strings")
    until = [s for s in until if s]  # lm-eval skips empty stop strings
    if len(until) > MAX_STOPS:
        raise UsageError(f"{where} generation_kwargs.until: at most {MAX_STOPS} stop strings")
    max_tokens = value.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise UsageError(f"{where} generation_kwargs.max_gen_toks must be a positive whole number")
    return until, max_tokens


def _filter(value: Any, where: str) -> dict[str, Any]:
    """The regex step of ``filter_list``: one pipeline, ``regex`` (optional) then ``take_first``."""
    if not value:
        return {}
    what = f"{where} filter_list:"
    if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
        raise UsageError(f"{what} must be a list of pipelines, each a 'name' and a 'filter' list")
    if len(value) != 1:
        names = ", ".join(str(p.get("name")) for p in value)
        raise UsageError(f"{what} {len(value)} pipelines ({names}); flood scores one: keep the one to score")
    steps = value[0].get("filter")
    if set(value[0]) - {"name", "filter"} or not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise UsageError(f"{what} a pipeline is a 'name' and a 'filter' list of steps")
    functions = [s.get("function") for s in steps]
    if functions not in (["take_first"], ["regex", "take_first"]):
        raise UsageError(f"{what} steps {functions}: only 'regex' then 'take_first' are supported")
    if functions == ["take_first"]:
        return {}
    regex = steps[0]
    extra = sorted(set(regex) - {"function", "regex_pattern", "group_select", "fallback"})
    if extra or set(steps[1]) != {"function"}:
        raise UsageError(f"{what} the regex step's {extra[0] if extra else 'take_first options'} are not supported")
    pattern, group, fallback = (
        regex.get("regex_pattern", DEFAULT_REGEX),
        regex.get("group_select", 0),
        regex.get("fallback", "[invalid]"),
    )
    if not isinstance(pattern, str) or not _is_int(group) or not isinstance(fallback, str):
        raise UsageError(f"{what} regex_pattern and fallback must be strings, group_select a whole number")
    _compile(pattern, f"{what} regex_pattern")
    return {"regex": pattern, "group_select": group, "fallback": fallback}


def _string(config: dict[str, Any], key: str, default: str, where: str) -> str:
    value = config.get(key, default)
    if not isinstance(value, str):
        raise UsageError(f"{where} {key} must be a string")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _compile(pattern: str, where: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"{where}: {pattern!r} does not compile: {exc}") from None
