"""Typed dataclass configs from TOML files plus command-line overrides.

A config class is a ``@dataclass(kw_only=True, slots=True)``; a TOML file supplies some fields (optionally
under a ``[section]``), command-line flags override them, and the result is type-checked field by field so
that a typo or a wrong type is one clear line naming the file, the key and what was expected. Nested
dataclasses are TOML tables; dotted overrides (``optim.lr=3e-4``) reach into them.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lingctl.core.errors import NotFoundError, UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def load_toml(path: str | Path, section: str | None = None) -> dict[str, Any]:
    """The table at ``section`` (dotted for nested tables) of the TOML file ``path``, or the whole file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise NotFoundError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"config file {path} is a directory") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None
    if section:
        for part in section.split("."):
            data = data.get(part, {})
            if not isinstance(data, dict):
                raise UsageError(f"{path}: [{section}] is not a table")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` from a ``--set`` flag; the value is read as TOML (``3e-4``, ``true``, ``[1, 2]``)
    and falls back to a plain string, so ``name=run1`` needs no quotes."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def build(
    cls: type[T],
    *,
    file: str | Path | None = None,
    section: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """``cls`` from ``file`` (its ``section``) with ``overrides`` on top. Overrides whose value is None are
    ignored, so unset command-line options do not mask the file. Keys may be dotted for nested configs."""
    data: dict[str, Any] = load_toml(file, section) if file is not None else {}
    where = f"{file}" + (f" [{section}]" if section else "") if file is not None else "settings"
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        _set_dotted(data, key, value)
    return from_mapping(cls, data, where=where)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UsageError(f"cannot set {key!r}: {part!r} is not a table")
        node = child
    node[last] = value


def from_mapping(cls: type[T], data: Mapping[str, Any], *, where: str = "settings", path: str = "") -> T:
    """Build the dataclass ``cls`` from ``data``, checking names and types; then run its ``validate()``."""
    if not isinstance(data, Mapping):
        raise UsageError(f"{where}: {path or cls.__name__} must be a table, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UsageError(
            f"{where}: unknown setting {_join(path, unknown[0])!r}", hint=f"known settings: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], where, _join(path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise UsageError(f"{where}: missing required setting {_join(path, name)!r}")
    try:
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            validate()
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{where}: {exc}") from None
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """A config as plain TOML/JSON-friendly values, for checkpoints and output manifests."""
    from lingctl.core.output import to_jsonable

    return to_jsonable(obj)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _mismatch(value: Any, where: str, path: str, expected: str) -> UsageError:
    return UsageError(f"{where}: {path} must be {expected}, got {_kind(value)} {value!r}")


def _coerce(value: Any, tp: Any, where: str, path: str) -> Any:
    """``value`` as the type ``tp``, converting what a TOML file or a command line writes (``"3"`` for 3,
    ``"yes"`` for true, ``"a,b"`` for a list); otherwise a ``UsageError`` naming ``path`` and both types."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), where, path)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise _mismatch(value, where, path, "one of " + ", ".join(repr(a) for a in typing.get_args(tp)))
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, where=where, path=path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise _mismatch(value, where, path, "one of " + ", ".join(repr(m.value) for m in tp)) from None
    if tp in _SCALARS:
        try:
            return _SCALARS[tp](value)
        except (TypeError, ValueError):
            raise _mismatch(value, where, path, _type_name(tp)) from None
    if origin in (list, tuple) or tp in (list, tuple):
        return _coerce_sequence(value, tp, where, path)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _mismatch(value, where, path, "a table")
        args = typing.get_args(tp)
        val_t = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, val_t, where, f"{path}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _mismatch(value, where, path, _type_name(tp))


def _coerce_union(value: Any, args: tuple[Any, ...], where: str, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return _coerce(value, arg, where, path)
        except UsageError as exc:
            errors.append(exc)
    raise errors[0] if len(errors) == 1 else _mismatch(value, where, path, " or ".join(_type_name(a) for a in args))


def _coerce_sequence(value: Any, tp: Any, where: str, path: str) -> list[Any] | tuple[Any, ...]:
    """A list, or a tuple of fixed (``tuple[int, str]``) or any length; a string is split at commas."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str):
        value = [v for v in (s.strip() for s in value.split(",")) if v]
    if not isinstance(value, (list, tuple)):
        raise _mismatch(value, where, path, "a list")
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(args) != len(value):
            raise _mismatch(value, where, path, f"a list of {len(args)} items")
        return tuple(_coerce(v, a, where, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    item = args[0] if args else Any
    items = [_coerce(v, item, where, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if (origin is tuple or tp is tuple) else items


# Scalars: the value as the type, converted from the string a command line gives; TypeError or ValueError
# when it is neither.
def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
        return value.lower() in ("true", "yes", "1", "on")
    raise TypeError


def _to_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        return int(value.replace("_", ""), 0)
    raise TypeError


def _to_float(value: Any) -> float:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return float(value)
    raise TypeError


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise TypeError


def _to_path(value: Any) -> Path:
    if isinstance(value, (str, Path)):
        return Path(value).expanduser()
    raise TypeError


_SCALARS: dict[Any, Callable[[Any], Any]] = {
    bool: _to_bool,
    int: _to_int,
    float: _to_float,
    str: _to_str,
    Path: _to_path,
}


def _type_name(tp: Any) -> str:
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path",
        type(None): "empty",
    }.get(tp, getattr(tp, "__name__", str(tp)))
