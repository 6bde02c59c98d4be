"""``lingctl train``'s options: the run's own (where it is, how it starts, the launcher of several workers) as
``Annotated`` aliases, and one option per training setting, derived from the settings' declaration.

A setting is declared once, as a field of ``lingctl.runs.train_config.TrainConfig`` whose metadata names its
flag and help text (``lingctl.runs.settings``). :func:`with_settings` turns every such field into an option of
a command, in place of the command's ``settings`` parameter; the command receives the values given as one
mapping of dotted setting names, None for those not given (what ``lingctl.train.run.train`` takes as
overrides). Range rules are the settings' own, checked the same way for a flag, ``--set`` and a TOML file.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from lingctl.commands.options import (
    DURATION_FORMS,
    EndpointOpt,
    JsonOpt,
    PathStyleOpt,
    ProfileOpt,
    RegionOpt,
    duration,
)
from lingctl.runs.settings import Setting, walk

F = TypeVar("F", bound=Callable[..., Any])

Settings = dict[str, Any]  # dotted setting name -> the value given on the command line (None: not given)

OutOpt = Annotated[
    str | None,
    typer.Option(
        "--out",
        "-o",
        metavar="DIR|s3://BUCKET/PREFIX",
        help="Run directory, local or s3://bucket/prefix (default: runs/PRESET-TIME).",
    ),
]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")]
AdoptOpt = Annotated[
    bool,
    typer.Option(
        "--adopt",
        help="Let --out be an existing directory that holds other files: the run adds its own files "
        "(listed in lingctl-run.json) and never overwrites or deletes the others; a name it "
        "needs that is taken is refused.",
    ),
]
CacheDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        metavar="DIR",
        help="Node-local fast disk for s3:// runs: checkpoints land here and upload in the "
        "background (default: ~/.cache/lingctl/runs).",
    ),
]
NprocOpt = Annotated[
    int,
    typer.Option(
        "--nproc",
        min=1,
        metavar="N",
        help="Workers on this machine, started by torch.distributed.run (torchrun); on many "
        "machines run 'torchrun ... -m lingctl train' instead.",
    ),
]
MaxRestartsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-restarts",
        min=0,
        metavar="N",
        help="With --nproc: restart all workers from the last checkpoint this many times after one crashes "
        "or the job hangs (never after bad settings or a stop) [default: 3 with the watchdog, else 0].",
    ),
]
HangTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--hang-timeout",
        parser=duration,
        metavar="DURATION",
        help=f"Watchdog: a job with no progress on any worker for this long is hung ({DURATION_FORMS}) "
        "[default: max(25s, 10 x the median step), at least 2 x the longest checkpoint save].",
    ),
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", metavar="FILE", help="TOML file with a [train] table.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", metavar="KEY=VALUE", help="Any setting, e.g. moe.balance_coef=0.02 or model.num_hidden_layers=2."
    ),
]


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """The options of every command that runs training (``train``, ``train sft``, ``train dpo``): where the run
    is, how it starts, the launcher of several workers, the object store, and the output mode."""

    out: str | None = None
    resume: bool = False
    adopt: bool = False
    cache_dir: Path | None = None
    nproc: int = 1
    max_restarts: int | None = None
    hang_timeout: float | None = None
    config: Path | None = None
    sets: list[str] | None = None
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    path_style: bool | None = None
    dry_run: bool = False
    json: bool = False


PlanOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run", "-n", help="Print the memory plan per worker and whether it fits; start nothing, write nothing."
    ),
]


def _run_option_types() -> dict[str, Any]:
    return {
        "out": OutOpt,
        "resume": ResumeOpt,
        "adopt": AdoptOpt,
        "cache_dir": CacheDirOpt,
        "nproc": NprocOpt,
        "max_restarts": MaxRestartsOpt,
        "hang_timeout": HangTimeoutOpt,
        "config": ConfigOpt,
        "sets": SetOpt,
        "endpoint_url": EndpointOpt,
        "region": RegionOpt,
        "profile": ProfileOpt,
        "path_style": PathStyleOpt,
        "dry_run": PlanOnlyOpt,
        "json": JsonOpt,
    }


def _expand(command: F, name: str, options: dict[str, tuple[Any, Any]], collect: Callable[[dict[str, Any]], Any]) -> F:
    """``command`` with its parameter ``name`` replaced by keyword options (``options``: option parameter ->
    (default, annotation)); called with ``name`` set to ``collect`` of those options' values."""
    signature = inspect.signature(command, eval_str=True)
    params: list[inspect.Parameter] = []
    for p in signature.parameters.values():
        if p.name != name:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        for option, (default, annotation) in options.items():
            params.append(
                inspect.Parameter(option, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            )

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        kwargs[name] = collect({option: kwargs.pop(option) for option in options})
        return command(**kwargs)

    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def with_run_options(command: F) -> F:
    """A decorator: the command gets the :class:`RunOptions` as options where its ``run`` parameter is, and is
    called with them as one ``run`` object."""
    defaults = RunOptions()
    options = {name: (getattr(defaults, name), annotation) for name, annotation in _run_option_types().items()}
    return _expand(command, "run", options, lambda values: RunOptions(**values))


def with_settings(cls: type) -> Callable[[F], F]:
    """A decorator: the command gets an option for every setting of ``cls`` that names a flag, where its
    ``settings`` parameter is, and is called with their values as ``settings`` (a :data:`Settings`)."""
    defaults = cls()
    dotted_of: dict[str, str] = {}
    options: dict[str, tuple[Any, Any]] = {}
    for dotted, kind, s in walk(cls):
        if s.flag:
            dotted_of[_name(s)] = dotted
            options[_name(s)] = (None, _annotation(kind, s, _default_shown(defaults, dotted)))

    def collect(values: dict[str, Any]) -> Settings:
        return {dotted_of[name]: _given(value) for name, value in values.items()}

    return lambda command: _expand(command, "settings", options, collect)


def _name(s: Setting) -> str:
    """The option's parameter name, from its flag (``--max-seconds``: ``max_seconds``)."""
    assert s.flag_name is not None
    return s.flag_name.lstrip("-").replace("-", "_")


def _default_shown(defaults: Any, dotted: str) -> str | bool:
    """The setting's default as ``--help`` shows it; nothing for one that has none of its own (None: the
    preset's, or decided at run time, as its help says)."""
    value = defaults
    for part in dotted.split("."):
        value = getattr(value, part)
    if value is None or value == [] or isinstance(value, bool):
        return False
    return str(value)


def _annotation(kind: Any, s: Setting, shown: str | bool) -> Any:
    """``Annotated[T | None, typer.Option(...)]`` for a setting of type ``kind`` (None: not given)."""
    assert s.flag is not None
    decls = [s.flag, *([s.short] if s.short else [])]
    text = s.help.replace("{duration}", DURATION_FORMS) if s.help else ""
    # The default in the help text itself: the option's own default is None (not given), which click would show
    # in parentheses.
    if shown is not False:
        text = f"{text}  [default: {shown}]".strip()
    option = typer.Option(
        *decls,
        help=text or None,
        metavar=s.metavar or _metavar(kind),
        parser=duration if s.duration else None,
        show_default=False,
    )
    return Annotated[_optional(kind), option]


def _metavar(kind: Any) -> str | None:
    """What --help shows for a value of ``kind`` (choices of a Literal are shown by click itself)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # T | None
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    base = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    return {int: "N", float: "NUMBER", str: "TEXT", Path: "PATH"}.get(base)


def _optional(kind: Any) -> Any:
    """``kind | None`` (``kind`` may already allow None)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind):
        return kind
    return typing.Optional[kind]  # noqa: UP045 (built at run time from a type object)


def _given(value: Any) -> Any:
    """None for an option not given (a repeatable one gives an empty list)."""
    if isinstance(value, list | tuple):
        return list(value) or None
    return value
