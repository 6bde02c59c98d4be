"""Chat templates render in flood as transformers renders them: the same environment (loop controls,
``{% generation %}``, ``raise_exception``, ``strftime_now``, ``tojson``, ``namespace``, ``dict``) and the same
variables (messages, tools, documents, add_generation_prompt, the named special tokens). Each case compares
flood's text with transformers' own ``apply_chat_template`` on the same tokenizer directory."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from lingctl.flood.weights.model_dir import ModelDir
from lingctl.model.chat_template import RenderError, TemplateLimits, TemplateRenderer
from lingctl.model.checkpoint import load_config
from tests.conftest import run_lingctl

transformers = pytest.importorskip("transformers")

LIMITS = TemplateLimits(timeout_s=5.0, grace_s=5.0)
# A template written the way real ones are (a default system prompt with today's date, tools as indented
# JSON, role checks, an assistant mask block), using every part of transformers' environment.
TEMPLATE = """\
{%- if messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set system = 'You are a helpful assistant. Today is ' ~ strftime_now('%Y') ~ '.' -%}
    {%- set rest = messages -%}
{%- endif -%}
{{ bos_token }}<|system|>{{ system }}
{%- if tools %}

Tools:
{{ tools | tojson(indent=2) }}
{%- endif %}
{%- if documents %}

{% for doc in documents %}[{{ loop.index }}] {{ doc | tojson }}
{% endfor %}
{%- endif %}
[{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ image_token }}|{{ sep_token is defined }}|\
{{ additional_special_tokens is defined }}]
{% set ns = namespace(turns=0) -%}
{%- for message in rest -%}
    {%- if message['role'] == 'stop' %}{% break %}{% endif -%}
    {%- if message['role'] == 'skip' %}{% continue %}{% endif -%}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] -%}
        {{ raise_exception('unsupported role: ' ~ message['role']) }}
    {%- endif -%}
    {%- set ns.turns = ns.turns + 1 -%}
    <|{{ message['role'] }}|>{{ dict(n=ns.turns, keys=message | list | sort) | tojson }}
    {%- if message['role'] == 'assistant' -%}
        {% generation %}{{ message['content'] }}{% if message.tool_calls is defined %}\
{{ message.tool_calls | tojson(ensure_ascii=true) }}{% endif %}{{ eos_token }}{% endgeneration %}
    {%- else -%}
        {{ message['content'] }}{% if message.name is defined %} ({{ message.name }}){% endif %}
    {%- endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}
"""
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": {
        "__type": "AddedToken",
        "content": "<|startoftext|>",
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    },
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "image_token": "<|image|>",  # a model-specific named token: templates get it too
    "additional_special_tokens": ["<|extra|>"],  # unnamed: templates do not
    "add_bos_token": False,
}
# Without added_tokens_decoder in the config, transformers reads this older file, and its entries win.
SPECIAL_TOKENS_MAP = {
    "unk_token": "<unk>",
    "pad_token": {"content": "<|pad|>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find <b>caf\u00e9s</b> & bars",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
DOCUMENTS = [{"title": "A & B", "text": "na\u00efve <i>text</i>"}]
HELLO = {"role": "user", "content": "Hello"}


def _tokenizer_dir(root: Path, text_ckpt: Path, config: dict[str, Any], special_tokens_map: dict[str, Any]) -> Path:
    # No config.json: transformers would go looking for the model's remote code.
    root.mkdir()
    shutil.copy(text_ckpt / "tokenizer.json", root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return root


@pytest.fixture(scope="module")
def tok_dir(text_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer_dir(tmp_path_factory.mktemp("hf") / "tok", text_ckpt, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)


@pytest.fixture(scope="module")
def hf_tokenizer(tok_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def special_tokens(tok_dir: Path, text_ckpt: Path) -> dict[str, str]:
    return ModelDir(path=tok_dir, config=load_config(text_ckpt)).special_tokens()


@pytest.fixture(scope="module")
def renderer() -> Iterator[TemplateRenderer]:
    with TemplateRenderer(TEMPLATE, LIMITS) as r:
        yield r


def _year_now() -> str:
    return str(datetime.now().year)


def _without_year(text: str, years: set[str]) -> str:
    """The text with the year the template read replaced, after checking it is the clock's year."""
    m = re.search(r"Today is (\d+)\.", text)
    assert m is not None and m.group(1) in years, text
    return text.replace(m.group(0), "Today is YEAR.")


