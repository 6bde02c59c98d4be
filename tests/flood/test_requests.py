from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.flood.batch.requests import (
    CHAT,
    COMPLETIONS,
    DUPLICATE_CUSTOM_ID,
    INVALID_JSON,
    INVALID_REQUEST,
    Request,
    RequestError,
    parse_line,
    read_batch,
)
from lingctl.flood.engine.sampling import SamplingParams


def _parse(obj: Any, line: int = 1) -> Request | RequestError:
    return parse_line(json.dumps(obj), line)


def _ok(obj: Any) -> Request:
    parsed = _parse(obj)
    assert isinstance(parsed, Request), parsed
    return parsed


def _batch_form(url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": "a", "method": "POST", "url": url, "body": body}


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "batch.jsonl"
    path.write_bytes(data)
    return path


# --- the two forms ---------------------------------------------------------------------------------------


def test_batch_form_completion() -> None:
    req = _ok(
        _batch_form(
            COMPLETIONS,
            model="ling-mini",
            prompt="Once upon",
            max_tokens=5,
            temperature=0,
            top_p=0.9,
            top_k=40,
            seed=7,
            stop=["\n\n", "END"],
        )
    )
    assert req.custom_id == "a" and req.url == COMPLETIONS and not req.is_chat
    assert req.prompt_text == "Once upon" and req.prompt_ids is None and req.messages is None
    assert req.model == "ling-mini"
    assert req.sampling == SamplingParams(
        max_tokens=5, temperature=0.0, top_p=0.9, top_k=40, seed=7, stop=["\n\n", "END"]
    )
    assert isinstance(req.sampling.temperature, float)


def test_batch_form_chat() -> None:
    req = _ok(
        _batch_form(
            CHAT, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], max_tokens=3
        )
    )
    assert req.is_chat and req.url == CHAT
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert req.prompt_text is None and req.prompt_ids is None
    assert req.sampling.max_tokens == 3


def test_plain_form_prompt_is_completion() -> None:
    req = _ok({"custom_id": "a", "prompt": "hi", "max_tokens": 5, "temperature": 0.5})
    assert req.url == COMPLETIONS and req.prompt_text == "hi"
    assert req.sampling.max_tokens == 5 and req.sampling.temperature == 0.5


def test_plain_form_messages_is_chat() -> None:
    req = _ok({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]})
    assert req.url == CHAT and req.is_chat


def test_token_id_prompt() -> None:
    req = _ok(_batch_form(COMPLETIONS, prompt=[1, 0, 50256]))
    assert req.prompt_ids == [1, 0, 50256] and req.prompt_text is None


def test_text_parts_are_joined() -> None:
    content = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    req = _ok(_batch_form(CHAT, messages=[{"role": "user", "content": content, "name": "ann"}]))
    assert req.messages == [{"role": "user", "content": "first\nsecond"}]


def test_defaults_follow_openai() -> None:
    completion = _ok({"custom_id": "a", "prompt": "hi"}).sampling
    assert completion == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=[])
    chat = _ok({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]}).sampling
    assert chat.max_tokens is None and chat.temperature == 1.0 and chat.top_p == 1.0


def test_null_fields_mean_the_default() -> None:
    req = _ok(
        _batch_form(
            COMPLETIONS,
            prompt="hi",
            max_tokens=None,
            temperature=None,
            top_p=None,
            top_k=None,
            seed=None,
            stop=None,
            n=None,
            model=None,
        )
    )
    assert req.sampling == SamplingParams()


def test_max_completion_tokens_wins_for_chat() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert _ok(_batch_form(CHAT, messages=messages, max_completion_tokens=9)).sampling.max_tokens == 9
    assert _ok(_batch_form(CHAT, messages=messages, max_completion_tokens=9, max_tokens=4)).sampling.max_tokens == 9


