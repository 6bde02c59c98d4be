"""flood eval in this process: task files, scores against a plain forward pass, batch invariance, few-shot
prefixes, generation answers, and the output's reuse and resume."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from lingctl.core.errors import Interrupted, UsageError
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.eval.run import EvalOptions, EvalSummary, run_eval
from lingctl.flood.eval.task_files import read_tasks
from lingctl.flood.eval.tasks import extract_answer
from lingctl.model.checkpoint import load_checkpoint
from lingctl.model.tokenizer import load_tokenizer

WORDS = "the quick brown fox jumps over lazy dog line of a tiny corpus".split()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mc_rows(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for i in range(n):
        ctx = " ".join(r.choice(WORDS) for _ in range(r.randint(20, 40)))
        choices = [" " + " ".join(r.choice(WORDS) for _ in range(r.randint(1, 5))) for _ in range(4)]
        rows.append({"id": f"q{i}", "context": ctx, "choices": choices, "answer": r.randrange(4)})
    return rows


def gen_rows(n: int) -> list[dict]:
    return [
        {"id": f"g{i}", "prompt": f"line {i} of a", "answer": "tiny", "stop": ["\n"], "max_tokens": 6} for i in range(n)
    ]


@pytest.fixture(scope="module")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tasks")
    return write_jsonl(d / "mc.jsonl", mc_rows(12)), write_jsonl(d / "gen.jsonl", gen_rows(4))


def evaluate(tasks: list[Path], model: Path | str, out: Path, **kw: Any) -> tuple[EvalSummary, list[dict]]:
    engine = EngineOptions(threads=1, **{k: kw.pop(k) for k in list(kw) if k in EngineOptions.__slots__})
    summary = run_eval(EvalOptions(tasks=tasks, model=model, out=out, engine=engine, **kw))
    return summary, [json.loads(line) for line in out.read_text().splitlines()]


def test_acc_norm_divides_by_characters_as_lm_eval_does() -> None:
    from lingctl.flood.eval.model import choice_length

    assert choice_length(" 北京") == 2  # characters, not the 6 UTF-8 bytes; the delimiter space not counted
    assert choice_length("Paris") == 5 and choice_length(" ") == 1


def test_choice_scores_are_the_log_likelihood_of_each_choice_under_a_plain_forward_pass(
    text_ckpt, task_files, tmp_path
):
    mc, _ = task_files
    summary, records = evaluate([mc], text_ckpt, tmp_path / "out.jsonl")
    model = load_checkpoint(text_ckpt).eval()
    tok = load_tokenizer(text_ckpt / "tokenizer.json")
    rows = [json.loads(line) for line in mc.read_text().splitlines()]
    worst = 0.0
    for row, rec in zip(rows[:4], records[:4], strict=True):
        assert rec["id"] == row["id"] and len(rec["scores"]) == 4
        for c, choice in enumerate(row["choices"]):
            ctx = tok.encode(row["context"], add_special_tokens=False).ids
            cont = tok.encode(row["context"] + choice, add_special_tokens=False).ids[len(ctx) :]
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            want = sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
            worst = max(worst, abs(want - rec["scores"][c]))
            # lm-eval's acc_norm: characters of the choice without the leading delimiter space
            assert rec["scores_norm"][c] == pytest.approx(rec["scores"][c] / len(choice.removeprefix(" ")))
        assert rec["pred"] == max(range(4), key=lambda i: rec["scores"][i])
        assert rec["correct"] == (rec["pred"] == row["answer"])
    assert worst < 1e-4, worst
    score = summary.tasks["mc"]
    assert score.items == 12 and score.acc == pytest.approx(sum(r["correct"] for r in records) / 12)
    assert score.acc_stderr > 0 or score.acc in (0.0, 1.0)


def test_numbers_are_identical_at_any_batch_size_and_without_prefix_sharing(text_ckpt, task_files, tmp_path):
    files = list(task_files)
    _, a = evaluate(files, text_ckpt, tmp_path / "a.jsonl", max_batch_tokens=1024)
    _, b = evaluate(files, text_ckpt, tmp_path / "b.jsonl", max_batch_tokens=16, max_seqs=3, prefix_sharing=False)
    assert a == b  # every float, bit for bit (JSON keeps a float's exact value)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    # Another order, and other company in the batch: each item's numbers are still the same.
    rows = [json.loads(line) for line in files[0].read_text().splitlines()][::-1] + mc_rows(5, seed=9)[1:]
    for i, row in enumerate(rows[-4:]):
        row["id"] = f"extra{i}"
    shuffled = write_jsonl(tmp_path / "mc.jsonl", rows)
    _, c = evaluate([shuffled], text_ckpt, tmp_path / "c.jsonl", max_batch_tokens=48)
    by_id = {r["id"]: r for r in c}
    assert [by_id[r["id"]] for r in a if r["task"] == "mc"] == [r for r in a if r["task"] == "mc"]


def test_fewshot_examples_come_from_the_file_and_their_shared_block_is_computed_once(text_ckpt, tmp_path):
    rows = mc_rows(6, seed=3)
    for r in rows[:2]:
        r["fewshot"] = True
    mc = write_jsonl(tmp_path / "fs.jsonl", rows)
    summary, records = evaluate([mc], text_ckpt, tmp_path / "o.jsonl", num_fewshot=2)
    assert [r["id"] for r in records] == ["q2", "q3", "q4", "q5"]  # the pool is not scored
    res = summary.results[0]
    assert res.cached_prompt_tokens > 0  # the two shots precede every choice: read from a shared prefix
    with pytest.raises(UsageError, match="needs 3 examples"):
        evaluate([mc], text_ckpt, tmp_path / "o3.jsonl", num_fewshot=3)


def test_generation_answers_are_extracted_and_matched_exactly(text_ckpt, tmp_path):
    gen = write_jsonl(tmp_path / "gen.jsonl", gen_rows(3))
    _, first = evaluate([gen], text_ckpt, tmp_path / "g1.jsonl")
    assert all(r["finish_reason"] in ("stop", "length") and r["tokens"][0] <= 6 for r in first)
    # The model's own greedy answers, written in as the expected ones: every item is then right.
    rows = gen_rows(3)
    for row, rec in zip(rows, first, strict=True):
        row["answer"] = rec["text"].strip()
    gen2 = write_jsonl(tmp_path / "gen2.jsonl", rows)
    summary, second = evaluate([gen2], text_ckpt, tmp_path / "g2.jsonl")
    assert [r["text"] for r in second] == [r["text"] for r in first]
    assert summary.tasks["gen2"].acc == 1.0
    assert extract_answer("The answer is 42.", r"answer is (\d+)") == "42"
    assert extract_answer("no digits", r"(\d+)") == ""
    assert extract_answer("  padded \n", None) == "padded"


def test_a_rerun_reuses_the_output_and_other_settings_are_refused(text_ckpt, task_files, tmp_path):
    mc, _ = task_files
    out = tmp_path / "o.jsonl"
    evaluate([mc], text_ckpt, out)
    before = out.read_bytes()
    summary, _ = evaluate([mc], text_ckpt, out, max_batch_tokens=64)  # batch size does not change the numbers
    assert summary.results[0].reused and out.read_bytes() == before
    with pytest.raises(UsageError, match="num_fewshot"):
        evaluate([mc], text_ckpt, out, num_fewshot=1)
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text("my notes\n")
    with pytest.raises(UsageError, match="did not write it"):
        evaluate([mc], text_ckpt, foreign)
    assert foreign.read_text() == "my notes\n"


def test_an_interrupted_evaluation_continues_and_ends_with_the_same_file(text_ckpt, task_files, tmp_path):
    mc, gen = task_files
    whole = tmp_path / "whole.jsonl"
    evaluate([mc, gen], text_ckpt, whole)
    out = tmp_path / "cut.jsonl"
    calls = {"n": 0}

    def stop_after_some_steps() -> bool:
        calls["n"] += 1
        return calls["n"] > 12

    opts = EvalOptions(
        tasks=[mc, gen], model=text_ckpt, out=out, engine=EngineOptions(threads=1, max_batch_tokens=32, max_seqs=4)
    )
    with pytest.raises(Interrupted):
        run_eval(opts, should_stop=stop_after_some_steps)
    journal = out.with_name(out.name + ".partial")
    done = journal.read_text().splitlines()
    assert not out.exists() and 0 < len(done) < 16
    summary, _ = evaluate([mc, gen], text_ckpt, out)
    assert summary.results[0].items == 16 and not journal.exists()
    assert out.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not a JSON object"),
        ('{"id": "a", "context": "x", "choices": ["y"], "answer": 0}', "at least two"),
        ('{"id": "a", "context": "x", "choices": ["y", "z"], "answer": 2}', "index of the right choice"),
        ('{"id": "a", "prompt": "x", "answer": 3}', "'answer' must be a string"),
        ('{"id": "a", "prompt": "x", "answer": "3", "regex": "("}', "does not compile"),
        ('{"id": "a", "prompt": "x", "answer": "3", "temperature": 1}', "unknown field"),
        ('{"context": "x", "choices": ["y", "z"], "answer": 0}', "'id'"),
        ('{"id": "a", "text": "x"}', "neither"),
        # JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer or output file can take.
        ('{"id": "a", "context": "x\\ud800", "choices": [" y", " z"], "answer": 0}', "'context' is not valid Unicode"),
        ('{"id": "a\\udc00", "prompt": "x", "answer": "3"}', "'id' is not valid Unicode"),
        ('{"id": "a", "prompt": "x", "answer": "3", "stop": ["\\ud800"]}', "'stop' is not valid Unicode"),
        ('{"id": "a", "prompt": "x", "answer": "3", "z": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
    ],
)
def test_a_bad_task_line_is_named(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "ok", "context": "a", "choices": [" b", " c"], "answer": 0}\n' + line + "\n")
    with pytest.raises(UsageError, match=message) as err:
        read_tasks([path])
    assert f"{path}:2" in str(err.value) or "not a JSON" not in message


def test_task_files_are_checked_as_a_whole(tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        '{"id": "a", "context": "x", "choices": [" y", " z"], "answer": 0}\n{"id": "b", "prompt": "p", "answer": "q"}\n'
    )
    with pytest.raises(UsageError, match="a generate item in a file of choice items"):
        read_tasks([mixed])
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "p", "answer": "q"}] * 2)
    with pytest.raises(UsageError, match="already used on line 1"):
        read_tasks([dup])
    (tmp_path / "x").mkdir()
    same = write_jsonl(tmp_path / "x" / "dup.jsonl", [{"id": "a", "prompt": "p", "answer": "q"}])
    with pytest.raises(UsageError, match="both named"):
        read_tasks([write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "p", "answer": "q"}]), same])


def test_a_cached_hub_id_is_evaluated_like_its_directory(text_ckpt, task_files, tmp_path, monkeypatch):
    from tests.support.hf_cache import cache_repo

    home = tmp_path / "hf"
    cache_repo(home, "org/text-ling", text_ckpt)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    mc, _ = task_files
    _, by_dir = evaluate([mc], text_ckpt, tmp_path / "dir.jsonl")
    summary, by_id = evaluate([mc], "org/text-ling", tmp_path / "id.jsonl")
    assert summary.model == "org/text-ling" and by_id == by_dir
