"""The task files users bring, scored by flood eval and by lm-evaluation-harness on the same checkpoint.

A tiny Ling MoE with seeded random weights and a BPE tokenizer trained on the tasks' text is saved as a lingctl
checkpoint. lm-eval's ``HFLM`` loads that very directory (``trust_remote_code=True``: the modeling code lingctl
writes beside the weights), so both sides run the same weights through their own code. Three tasks, generated
deterministically in the shapes of the public datasets:

- **HellaSwag rows** (``ind``, ``activity_label``, ``ctx_a``, ``ctx_b``, ``endings``, ``label``, with WikiHow's
  ``[title]`` and ``[step]`` artifacts): flood reads the rows as they are; lm-eval runs its own ``hellaswag``
  task config (its ``process_docs`` and templates) with ``dataset_path: json`` over the same file.
- **ARC rows** (``id``, ``question``, ``choices: {text, label}``, ``answerKey``): flood reads the rows; lm-eval
  runs its ``arc_easy`` config over the same file.
- **An lm-eval YAML task**: the ``arc_easy`` config written as a task file with local data, which flood reads
  itself (``lingctl flood eval task.yaml``) and lm-eval loads from the same file.

Measured per task: the largest |difference| between the two sides' per-choice log-likelihoods, how many items'
``acc`` and ``acc_norm`` predictions differ, and both sides' accuracies.

    /path/to/venv-with-bench-extra/bin/python bench/flood_eval_tasks_vs_lm_eval.py [--items N] [--json]

Needs the ``bench`` extra (``make bench-deps``: transformers and lm-eval). Everything runs offline.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from lingctl.model.checkpoint import save_checkpoint  # noqa: E402
from lingctl.model.ling import LingForCausalLM  # noqa: E402
from lingctl.model.presets import preset  # noqa: E402
from lingctl.model.tokenizer import train_tokenizer  # noqa: E402

WORDS = (
    "the a man woman dog cat runs jumps table water sky green blue quickly slowly opens closes river mountain "
    "paper machine light dark sound heat cold plant grows falls rises turns stone metal wood glass"
).split()


def _phrase(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def hellaswag_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        endings = [_phrase(rng, 3, 12) + "." for _ in range(4)]
        if i % 3 == 0:  # WikiHow's artifacts, which both sides must strip the same way
            endings[0] = "[title] " + endings[0] + " [step] " + _phrase(rng, 2, 4) + "."
        rows.append(
            {
                "ind": i,
                "activity_label": _phrase(rng, 1, 3).capitalize(),
                "ctx_a": _phrase(rng, 5, 15).capitalize() + ".",
                "ctx_b": _phrase(rng, 2, 6),
                "endings": endings,
                "label": str(rng.randrange(4)),
                "split": "val",
            }
        )
    return rows


def arc_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        labels = ["A", "B", "C", "D"] if i % 4 else ["1", "2", "3", "4"]
        choices = {"text": [_phrase(rng, 1, 6) for _ in labels], "label": labels}
        rows.append(
            {
                "id": f"arc-{i}",
                "question": _phrase(rng, 6, 14) + "?",
                "choices": choices,
                "answerKey": rng.choice(labels),
            }
        )
    return rows


def arc_yaml(name: str, data: Path) -> str:
    """lm-eval's arc_easy config, with local data (lm-eval resolves the path itself: it is absolute)."""
    return f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_checkpoint(path: Path, texts: list[str]) -> None:
    tok = train_tokenizer(texts * 4, 1024)
    cfg = preset("tiny")
    cfg.vocab_size = tok.get_vocab_size()
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None, "lingctl's tokenizers always hold the end-of-text token"
    cfg.eos_token_id = cfg.pad_token_id = eos
    model = LingForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    save_checkpoint(model, path, tokenizer_json=tok.to_str())


def run_flood(ckpt: Path, task: Path, out: Path) -> dict[str, dict[str, Any]]:
    cmd = [sys.executable, "-m", "lingctl", "flood", "eval", str(task), "--model", str(ckpt), "-o", str(out)]
    proc = subprocess.run([*cmd, "--dtype", "float32"], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"flood eval {task.name}: {proc.stderr.strip()[-1000:]}")
    return {str(r["id"]): r for r in map(json.loads, out.read_text().splitlines())}