@pytest.mark.parametrize(("top_k", "stored"), [(-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_off_is_zero(top_k: int, stored: int) -> None:
    assert _ok(_batch_form(COMPLETIONS, prompt="x", top_k=top_k)).sampling.top_k == stored


def test_single_stop_string_becomes_a_list() -> None:
    assert _ok(_batch_form(COMPLETIONS, prompt="x", stop="###")).sampling.stop == ["###"]


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1},
        {"best_of": 1},
        {"stream": False},
        {"logprobs": None},
        {"logprobs": False},
        {"echo": False},
        {"response_format": {"type": "text"}},
        {"tools": []},
        {"presence_penalty": 0},
        {"suffix": None},
        {"user": "ann", "a_future_field": {"x": 1}, "stream_options": None},
    ],
)
def test_harmless_values_and_unknown_fields_are_accepted(fields: dict[str, Any]) -> None:
    _ok(_batch_form(COMPLETIONS, prompt="x", **fields))


def test_a_list_of_prompts_is_several_prompts() -> None:
    req = _ok(_batch_form(COMPLETIONS, prompt=["a", "b", "c"]))
    assert req.prompt_text == "a" and req.more_prompts == [("b", None), ("c", None)]
    ids = _ok(_batch_form(COMPLETIONS, prompt=[[1, 2], [3]]))
    assert ids.prompt_ids == [1, 2] and ids.more_prompts == [(None, [3])]
    assert _ok(_batch_form(COMPLETIONS, prompt=[1, 2])).more_prompts == []  # one prompt of token ids


def test_logprobs_in_openais_two_forms() -> None:
    assert _ok(_batch_form(COMPLETIONS, prompt="x", logprobs=3)).sampling.logprobs == 3
    assert _ok(_batch_form(COMPLETIONS, prompt="x", logprobs=0)).sampling.logprobs == 0  # the token's own only
    assert _ok(_batch_form(COMPLETIONS, prompt="x")).sampling.logprobs is None
    assert _ok(_batch_form(CHAT, messages=_MSG, logprobs=True, top_logprobs=5)).sampling.logprobs == 5
    assert _ok(_batch_form(CHAT, messages=_MSG, logprobs=True)).sampling.logprobs == 0
    assert _ok(_batch_form(CHAT, messages=_MSG, logprobs=False)).sampling.logprobs is None


def test_vllms_sampling_fields_are_read_and_null_means_the_default() -> None:
    fields = dict(
        min_p=0.05, min_tokens=3, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=2
    )
    s = _ok(_batch_form(COMPLETIONS, prompt="x", max_tokens=8, **fields)).sampling
    assert (s.min_p, s.min_tokens, s.ignore_eos) == (0.05, 3, True)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.3, -0.5, 2.0)
    d = _ok(_batch_form(CHAT, messages=[{"role": "user", "content": "hi"}], **{k: None for k in fields})).sampling
    assert (d.min_p, d.min_tokens, d.ignore_eos, d.repetition_penalty, d.frequency_penalty, d.presence_penalty) == (
        0.0,
        0,
        False,
        1.0,
        0.0,
        0.0,
    )
    assert not d.penalised and s.penalised


# --- rejections -------------------------------------------------------------------------------------------

_MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("request_obj", "expected"),
    [
        (
            {"custom_id": "a", "method": "GET", "url": COMPLETIONS, "body": {"prompt": "x"}},
            'method must be POST, got "GET"',
        ),
        ({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}, "url must be"),
        ({"custom_id": "a", "body": {"prompt": "x"}}, "url must be /v1/completions or /v1/chat/completions, got null"),
        ({"custom_id": "a", "url": COMPLETIONS}, "body must be a JSON object, got null"),
        ({"custom_id": "a", "url": COMPLETIONS, "body": ["x"]}, "body must be a JSON object"),
        (_batch_form(COMPLETIONS, messages=_MSG), "request needs prompt"),
        (_batch_form(CHAT, prompt="x"), "request needs messages"),
        ({"custom_id": "a", "prompt": "x", "messages": _MSG}, "not both"),
        ({"custom_id": "a", "max_tokens": 3}, "no prompt"),
        (_batch_form(COMPLETIONS, prompt="x", n=0), "n must be an integer from 1 to 128, got 0"),
        (_batch_form(COMPLETIONS, prompt="x", n=True), "n must be an integer from 1 to 128, got true"),
        (_batch_form(COMPLETIONS, prompt="x", best_of=3), "best_of=3"),
        (_batch_form(COMPLETIONS, prompt="x", stream=True), "stream=true"),
        (_batch_form(COMPLETIONS, prompt="x", logprobs=21), "logprobs must be an integer from 0 to 20, got 21"),
        (_batch_form(COMPLETIONS, prompt="x", logprobs=True), "logprobs must be an integer from 0 to 20, got true"),
        (_batch_form(COMPLETIONS, prompt="x", top_logprobs=2), "top_logprobs is for chat requests"),
        (_batch_form(CHAT, messages=_MSG, logprobs=3), "logprobs must be true or false for a chat request, got 3"),
        (_batch_form(CHAT, messages=_MSG, top_logprobs=3), "top_logprobs needs logprobs: true"),
        (_batch_form(CHAT, messages=_MSG, logprobs=True, top_logprobs=30), "top_logprobs must be an integer"),
        (_batch_form(COMPLETIONS, prompt="x", echo=True), "echo=true"),
        (_batch_form(COMPLETIONS, prompt="x", suffix="end"), 'suffix="end"'),
        (_batch_form(CHAT, messages=_MSG, tools=[{"type": "function"}]), "tools="),
        (_batch_form(CHAT, messages=_MSG, functions=[{"name": "f"}]), "functions="),
        (_batch_form(CHAT, messages=_MSG, response_format={"type": "json_object"}), "response_format="),
        (_batch_form(COMPLETIONS, prompt="x", logit_bias={"1": 5}), "logit_bias="),
        (_batch_form(COMPLETIONS, prompt="x", presence_penalty=2.5), "presence_penalty must be a number from -2 to 2"),
        (_batch_form(COMPLETIONS, prompt="x", frequency_penalty="1"), "frequency_penalty must be a number"),
        (_batch_form(COMPLETIONS, prompt="x", repetition_penalty=0), "repetition_penalty must be above 0"),
        (_batch_form(COMPLETIONS, prompt="x", min_p=1.5), "min_p must be a number from 0 to 1, got 1.5"),
        (_batch_form(COMPLETIONS, prompt="x", min_tokens=-1), "min_tokens must be an integer >= 0, got -1"),
        (_batch_form(COMPLETIONS, prompt="x", max_tokens=4, min_tokens=5), "min_tokens=5 must not exceed max_tokens=4"),
        (_batch_form(COMPLETIONS, prompt="x", ignore_eos="yes"), 'ignore_eos must be true or false, got "yes"'),
        (
            _batch_form(COMPLETIONS, prompt="x", stop_token_ids=[2]),
            "stop_token_ids=[2]: stop_token_ids is not supported",
        ),
        (_batch_form(COMPLETIONS, prompt="x", prompt_logprobs=1), "prompt_logprobs=1"),
        (_batch_form(COMPLETIONS, prompt="x", use_beam_search=True), "use_beam_search=true"),
        (_batch_form(COMPLETIONS, prompt="x", guided_json={"type": "object"}), "guided decoding is not supported"),
        (_batch_form(COMPLETIONS, prompt="x", model=3), "model must be a string, got 3"),
        (_batch_form(COMPLETIONS, prompt="x", max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (_batch_form(COMPLETIONS, prompt="x", max_tokens=2.5), "max_tokens must be an integer >= 1, got 2.5"),
        (_batch_form(COMPLETIONS, prompt="x", max_tokens=True), "max_tokens must be an integer >= 1, got true"),
        (_batch_form(CHAT, messages=_MSG, max_completion_tokens=-1), "max_completion_tokens must be an integer"),
        (
            _batch_form(COMPLETIONS, prompt="x", temperature=2.5),
            "temperature must be 0 (greedy) or a number from 0.0001 to 2, got 2.5",
        ),
        (_batch_form(COMPLETIONS, prompt="x", temperature=-0.1), "temperature must be"),
        (
            _batch_form(COMPLETIONS, prompt="x", temperature="hot"),
            'temperature must be 0 (greedy) or a number from 0.0001 to 2, got "hot"',
        ),
        # Values the sampler cannot compute with: logits / 5e-324 is inf, a top_p under float32's range is 0.
        (
            _batch_form(COMPLETIONS, prompt="x", temperature=5e-324),
            "temperature must be 0 (greedy) or a number from 0.0001 to 2, got 5e-324",
        ),
        (_batch_form(COMPLETIONS, prompt="x", temperature=1e-5), "temperature must be"),
        (_batch_form(COMPLETIONS, prompt="x", top_p=0), "top_p must be a number from 1e-06 to 1, got 0"),
        (_batch_form(COMPLETIONS, prompt="x", top_p=1e-100), "top_p must be a number from 1e-06 to 1, got 1e-100"),
        (_batch_form(COMPLETIONS, prompt="x", top_p=5e-324), "top_p must be"),
        (_batch_form(COMPLETIONS, prompt="x", top_p=1.5), "top_p must be"),
        # A lone surrogate (JSON's "\ud800") has no UTF-8 form: wherever it is used, the request is refused.
        (
            _batch_form(COMPLETIONS, prompt="a\ud800b"),
            "prompt is not valid Unicode: a lone surrogate \\ud800 at character 1",
        ),
        (_batch_form(CHAT, messages=[{"role": "user", "content": "\udfff"}]), "messages[0].content is not valid"),
        (_batch_form(CHAT, messages=[{"role": "us\ud800er", "content": "x"}]), "messages[0].role is not valid"),
        (
            _batch_form(
                CHAT,
                messages=[
                    {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud800"}]}
                ],
            ),
            "messages[0].content[1].text is not valid Unicode",
        ),
        (_batch_form(COMPLETIONS, prompt="x", stop=["ok", "\udc00"]), "stop[1] is not valid Unicode"),
        (_batch_form(COMPLETIONS, prompt="x", stop="\udc00"), "stop is not valid Unicode"),
        (_batch_form(COMPLETIONS, prompt="x", model="m\ud800"), "model is not valid Unicode"),
        (_batch_form(COMPLETIONS, prompt="x", top_k=-2), "top_k must be an integer >= 1, or -1 or 0 for off, got -2"),
        (_batch_form(COMPLETIONS, prompt="x", top_k=2.5), "top_k must be"),
        (_batch_form(COMPLETIONS, prompt="x", seed="7"), 'seed must be a 64-bit integer, got "7"'),
        (_batch_form(COMPLETIONS, prompt="x", seed=1 << 64), "seed must be a 64-bit integer"),
        (_batch_form(COMPLETIONS, prompt="x", stop=["a", "b", "c", "d", "e"]), "up to 4"),
        (_batch_form(COMPLETIONS, prompt="x", stop=""), "stop must be a non-empty string"),
        (_batch_form(COMPLETIONS, prompt="x", stop=["a", ""]), 'got ["a", ""]'),
        (_batch_form(COMPLETIONS, prompt="x", stop=3), "stop must be"),
        (_batch_form(COMPLETIONS, prompt=["a", 5]), "prompt must be a string, an array of token ids, or a list"),
        (_batch_form(COMPLETIONS, prompt=[[1, 2], []]), "prompt[1] must not be empty"),
        (_batch_form(COMPLETIONS, prompt=["a", [1, -2]]), "prompt[1][1] must be a token id"),
        (
            _batch_form(COMPLETIONS, prompt=3),
            "prompt must be a string, an array of token ids, or a list of them, got 3",
        ),
        (_batch_form(COMPLETIONS, prompt=[5, -1]), "prompt[1] must be a token id (an integer >= 0), got -1"),
        (_batch_form(COMPLETIONS, prompt=[5, 1.5]), "prompt[1] must be a token id"),
        (_batch_form(COMPLETIONS, prompt=""), "prompt must not be empty"),
        (_batch_form(COMPLETIONS, prompt=[]), "prompt must not be empty"),
        (_batch_form(CHAT, messages=[]), "messages must be a non-empty array, got []"),
        (_batch_form(CHAT, messages="hi"), 'messages must be a non-empty array, got "hi"'),
        (_batch_form(CHAT, messages=["hi"]), 'messages[0] must be an object, got "hi"'),
        (_batch_form(CHAT, messages=[{"content": "hi"}]), "messages[0].role must be a non-empty string, got null"),
        (_batch_form(CHAT, messages=[*_MSG, {"role": "user"}]), "messages[1].content must be a string or an array"),
        (
            _batch_form(
                CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
            ),
            "messages[0].content[0] must be a text part",
        ),
        (
            _batch_form(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            "messages[0].content[0].text must be a string, got 5",
        ),
    ],
)
def test_rejections_name_the_field_and_value(request_obj: dict[str, Any], expected: str) -> None:
    err = _parse(request_obj, line=7)
    assert isinstance(err, RequestError), err
    assert (err.line, err.custom_id, err.code) == (7, "a", INVALID_REQUEST)
    assert expected in err.message
    assert "\n" not in err.message


@pytest.mark.parametrize(("temperature", "top_p"), [(0, 1e-6), (1e-4, 1), (2, 0.5), (-0.0, 1)])
def test_smallest_sampling_values_are_accepted(temperature: float, top_p: float) -> None:
    req = _ok(_batch_form(COMPLETIONS, prompt="x", temperature=temperature, top_p=top_p))
    assert (req.sampling.temperature, req.sampling.top_p) == (temperature, top_p)


def test_paired_surrogates_are_one_character_and_accepted() -> None:
    req = _ok(_batch_form(COMPLETIONS, prompt="\ud83d\ude00", stop="\ud83d\ude00"))
    assert req.prompt_text == "\U0001f600" and req.sampling.stop == ["\U0001f600"]


def test_a_custom_id_with_a_lone_surrogate_is_refused_without_echoing_it() -> None:
    err = parse_line('{"custom_id": "a\\ud800", "prompt": "x"}', 3)
    assert isinstance(err, RequestError)
    assert (err.line, err.custom_id, err.code) == (3, None, INVALID_REQUEST)
    assert err.message == "custom_id is not valid Unicode: a lone surrogate \\ud800 at character 1"
    err.message.encode("utf-8")  # the message itself is valid text


def test_refused_values_are_shown_as_valid_text() -> None:
    err = _parse(_batch_form(COMPLETIONS, prompt=["\ud800"]))
    assert isinstance(err, RequestError)
    assert "\\ud800" in err.message
    err.message.encode("utf-8")


def test_long_values_are_cut_short() -> None:
    err = _parse(_batch_form(COMPLETIONS, prompt=["word " * 200, 7]))
    assert isinstance(err, RequestError)
    assert "…" in err.message and len(err.message) < 150


@pytest.mark.parametrize(
    ("line", "code", "expected"),
    [
        ('{"custom_id": "a", "prompt": ', INVALID_JSON, "not valid JSON"),
        ('{"custom_id": "a", "prompt": "x", "temperature": NaN}', INVALID_JSON, "NaN is not a JSON number"),
        ("[" * 100_000, INVALID_JSON, "nested too deeply"),
        ('["a", "b"]', INVALID_REQUEST, 'a request must be a JSON object, got ["a", "b"]'),
        ('"just a string"', INVALID_REQUEST, "a request must be a JSON object"),
        ('{"prompt": "x"}', INVALID_REQUEST, "custom_id is missing"),
        ('{"custom_id": 5, "prompt": "x"}', INVALID_REQUEST, "custom_id must be a non-empty string, got 5"),
        ('{"custom_id": "", "prompt": "x"}', INVALID_REQUEST, 'custom_id must be a non-empty string, got ""'),
    ],
)
def test_lines_without_a_usable_custom_id(line: str, code: str, expected: str) -> None:
    err = parse_line(line, 3)
    assert isinstance(err, RequestError)
    assert (err.line, err.custom_id, err.code) == (3, None, code)
    assert expected in err.message


# --- the whole file ---------------------------------------------------------------------------------------


def test_read_batch_line_numbers_blank_lines_and_bad_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"custom_id": "r1", "prompt": "one"}).encode(),  # 1
        b"",  # 2 blank
        b"   \t",  # 3 whitespace only
        b'{"custom_id": "r2", "prompt": ',  # 4 invalid JSON
        b'{"custom_id": "r3", "prompt": "caf\xe9"}',  # 5 Latin-1, not UTF-8
        json.dumps({"custom_id": "r1", "prompt": "again"}).encode(),  # 6 duplicate
        json.dumps(_batch_form(CHAT, messages=_MSG) | {"custom_id": "r4"}).encode(),  # 7
        json.dumps({"custom_id": "r5", "prompt": "x", "n": 300}).encode(),  # 8 rejected
        json.dumps({"custom_id": "r1", "prompt": "third"}).encode(),  # 9 duplicate
        '{"custom_id": "r6", "prompt": "\u2028 and ü"}'.encode(),  # 10, no final newline
    ]
    batch = read_batch(_write(tmp_path, b"\n".join(lines)))
    assert batch.lines == 8
    assert [(r.line, r.custom_id) for r in batch.requests] == [(1, "r1"), (7, "r4"), (10, "r6")]
    assert batch.requests[0].prompt_text == "one"  # the first r1 runs
    assert batch.requests[2].prompt_text == "\u2028 and ü"
    assert [(e.line, e.custom_id, e.code) for e in batch.errors] == [
        (4, None, INVALID_JSON),
        (5, None, INVALID_JSON),
        (6, "r1", DUPLICATE_CUSTOM_ID),
        (8, "r5", INVALID_REQUEST),
        (9, "r1", DUPLICATE_CUSTOM_ID),
    ]
    assert "not UTF-8 (byte 0xe9" in batch.errors[1].message
    assert '"r1"' in batch.errors[2].message


