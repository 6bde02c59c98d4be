"""Rows of HellaSwag, ARC, MMLU, PIQA and GSM8K, as their datasets export them, read as flood eval items with
lm-evaluation-harness's prompts; and a `flood eval` run over such files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingctl.core.errors import UsageError
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.eval.run import EvalOptions, run_eval
from lingctl.flood.eval.task_files import read_tasks
from lingctl.flood.eval.tasks import CHOICE, GENERATE

HELLASWAG = {
    "ind": 24,
    "activity_label": "Roof shingle removal",
    "ctx_a": "A man is sitting on a roof.",
    "ctx_b": "he",
    "ctx": "A man is sitting on a roof. he",
    "endings": [
        "is using wrap to wrap a pair of skis.",
        "is ripping level tiles off.",
        "is holding a rubik's cube.",
        "starts pulling up roofing on a roof. [title] Remove  the shingles.",
    ],
    "source_id": "activitynet~v_-JhWjGDPHMY",
    "split": "val",
    "split_type": "indomain",
    "label": "3",
}
ARC = {
    "id": "Mercury_7175875",
    "question": "An astronomer observes that a planet rotates faster after a meteorite impact. Which is the most "
    "likely effect of this increase in rotation?",
    "choices": {
        "text": [
            "Planetary density will decrease.",
            "Planetary years will become longer.",
            "Planetary days will become shorter.",
            "Planetary gravity will become stronger.",
        ],
        "label": ["A", "B", "C", "D"],
    },
    "answerKey": "C",
}
MMLU = {
    "question": "Find the degree for the given field extension Q(sqrt(2)) over Q.",
    "subject": "abstract_algebra",
    "choices": ["0", "4", "2", "6"],
    "answer": 2,
}
PIQA = {
    "goal": "How do I ready a guinea pig cage?",
    "sol1": "Fill it with hay.",
    "sol2": "Fill it with sand.",
    "label": 0,
}
GSM8K = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
}


def _task(tmp_path: Path, name: str, rows: list[dict]):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task,) = read_tasks([path])
    return task


def test_each_known_row_becomes_lm_evals_request(tmp_path: Path) -> None:
    h = _task(tmp_path, "hellaswag", [HELLASWAG]).items[0]
    assert (h.kind, h.id, h.answer) == (CHOICE, "24", 3)
    assert h.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert h.choices[0] == " is using wrap to wrap a pair of skis."
    assert h.choices[3] == " starts pulling up roofing on a roof.. Remove the shingles."  # lm-eval's preprocess
    a = _task(tmp_path, "arc", [ARC]).items[0]
    assert a.id == "Mercury_7175875" and a.answer == 2
    assert a.context.startswith("Question: An astronomer") and a.context.endswith("rotation?\nAnswer:")
    assert a.choices[2] == " Planetary days will become shorter."
    m = _task(tmp_path, "mmlu", [MMLU]).items[0]
    assert m.context == (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find the degree for the given field extension Q(sqrt(2)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:"
    )
    assert m.choices == [" A", " B", " C", " D"] and m.answer == 2 and m.id == "line-1"
    p = _task(tmp_path, "piqa", [PIQA]).items[0]
    assert p.context == "Question: How do I ready a guinea pig cage?\nAnswer:" and p.choices[1] == " Fill it with sand."
    g = _task(tmp_path, "gsm8k", [GSM8K]).items[0]
    assert g.kind == GENERATE and g.answer == "72" and g.prompt.endswith("\nAnswer:")
    assert g.stop[0] == "Question:" and g.regex == r"#### (\-?[0-9\.\,]+)"


def test_a_row_that_cannot_be_read_names_its_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"hellaswag\.jsonl:2: a HellaSwag row .*no label"):
        _task(tmp_path, "hellaswag", [HELLASWAG, {**HELLASWAG, "ind": 25, "label": ""}])
    with pytest.raises(UsageError, match=r"arc\.jsonl:1: a ARC row"):
        _task(tmp_path, "arc", [{**ARC, "answerKey": "E"}])
    with pytest.raises(UsageError, match="neither a multiple-choice item"):
        _task(tmp_path, "other", [{"id": "x", "question": "q?"}])


def test_flood_eval_scores_hellaswag_and_arc_rows(text_ckpt: Path, tmp_path: Path) -> None:
    rows = [{**HELLASWAG, "ind": i} for i in range(3)]
    hs = tmp_path / "hellaswag.jsonl"
    hs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arc = tmp_path / "arc.jsonl"
    arc.write_text("".join(json.dumps({**ARC, "id": f"a{i}"}) + "\n" for i in range(2)))
    out = tmp_path / "out.jsonl"
    summary = run_eval(EvalOptions(tasks=[hs, arc], model=text_ckpt, out=out, engine=EngineOptions(threads=1)))
    assert summary.tasks["hellaswag"].items == 3 and summary.tasks["arc"].items == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["id"] for r in records if r["task"] == "hellaswag"} == {"0", "1", "2"}
    assert all(len(r["scores"]) == 4 and r["answer"] in (2, 3) for r in records)
