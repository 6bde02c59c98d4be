"""What a chat template sees: the Jinja environment and the variables that transformers' ``apply_chat_template``
gives it, so that a template that renders there renders the same text here.

The environment is Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, and:

- the loop-controls extension (``{% break %}``, ``{% continue %}``) and a ``{% generation %}...{% endgeneration %}``
  block, which marks an assistant's part for training masks in transformers and here renders its body;
- globals ``raise_exception(message)`` (fails the render with that message), ``strftime_now(format)`` (local time,
  read when the template runs), ``dict`` (builds dicts and ``dict.fromkeys``, nothing else of the type) and
  ``namespace`` (Jinja's, refusing attribute names that start with an underscore);
- a ``tojson`` filter that is ``json.dumps`` (non-ASCII kept, ``indent``, ``separators``, ``sort_keys``) where
  Jinja's own escapes ``<``, ``>``, ``&`` and ``'`` for HTML.

The variables are ``messages`` (keys whose value is null dropped, reasoning aliased as transformers does),
``tools``, ``documents``, ``add_generation_prompt`` and the tokenizer's named special tokens (``bos_token``,
``eos_token``, ... as strings; see ``ModelDir.special_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Names a message's reasoning comes under; transformers fills the first and "thinking" from whichever is set.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: the body, rendered as a call block (its own scope), as
    transformers renders it when it is not collecting assistant masks."""

    tags = {"generation"}  # as Jinja declares it: a set on the class

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Macro) -> str:
        return str(caller())


def raise_exception(message: str) -> None:
    """What templates call to refuse an input: the render fails with ``message``."""
    raise TemplateError(message)


def strftime_now(format: str) -> str:
    """The local time now, formatted; templates use it to put today's date in a system prompt."""
    return datetime.now().strftime(format)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``json.dumps``: templates write tool schemas and arguments with it, which HTML escaping would alter."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class DictBuilder:
    """``dict`` for templates: calling it and ``fromkeys`` build dicts, while the type itself (whose attributes
    lead to every class in the interpreter) stays out of reach."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Iterable[Any], value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template cannot set the underscore-prefixed attribute {name!r} on a namespace")


class SafeNamespace(Namespace):
    """Jinja's ``namespace``, refusing attribute names that start with an underscore: ``{% set ns._x = ... %}``
    would otherwise reach the object's own (name-mangled) state."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self, as Jinja's: namespace(self=1) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        super().__setitem__(name, value)


def chat_environment(
    cls: type[ImmutableSandboxedEnvironment] = ImmutableSandboxedEnvironment, **options: Any
) -> ImmutableSandboxedEnvironment:
    """An environment of class ``cls`` (a subclass may add checks) with transformers' options, extensions,
    globals and filters; ``options`` are passed on to it."""
    env = cls(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlock], **options)
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=DictBuilder(), namespace=SafeNamespace
    )
    env.filters["tojson"] = tojson
    return env


def template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers passes them: keys whose value is None dropped (templates test whether a key
    is there, and would print "None"), and a message's reasoning under both ``reasoning_content`` and
    ``thinking`` when any of its names is set."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}  # the key order transformers gives
        out.append(m)
    return out
