"""Fine-tuning lines to token ids and loss masks: what is trained on, and the one-line errors for bad lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from lingctl.core.errors import LingctlError
from lingctl.model.tokenizer import load_tokenizer
from lingctl.train.post.examples import ChatText, read_examples, read_lines
from tests.train.post.conftest import write_lines

CONVERSATION = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "the quick fox"},
    {"role": "assistant", "content": "a lazy dog"},
    {"role": "user", "content": "seven birds"},
    {"role": "assistant", "content": "sing in trees"},
]


@pytest.fixture(scope="module")
def text(chat_ckpt: Path):
    tok = load_tokenizer(chat_ckpt / "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None
    t = ChatText(tok, chat_ckpt, eos)
    yield t
    t.close()


def trained_text(text: ChatText, ids: list[int], mask: list[bool]) -> list[str]:
    """The trained tokens, decoded run by run."""
    runs: list[list[int]] = []
    for i, (tid, m) in enumerate(zip(ids, mask)):
        if m:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(tid)
    return [text.tok.decode(r, skip_special_tokens=False) for r in runs]


def test_only_assistant_turns_are_trained_in_a_multi_turn_conversation(tmp_path: Path, text: ChatText) -> None:
    f = write_lines(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    [ex] = read_lines([f], text, kind="sft")
    # Ling's template ends only the last assistant turn, with the end-of-text token: that turn learns to stop.
    assert trained_text(text, ex.ids, ex.loss_mask) == ["a lazy dog", "sing in trees<|endoftext|>"]
    # The ids are the prompt exactly as inference tokenizes it, then the answer.
    prompt = text.render(CONVERSATION[:2], generation_prompt=True)
    assert ex.ids[: len(text.encode(prompt))] == text.encode(prompt)

    [last] = read_lines([f], text, kind="sft", loss_on="last")
    assert trained_text(text, last.ids, last.loss_mask) == ["sing in trees<|endoftext|>"]
    [every] = read_lines([f], text, kind="sft", loss_on="all")
    assert every.loss_mask == [False] + [True] * (len(every.ids) - 1)


def test_a_prompt_and_completion_train_the_completion_and_its_end(tmp_path: Path, text: ChatText) -> None:
    f = write_lines(tmp_path / "pc.jsonl", [{"prompt": "the quick fox", "completion": " jumps over"}])
    [ex] = read_lines([f], text, kind="sft")
    assert trained_text(text, ex.ids, ex.loss_mask) == [" jumps over<|endoftext|>"]


def test_a_pair_shares_its_prompt_tokens_and_masks_leave_spans_out(tmp_path: Path, text: ChatText) -> None:
    messages = [{"role": "user", "content": "the quick fox"}]
    line = {
        "messages": messages,
        "chosen": "yes a lazy dog",
        "rejected": "no seven birds",
        "rejected_mask": [[3, 14]],  # " seven birds": kept out of the loss
    }
    f = write_lines(tmp_path / "pairs.jsonl", [line])
    [pair] = read_lines([f], text, kind="dpo")
    prompt = text.encode(text.render(messages, generation_prompt=True))
    n = len(prompt)
    assert pair.chosen.ids[:n] == pair.rejected.ids[:n] == prompt
    assert not any(pair.chosen.loss_mask[:n]) and not any(pair.rejected.loss_mask[:n])
    assert trained_text(text, pair.chosen.ids, pair.chosen.loss_mask) == ["yes a lazy dog<|endoftext|>"]
    assert trained_text(text, pair.rejected.ids, pair.rejected.loss_mask) == ["no", "<|endoftext|>"]


BAD = [
    ("{not json", "malformed JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "plain"}', "expected 'messages', or 'prompt' and 'completion'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role must be one of"),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content must be a string"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant message to train on"),
    ('{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}', "both be strings or both"),
]


@pytest.mark.parametrize(("line", "message"), BAD)
def test_a_bad_sft_line_is_one_error_naming_file_and_line(tmp_path: Path, text: ChatText, line, message) -> None:
    good = '{"prompt": "a", "completion": "b"}'
    f = tmp_path / "data.jsonl"
    f.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(LingctlError) as err:
        read_lines([f], text, kind="sft")
    assert str(err.value).startswith(f"{f}:3: ") and message in str(err.value)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
        ({"prompt": "a", "chosen": "b", "rejected": "c", "chosen_mask": [[0, 9]]}, "chosen_mask[0] must be"),
        ({"prompt": "a", "messages": [], "chosen": "b", "rejected": "c"}, "not both"),
        ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}, "must be a string"),
    ],
)
def test_a_bad_pair_is_one_error_naming_file_and_line(tmp_path: Path, chat_ckpt: Path, record, message) -> None:
    f = write_lines(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, record])
    with pytest.raises(LingctlError) as err:
        read_examples(f, chat_ckpt, kind="dpo")
    assert str(err.value).startswith(f"{f}:2: ") and message in str(err.value)
