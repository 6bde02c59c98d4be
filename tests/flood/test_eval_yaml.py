"""lm-evaluation-harness task files (YAML) over local data: the items they become, the same as flood's own JSONL
items written by hand; their scores through `lingctl flood eval`; and the keys refused, each in one line."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from lingctl.cli import run as cli_run
from lingctl.core.errors import UsageError
from lingctl.flood.eval.task_files import read_tasks
from lingctl.flood.eval.tasks import AnswerMatch, EvalItem, Task
from tests.conftest import run_lingctl
from tests.flood.test_eval import write_jsonl

ROWS: list[dict[str, Any]] = [
    {"id": "r1", "q": "the quick brown fox", "opts": ["jumps", "lazy dog"], "label": 0, "key": "B"},
    {"id": "r2", "q": "line of a tiny", "opts": ["corpus", "fox jumps"], "label": 0, "key": "A"},
    {"id": "r3", "q": "over the lazy", "opts": ["line", "dog"], "label": 1, "key": "B"},
]
GSM: list[dict[str, Any]] = [
    {"question": "two plus two", "answer": "add them\n#### 4"},
    {"question": "ten times ten", "answer": "multiply\n#### 1,000"},
    {"question": "one less than one", "answer": "#### 0"},
]


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def mc_yaml(d: Path, name: str, **keys: str) -> Path:
    """A multiple-choice task over rows.jsonl in ``d``, its doc_to_* keys overridable."""
    fields = {
        "doc_to_text": '"Q: {{q}}\\nA:"',
        "doc_to_choice": "opts",
        "doc_to_target": "label",
        **keys,
    }
    lines = "\n".join(f"{k}: {v}" for k, v in fields.items())
    return write_yaml(
        d / f"{name}.yaml",
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: rows.jsonl\n"
        f"output_type: multiple_choice\ntest_split: test\n{lines}\n",
    )


def gsm_yaml(d: Path, extra: str = "") -> Path:
    return write_yaml(
        d / "gsm.yaml",
        """\
        task: gsm
        dataset_path: json
        dataset_kwargs: {data_files: {test: gsm.jsonl}}
        output_type: generate_until
        test_split: test
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: ["Question:", "\\n\\n"]
          max_gen_toks: 12
          do_sample: false
          temperature: 0.0
        filter_list:
          - name: strict-match
            filter:
              - function: regex
                regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
              - function: take_first
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
            ignore_case: true
            regexes_to_ignore: [",", "(?s).*#### "]
        """
        + extra,
    )


def mc_by_hand() -> list[dict[str, Any]]:
    """The items mc_yaml's task should become, written as flood's JSONL."""
    return [
        {"id": r["id"], "context": f"Q: {r['q']}\nA:", "choices": [" " + o for o in r["opts"]], "answer": r["label"]}
        for r in ROWS
    ]


def fields(items: list[EvalItem]) -> list[tuple]:
    return [(i.id, i.context, i.choices, i.answer, i.prompt, i.stop, i.max_tokens) for i in items]


def read_one(path: Path, num_fewshot: int | None = None) -> Task:
    return read_tasks([path], num_fewshot=num_fewshot)[0]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    write_jsonl(tmp_path / "gsm.jsonl", GSM)
    return tmp_path


def test_multiple_choice_items_equal_the_same_items_written_by_hand(data: Path) -> None:
    expected = fields(read_one(write_jsonl(data / "hand.jsonl", mc_by_hand())).items)
    # doc_to_choice as a column and doc_to_target as an index column; as Jinja lists and an index template.
    task = read_one(mc_yaml(data, "plain"))
    assert task.name == "plain" and task.kind == "choice" and fields(task.items) == expected
    jinja = mc_yaml(data, "jinja", doc_to_choice='"{{[opts[0], opts[1]]}}"', doc_to_target='"{{label}}"')
    assert fields(read_one(jinja).items) == expected
    # Letters as the choices (a YAML list), the target a letter: the answer is its index.
    letters = mc_yaml(data, "letters", doc_to_choice='["A", "B"]', doc_to_target="key")
    assert [(i.choices, i.answer) for i in read_one(letters).items] == [([" A", " B"], 1), ([" A", " B"], 0)] + [
        ([" A", " B"], 1)
    ]
    # The target as a choice's text, through a template.
    text = mc_yaml(data, "text", doc_to_target='"{{opts[label]}}"')
    assert fields(read_one(text).items) == expected
    # The same rows as CSV: integer columns are integers, as datasets reads them.
    (data / "rows.csv").write_text(
        "id,q,a,b,label\n" + "".join(f"{r['id']},{r['q']},{r['opts'][0]},{r['opts'][1]},{r['label']}\n" for r in ROWS)
    )
    csv = mc_yaml(data, "csv", doc_to_choice='"{{[a, b]}}"').read_text()
    csv = csv.replace("dataset_path: json", "dataset_path: csv").replace("rows.jsonl", "rows.csv")
    csv_task = read_one(write_yaml(data / "csv.yaml", csv))
    assert fields(csv_task.items) == expected


def test_generation_items_stop_and_answer_as_lm_eval_scores_them(data: Path) -> None:
    task = read_one(gsm_yaml(data))
    item = task.items[0]
    assert task.kind == "generate" and [i.id for i in task.items] == ["0", "1", "2"]  # lm-eval's doc numbers
    assert item.prompt == "Question: two plus two\nAnswer:" and item.answer == "add them\n#### 4"
    assert item.stop == ["Question:", "\n\n"] and item.max_tokens == 12
    match = item.match
    assert match is not None and match.regex is not None and match.regexes_to_ignore == (",", "(?s).*#### ")
    # The filter takes the first match's group; exact_match drops the ignored patterns from both sides.
    assert match.answer(" so #### 1,000 and #### 7") == "1,000"
    assert match.normalize(match.answer(" so #### 1,000")) == match.normalize(str(task.items[1].answer)) == "1000"
    assert match.answer("no number") == "[invalid]"
    assert AnswerMatch(regex="(a)|(b)").answer("xb") == "b"  # several groups: the first non-empty one
    with pytest.raises(UsageError, match="--regex does not apply"):  # the task's filter decides
        read_tasks([gsm_yaml(data)], regex="(\\d+)")


def test_fewshot_split_gives_the_shots_and_the_description_comes_once(data: Path) -> None:
    write_jsonl(data / "train.jsonl", [{"q": f"shot {i}", "opts": ["x", "y"], "label": 1} for i in range(3)])
    path = mc_yaml(
        data,
        "shots",
        description='"About {{q}}.\\n\\n"',
        num_fewshot="2",
        fewshot_delimiter='"\\n###\\n"',
        fewshot_split="train",
    )
    path.write_text(path.read_text().replace("test: rows.jsonl", "test: rows.jsonl\n    train: train.jsonl"))
    task = read_one(path)
    item = task.items[0]
    assert task.num_fewshot == 2 and len(task.pool) == 2
    before = "About the quick brown fox.\n\nQ: shot 0\nA: y\n###\nQ: shot 1\nA: y\n###\n"
    assert task.text_before(item, task.num_fewshot) + item.context == before + "Q: the quick brown fox\nA:"
    assert read_one(path, num_fewshot=0).num_fewshot == 0  # --num-fewshot wins over the file's
    # Without another split, the shots are the scored split's other items, in order.
    plain = read_one(mc_yaml(data, "plain"), num_fewshot=1)
    assert plain.text_before(plain.items[0], 1) == "Q: line of a tiny\nA: corpus\n\n"


def test_an_included_file_gives_the_keys_the_including_file_does_not(data: Path) -> None:
    (data / "base").mkdir()
    base = mc_yaml(data, "base", doc_to_text='"Base {{q}}"').rename(data / "base" / "base.yaml")
    # Its data path is relative to its own directory.
    base.write_text(base.read_text().replace("test: rows.jsonl", "test: ../rows.jsonl"))
    child = write_yaml(data / "child.yaml", "include: base/base.yaml\ntask: child\ndoc_to_target: '{{label}}'\n")
    task = read_one(child)
    assert task.name == "child" and task.items[0].context == "Base the quick brown fox"
    assert [i.answer for i in task.items] == [0, 0, 1]
    assert task.sha256 != read_one(base).sha256


BAD = [
    ("process_docs", "!function utils.process_docs", "process_docs: !function utils.process_docs: Python functions"),
    ("doc_to_text", "!function utils.text", "doc_to_text: !function utils.text: Python functions"),
    ("process_docs", "'lambda d: d'", "process_docs: Python functions in task files are not run"),
    ("colour", "red", "unknown key 'colour'"),
    ("metric_list", "[{metric: f1}]", "metric 'f1' is not supported"),
    ("output_type", "loglikelihood_rolling", "output_type 'loglikelihood_rolling' is not supported"),
    ("doc_to_text", "'{{missing}}'", "rows.jsonl: row 1: doc_to_text: template failed: 'missing' is undefined"),
    ("doc_to_target", "7", "row 1: doc_to_target gives index 7; there are 2 choices"),
    ("doc_to_choice", "'{{q}}'", "row 1: doc_to_choice gives 'the quick brown fox', not a list literal"),
    ("fewshot_config", "{sampler: balanced}", "fewshot_config"),
]


@pytest.mark.parametrize("key,value,message", BAD)
def test_what_cannot_be_scored_as_lm_eval_would_is_refused_in_one_line(
    data: Path, key: str, value: str, message: str
) -> None:
    path = mc_yaml(data, "bad", **{key: value})
    with pytest.raises(UsageError) as info:
        read_one(path)
    assert message in info.value.message and "\n" not in info.value.message and str(path.parent) in info.value.message


@pytest.mark.parametrize(
    "change,message",
    [
        (("dataset_path: json", "dataset_path: allenai/ai2_arc"), "only local data files are read"),
        (("do_sample: false", "do_sample: true"), "sampling is not supported"),
        (("function: take_first", "function: majority_vote"), "only 'regex' then 'take_first'"),
        (("ignore_case: true", "ignore_case: 1"), "ignore_case must be true or false"),
    ],
)
def test_generation_and_data_refusals(data: Path, change: tuple[str, str], message: str) -> None:
    path = gsm_yaml(data)
    path.write_text(path.read_text().replace(*change))
    with pytest.raises(UsageError, match=message):
        read_one(path)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_what_to_do(data: Path) -> None:
    (data / "rows.parquet").write_bytes(b"PAR1")
    path = mc_yaml(data, "pq")
    text = path.read_text().replace("dataset_path: json", "dataset_path: parquet")
    path.write_text(text.replace("rows.jsonl", "rows.parquet"))
    with pytest.raises(UsageError, match="needs pyarrow") as info:
        read_one(path)
    assert "JSON Lines" in (info.value.hint or "")


def test_the_command_refuses_a_task_file_with_python_in_one_line(data: Path, text_ckpt: Path) -> None:
    path = mc_yaml(data, "code", doc_to_text="!function utils.doc_to_text")
    res = run_lingctl("flood", "eval", str(path), "--model", str(text_ckpt), "-o", str(data / "out.jsonl"))
    assert res.returncode == 2, res.stderr
    error = [x for x in res.stderr.splitlines() if x.startswith("lingctl: error:")]
    assert error == [
        f"lingctl: error: {path}: doc_to_text: !function utils.doc_to_text: Python functions in task files are not run"
    ]
    assert not (data / "out.jsonl").exists()


def test_a_task_file_scores_as_the_same_items_in_jsonl(data: Path, text_ckpt: Path, capsys) -> None:
    hand_mc = mc_by_hand()
    hand_gen: list[dict[str, Any]] = [
        {"id": str(i), "prompt": f"Question: {r['question']}\nAnswer:", "answer": r["answer"].split("#### ")[-1]}
        for i, r in enumerate(GSM)
    ]
    for row in hand_gen:
        row.update(stop=["Question:", "\n\n"], max_tokens=12, regex="#### (\\-?[0-9\\.\\,]+)")
    yaml_files = [mc_yaml(data, "mc"), gsm_yaml(data)]
    (data / "j").mkdir()
    jsonl_files = [write_jsonl(data / "j" / "mc.jsonl", hand_mc), write_jsonl(data / "j" / "gsm.jsonl", hand_gen)]
    records = {}
    for kind, files in (("yaml", yaml_files), ("jsonl", jsonl_files)):
        out = data / f"{kind}.eval.jsonl"
        code = cli_run(
            ["flood", "eval", *map(str, files), "--model", str(text_ckpt), "-o", str(out), "--threads", "1", "--json"]
        )
        assert code == 0, capsys.readouterr().err
        records[kind] = [json.loads(x) for x in out.read_text().splitlines()]
    for a, b in zip(records["yaml"], records["jsonl"], strict=True):
        assert (a["task"], a["id"]) == (b["task"], b["id"])
        if a["kind"] == "choice":
            assert a["scores"] == b["scores"] and a["correct_norm"] == b["correct_norm"]
        else:
            assert a["text"] == b["text"]
        assert a["correct"] == b["correct"]