def test_lone_surrogates_fail_only_their_own_lines_in_one_line_of_valid_text(tmp_path: Path) -> None:
    """JSON's "\\ud800" escapes, written by json.dumps: a field that is used fails its request alone; one that is
    ignored (``user``, a message's ``name``) costs nothing; a value shown in a message is shown escaped."""
    lines = [
        {"custom_id": "ok", "prompt": "x"},
        {"custom_id": "prompt", "prompt": "a\ud800"},
        {"custom_id": "ignored", "prompt": "x", "user": "\udc00", "\ud800": 1},
        {"custom_id": "name", "messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
        {"custom_id": "shown", "prompt": "x", "n": "\ud800"},
        {"custom_id": "\ud800", "prompt": "x"},
    ]
    batch = read_batch(_write(tmp_path, "".join(json.dumps(x) + "\n" for x in lines).encode()))
    assert [r.custom_id for r in batch.requests] == ["ok", "ignored", "name"]
    assert [(e.line, e.custom_id) for e in batch.errors] == [(2, "prompt"), (5, "shown"), (6, None)]
    for error in batch.errors:
        assert "\n" not in error.message and error.message.encode("utf-8")
    assert batch.errors[1].message == 'n must be an integer from 1 to 128, got "\\ud800"'


def test_a_rejected_line_still_claims_its_custom_id(tmp_path: Path) -> None:
    # Otherwise the output would hold an error and an answer for the same custom_id.
    lines = [{"custom_id": "a", "prompt": "x", "n": 0}, {"custom_id": "a", "prompt": "x"}]
    batch = read_batch(_write(tmp_path, "\n".join(json.dumps(x) for x in lines).encode() + b"\n"))
    assert batch.requests == []
    assert [(e.line, e.code) for e in batch.errors] == [(1, INVALID_REQUEST), (2, DUPLICATE_CUSTOM_ID)]


def test_crlf_and_byte_order_mark(tmp_path: Path) -> None:
    data = b"\xef\xbb\xbf" + b'{"custom_id": "a", "prompt": "x"}\r\n{"custom_id": "b", "prompt": "y"}\r\n\r\n'
    batch = read_batch(_write(tmp_path, data))
    assert [r.custom_id for r in batch.requests] == ["a", "b"] and batch.errors == [] and batch.lines == 2


def test_empty_file(tmp_path: Path) -> None:
    batch = read_batch(_write(tmp_path, b""))
    assert (batch.requests, batch.errors, batch.lines) == ([], [], 0)


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no such file"):
        read_batch(tmp_path / "nope.jsonl")


def test_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LingctlError):
        read_batch(tmp_path)