def lm_eval_task_configs(hellaswag: Path, arc: Path, yaml_task: Path) -> list[dict[str, Any]]:
    import yaml
    from lm_eval.tasks.hellaswag import utils as hellaswag_utils

    tasks_dir = Path(hellaswag_utils.__file__).parent.parent
    # lm-eval's own configs with the data swapped for the local files (its !function tags resolved by hand).
    hs_text = (tasks_dir / "hellaswag" / "hellaswag.yaml").read_text().replace("!function utils.process_docs", "null")
    hs = yaml.safe_load(hs_text)
    hs.update(
        dataset_path="json",
        dataset_name=None,
        dataset_kwargs={"data_files": {"validation": str(hellaswag)}},
        training_split=None,
        process_docs=hellaswag_utils.process_docs,
    )
    arc_cfg = yaml.safe_load((tasks_dir / "arc" / "arc_easy.yaml").read_text())
    arc_cfg.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {"test": str(arc)}})
    arc_cfg.update(training_split=None, validation_split=None, task="arc_rows")
    for cfg in (hs, arc_cfg):
        cfg.pop("tag", None)
    own = yaml.safe_load(yaml_task.read_text())  # the very file flood eval reads
    return [hs, arc_cfg, own]


def run_lm_eval(ckpt: Path, configs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(ckpt), trust_remote_code=True, batch_size=1, device="cpu", dtype="float32")
    with contextlib.redirect_stderr(io.StringIO()):
        out = lm_eval.simple_evaluate(model=lm, tasks=configs, num_fewshot=0, log_samples=True, random_seed=0)
    assert out is not None
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for task, samples in out["samples"].items():
        items = {}
        for s in samples:
            doc = s["doc"]
            key = str(doc.get("ind", doc.get("id")))
            resps = [r[0] if isinstance(r[0], (list, tuple)) else r for r in s["filtered_resps"]]
            items[key] = {"scores": [float(r[0]) for r in resps], "acc": s["acc"], "acc_norm": s["acc_norm"]}
        result[task] = items
    return result


def compare(flood: dict[str, dict[str, Any]], lm: dict[str, dict[str, Any]]) -> dict[str, Any]:
    keys = sorted(set(flood) & set(lm))
    diffs = [abs(a - b) for k in keys for a, b in zip(flood[k]["scores"], lm[k]["scores"])]
    return {
        "items": len(keys),
        "missing": len(set(flood) ^ set(lm)),
        "max_abs_diff": max(diffs) if diffs else None,
        "acc_differs": sum(bool(flood[k]["correct"]) != bool(lm[k]["acc"]) for k in keys),
        "acc_norm_differs": sum(bool(flood[k]["correct_norm"]) != bool(lm[k]["acc_norm"]) for k in keys),
        "flood_acc": sum(bool(flood[k]["correct"]) for k in keys) / max(len(keys), 1),
        "lm_eval_acc": sum(bool(lm[k]["acc"]) for k in keys) / max(len(keys), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    hs, arc = hellaswag_rows(rng, args.items), arc_rows(rng, args.items)
    texts = [json.dumps(r) for r in hs + arc]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = work / "ckpt"
        build_checkpoint(ckpt, texts)
        hs_file, arc_file = write_jsonl(work / "hellaswag.jsonl", hs), write_jsonl(work / "arc.jsonl", arc)
        yaml_task = work / "arc_yaml.yaml"
        yaml_task.write_text(arc_yaml("arc_yaml", arc_file))
        files = {"hellaswag": hs_file, "arc_rows": arc_file, "arc_yaml": yaml_task}
        flood = {task: run_flood(ckpt, path, work / f"{task}.eval.jsonl") for task, path in files.items()}
        lm = run_lm_eval(ckpt, lm_eval_task_configs(hs_file, arc_file, yaml_task))
    rows = {task: compare(flood[task], lm[task]) for task in flood}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'task':12s} {'items':>5s} {'max |Δ log-lik|':>16s} {'acc differs':>11s} {'acc_norm differs':>16s}  acc flood / lm-eval"
    )
    for task, r in rows.items():
        print(
            f"{task:12s} {r['items']:5d} {r['max_abs_diff']:16.2e} {r['acc_differs']:11d} {r['acc_norm_differs']:16d}"
            f"  {r['flood_acc']:.3f} / {r['lm_eval_acc']:.3f}"
        )


if __name__ == "__main__":
    main()