def _both(
    renderer: TemplateRenderer,
    hf_tokenizer: Any,
    special_tokens: dict[str, str],
    messages: list[Any],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> tuple[str, str]:
    """Flood's text and transformers' for the same conversation; a year the template read from the clock is
    checked against the clock around both renders and then left out of the comparison."""
    years = {_year_now()}
    ours = renderer.render(
        messages, add_generation_prompt=add_generation_prompt, special_tokens=special_tokens, **extra
    )
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, chat_template=TEMPLATE, add_generation_prompt=add_generation_prompt, **extra
    )
    years.add(_year_now())
    if "Today is" in theirs:
        ours, theirs = _without_year(ours, years), _without_year(theirs, years)
    return ours, theirs


def test_special_tokens_are_the_ones_transformers_reads(hf_tokenizer: Any, special_tokens: dict[str, str]) -> None:
    assert (
        special_tokens
        == hf_tokenizer.special_tokens_map
        == {
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|pad|>",
            "unk_token": "<unk>",
            "image_token": "<|image|>",
        }
    )


@pytest.mark.parametrize(
    "config, special_tokens_map, expected",
    [
        # With added_tokens_decoder, transformers ignores special_tokens_map.json.
        (
            {"eos_token": "<|endoftext|>", "added_tokens_decoder": {}},
            {"eos_token": "<eos>", "bos_token": "<bos>"},
            {"eos_token": "<|endoftext|>"},
        ),
        # Named tokens in an extra_special_tokens object are named tokens (a list holds unnamed ones); a null in the
        # map unsets the config's token.
        (
            {
                "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>"},
                "sep_token": "<sep>",
                "extra_special_tokens": {"audio_token": "<a>"},
            },
            {"extra_special_tokens": ["<x>"], "mask_token": "<mask>", "sep_token": None},
            {"eos_token": "<|endoftext|>", "mask_token": "<mask>", "audio_token": "<a>"},
        ),
    ],
    ids=["decoder-ignores-map", "map-wins"],
)
def test_special_tokens_follow_transformers_precedence(
    text_ckpt: Path,
    tmp_path: Path,
    config: dict[str, Any],
    special_tokens_map: dict[str, Any],
    expected: dict[str, str],
) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    path = _tokenizer_dir(tmp_path / "tok", text_ckpt, config, special_tokens_map)
    ours = ModelDir(path=path, config=load_config(text_ckpt)).special_tokens()
    assert ours == transformers.AutoTokenizer.from_pretrained(path).special_tokens_map == expected


@pytest.mark.parametrize("first", ["system", "user"])
def test_a_first_system_message_replaces_the_dated_default(
    renderer: TemplateRenderer, hf_tokenizer: Any, special_tokens: dict[str, str], first: str
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, HELLO] if first == "system" else [HELLO]
    ours, theirs = _both(renderer, hf_tokenizer, special_tokens, messages)
    assert ours == theirs
    assert ("<|system|>Be brief." in ours) == (first == "system")
    assert ours.startswith("<|startoftext|><|system|>")
    assert "[<|endoftext|>|<|pad|>|<unk>|<|image|>|False|False]" in ours


