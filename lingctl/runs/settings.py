"""A setting declared once: a dataclass field whose metadata says everything else there is to say about it.

Each field of a settings dataclass may carry a :class:`Setting` (through :func:`setting`): the range rule it is
checked against wherever its value comes from (a flag, ``--set``, a TOML file, a saved run), the flag that sets
it on the command line with its help text, whether a resumed run may change it, and whether it is a fault drill
of the job's first attempt only. The command line, the error messages and the resume rules are derived from
it, so a new setting is one field.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lingctl.core.errors import UsageError

Check = tuple[Callable[[Any], bool], str]  # (predicate, the rule in words)

_KEY = "lingctl.setting"


def whole(low: int, high: int | None = None) -> Check:
    """An integer >= ``low`` (and <= ``high``)."""
    rule = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    return (lambda v: v >= low and (high is None or v <= high)), rule


def number(
    low: float, high: float = math.inf, *, above: bool = False, below: bool = False, finite: bool = True
) -> Check:
    """A number in [low, high]; ``above`` / ``below`` exclude the bound itself; ``finite``: NaN and infinity
    are refused (without it only NaN, which no comparison passes)."""

    def ok(v: float) -> bool:
        inside = (v > low if above else v >= low) and (v < high if below else v <= high)
        return inside and (math.isfinite(v) or not finite)

    kind = "a finite number" if finite else "a number"
    if math.isinf(high):
        return ok, f"{kind} {'>' if above else '>='} {low:g}"
    return ok, f"a number in {'(' if above else '['}{low:g}, {high:g}{')' if below else ']'}"


def one_of(*choices: str) -> Check:
    return (lambda v: v in choices), f"one of {', '.join(choices)}"


@dataclass(frozen=True, slots=True)
class Setting:
    """What a settings field means beyond its name, type and default."""

    rule: Check | None = None  # checked unless the value is None ("the default")
    flag: str | None = None  # its command-line option ("--lr"; "--watchdog/--no-watchdog" for a switch)
    short: str | None = None  # a one-letter alias ("-p")
    metavar: str | None = None
    help: str | None = None  # "{duration}" stands for the forms a duration may take
    duration: bool = False  # the flag takes a length of time (30s, 5m), in seconds
    resumable: bool = False  # a resumed run may change it (anything else must match the run's saved value)
    once: bool = False  # a fault drill of the job's first attempt only: a restart or resume drops it

    @property
    def flag_name(self) -> str | None:
        """The flag as an error message names it (a switch by its "on" form)."""
        return self.flag.split("/")[0] if self.flag else None


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field with its :class:`Setting` (``meta``: the Setting's fields)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: Setting(**meta)})


def setting_of(f: dataclasses.Field[Any]) -> Setting:
    found = f.metadata.get(_KEY)
    return found if isinstance(found, Setting) else Setting()


def check_settings(obj: Any, prefix: str = "", *, error: type[Exception] = UsageError) -> None:
    """``error`` naming the first field of ``obj`` (nested settings tables included) outside its rule.

    Numbers that cannot work are refused here, before any data is read: a NaN or infinite learning rate would
    otherwise train for ever on skipped steps, a negative one would climb the loss."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_settings(value, f"{prefix}{f.name}.", error=error)
            continue
        s = setting_of(f)
        if value is None or s.rule is None or s.rule[0](value):
            continue
        shown = f"{prefix}{f.name} ({s.flag_name})" if s.flag_name else f"{prefix}{f.name}"
        raise error(f"{shown} must be {s.rule[1]}, got {value!r}")


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, Setting]]:
    """(dotted name, type, Setting) of every field of the settings class ``cls``, nested tables' fields in
    place of the table, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            yield from walk(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind, setting_of(f)


def top_level(cls: type, where: Callable[[Setting], bool]) -> frozenset[str]:
    """The top-level fields of ``cls`` (whole tables included) whose Setting passes ``where``."""
    return frozenset(f.name for f in dataclasses.fields(cls) if where(setting_of(f)))


def reset(obj: Any, where: Callable[[Setting], bool]) -> None:
    """Every top-level field of ``obj`` whose Setting passes ``where`` back to its default."""
    for f in dataclasses.fields(obj):
        if where(setting_of(f)):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(obj, f.name, default)
