"""The engine settings a command takes (``flood run``, ``flood eval``), each declared once.

A setting is a field of ``EngineOptions`` whose metadata holds its ``Setting``: the flag, the help and the
values it takes. The commands build their shared options from these (``lingctl.commands.flood``), and
``validate`` checks a value by the same rule however it was given (flag or Python), so a default, a help
text or a range is written in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lingctl.core.errors import UsageError

SETTING = "lingctl.setting"  # the metadata key of a field's Setting
PROMPT_CHUNK = 16  # prompt chunk / prefix block, in tokens


@dataclass(frozen=True, slots=True)
class Setting:
    """How one option is written on the command line and which values it takes."""

    flag: str  # "--name", or "--name/--no-name" for a switch
    help: str
    metavar: str | None = None
    minimum: int | str | None = None  # the smallest value taken; a str names the field that holds it
    minimum_note: str = ""  # why, in the refusal
    choices: tuple[str, ...] = ()  # the only values taken (besides None, where None is the default)

    @property
    def name(self) -> str:
        return self.flag.split("/")[0]

    def check(self, value: Any, options: Any) -> None:
        """UsageError, naming the flag and the value, when ``value`` breaks this setting's rule."""
        if value is None:
            return
        if self.choices and value not in self.choices:
            raise UsageError(f"{self.name} must be {' or '.join(self.choices)}, got {value!r}")
        if self.minimum is None:
            return
        floor = getattr(options, self.minimum) if isinstance(self.minimum, str) else self.minimum
        if value < floor:
            raise UsageError(f"{self.name} must be >= {floor}{self.minimum_note}, got {value}")


def setting(default: Any, **rule: Any) -> Any:
    """A dataclass field with its ``Setting`` (keyword arguments: ``Setting``'s fields)."""
    return field(default=default, metadata={SETTING: Setting(**rule)})


def settings(cls: type) -> list[tuple[dataclasses.Field[Any], Setting]]:
    """The fields of the dataclass ``cls`` that are command-line settings, in declaration order."""
    return [(f, f.metadata[SETTING]) for f in dataclasses.fields(cls) if SETTING in f.metadata]


def check_settings(options: Any) -> None:
    """Every setting of a dataclass instance against its rule."""
    for f, rule in settings(type(options)):
        rule.check(getattr(options, f.name), options)


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    max_batch_tokens: int = setting(
        1024,
        flag="--max-batch-tokens",
        metavar="N",
        help="Tokens per engine step (outputs do not depend on it).",
        minimum="chunk",
        minimum_note=" (the prompt chunk)",
    )
    max_seqs: int = setting(256, flag="--max-seqs", metavar="N", help="Requests running at once.", minimum=1)
    kv_cache_tokens: int | None = setting(
        None,
        flag="--kv-cache-tokens",
        metavar="N",
        help="KV cache size in tokens (default: what the work needs, within 90% of free memory).",
        minimum=1,
    )
    dtype: str = setting(
        "float32", flag="--dtype", help="Weights and compute: float32 or bfloat16.", choices=("float32", "bfloat16")
    )
    quantize: str | None = setting(
        None,
        flag="--quantize",
        help="int8: weight-only int8 linear layers; w8a8: the same int8 weights, and with float32 activations each"
        " token's activations quantized to int8 as well for integer products (faster, less exact) (default: none, weights in --dtype).",
        choices=("int8", "w8a8"),
    )
    threads: int | None = setting(
        None,
        flag="--threads",
        metavar="N",
        help="CPU compute threads. Default (or 0): the cores other processes leave free, re-measured every few "
        "seconds; one thread where results would depend on the count (float32 without a C "
        "compiler for flood's kernels).",
        minimum=0,
        minimum_note=" (0: chosen from the free cores)",
    )
    prefix_sharing: bool = setting(
        True,
        flag="--prefix-sharing/--no-prefix-sharing",
        help="Compute prompt prefixes shared by several requests once (for eval: an item's context across its "
        "choices, and few-shot examples).",
    )
    # Not a flag: it fixes the numerics, so an output's manifest records it.
    chunk: int = PROMPT_CHUNK

    def validate(self) -> None:
        check_settings(self)