def test_strftime_now_reads_the_clock_when_the_template_runs(
    renderer: TemplateRenderer, special_tokens: dict[str, str]
) -> None:
    before = _year_now()
    text = renderer.render([HELLO], special_tokens=special_tokens)
    after = _year_now()
    m = re.search(r"Today is (\d+)\.", text)
    assert m is not None and m.group(1) in {before, after}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_add_generation_prompt(
    renderer: TemplateRenderer, hf_tokenizer: Any, special_tokens: dict[str, str], add_generation_prompt: bool
) -> None:
    ours, theirs = _both(renderer, hf_tokenizer, special_tokens, [HELLO], add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|assistant|>") == add_generation_prompt


def test_loop_controls_namespace_dict_and_generation_blocks(
    renderer: TemplateRenderer, hf_tokenizer: Any, special_tokens: dict[str, str]
) -> None:
    messages = [
        {"role": "system", "content": "S"},
        HELLO,
        {"role": "skip", "content": "not shown"},
        {"role": "assistant", "content": "Hi!", "tool_calls": [{"name": "lookup", "arguments": {"q": "é"}}]},
        {"role": "user", "content": "again"},
        {"role": "stop", "content": ""},
        {"role": "user", "content": "after the break"},
    ]
    ours, theirs = _both(renderer, hf_tokenizer, special_tokens, messages)
    assert ours == theirs
    assert "not shown" not in ours and "after the break" not in ours
    assert '<|user|>{"n": 3, "keys": ["content", "role"]}again' in ours  # the namespace counted 3 turns
    assert '"q": "\\u00e9"' in ours and "Hi!" in ours  # tojson(ensure_ascii=true) inside {% generation %}


def test_tojson_keeps_html_and_non_ascii_and_indents(
    renderer: TemplateRenderer, hf_tokenizer: Any, special_tokens: dict[str, str]
) -> None:
    ours, theirs = _both(
        renderer,
        hf_tokenizer,
        special_tokens,
        [{"role": "system", "content": "S"}, HELLO],
        tools=TOOLS,
        documents=DOCUMENTS,
    )
    assert ours == theirs
    assert '\n  {\n    "type": "function",' in ours  # indent=2
    assert '"Find <b>caf\u00e9s</b> & bars"' in ours and '{"title": "A & B", "text": "na\u00efve <i>text</i>"}' in ours


def test_message_keys_that_are_none_are_dropped(
    renderer: TemplateRenderer, hf_tokenizer: Any, special_tokens: dict[str, str]
) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi", "name": None},
        {"role": "tool", "content": "42", "name": "calc"},
    ]
    ours, theirs = _both(renderer, hf_tokenizer, special_tokens, messages)
    assert ours == theirs
    assert "None" not in ours and "<|user|>" in ours and "42 (calc)" in ours


def test_raise_exception_fails_that_request_on_both_sides(
    renderer: TemplateRenderer, hf_tokenizer: Any, special_tokens: dict[str, str]
) -> None:
    from jinja2.exceptions import TemplateError

    bad = [{"role": "system", "content": "S"}, {"role": "robot", "content": "beep"}]
    with pytest.raises(TemplateError, match="unsupported role: robot"):
        hf_tokenizer.apply_chat_template(bad, tokenize=False, chat_template=TEMPLATE)
    with pytest.raises(RenderError, match="chat template failed: unsupported role: robot"):
        renderer.render(bad, special_tokens=special_tokens)
    ours, theirs = _both(renderer, hf_tokenizer, special_tokens, [{"role": "system", "content": "S"}, HELLO])
    assert ours == theirs  # the next request renders as usual


def test_flood_run_answers_chat_with_loop_controls_and_the_date(text_ckpt: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(text_ckpt, model)
    template = (
        "{{ 'Today is ' ~ strftime_now('%Y-%m-%d') ~ '.\n' }}"
        "{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    user = {"role": "user", "content": "the quick brown fox"}
    rows = [
        {
            "custom_id": "cut",
            "messages": [user, {"role": "stop", "content": "x"}, {"role": "user", "content": "the lazy dog " * 5}],
        },
        {"custom_id": "plain", "messages": [user]},
    ]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(r | {"max_tokens": 3, "temperature": 0}) + "\n" for r in rows))
    res = run_lingctl("flood", "run", str(batch), "--model", str(model), "--threads", "1", "--json")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "b.errors.jsonl").read_text().strip() == ""
    answers = {
        r["custom_id"]: r["response"]["body"]
        for r in map(json.loads, (tmp_path / "b.output.jsonl").read_text().splitlines())
    }
    assert sorted(answers) == ["cut", "plain"]
    # {% break %} dropped what followed the stop message, so both prompts are the same text.
    assert answers["cut"]["usage"]["prompt_tokens"] == answers["plain"]["usage"]["prompt_tokens"]
    assert answers["cut"]["choices"][0]["token_ids"] == answers["plain"]["choices"][0]["token_ids"]
