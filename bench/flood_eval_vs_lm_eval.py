"""lingctl flood eval vs lm-evaluation-harness: multiple-choice log-likelihoods on one CPU thread.

Both sides score the same task with the same weights. The tiny Ling MoE of ``flood_vs_hf.py`` (4 layers,
hidden 256, 64 experts top-6, two shared experts, seeded random weights) is saved as a Ling checkpoint with a
byte-level BPE tokenizer trained on the task's own text. lm-eval has no Ling model: transformers has no
``bailing_moe`` architecture, so lm-eval's ``HFLM`` runs HF's ``Qwen2MoeForCausalLM`` with every weight copied
from the Ling model (``flood_vs_hf.build_hf``: the same router, experts and attention; the copy is checked by
the max |logit difference| of one forward) and ``PreTrainedTokenizerFast`` over the same ``tokenizer.json``.

The task is generated deterministically: N items of ASCII text, each a context of a few sentences ending in
"Answer:" and four choices of 1-16 words that start with a space. lm-eval reads it through a task YAML
(``dataset_path: json``, ``output_type: multiple_choice``, ``target_delimiter: ""``), so its continuation is
exactly the choice text, as in flood's contract; with no trailing whitespace in the context, lm-eval's
``_encode_pair`` moves nothing, and both sides split ``encode(context + choice)`` after ``encode(context)``.

Measured:

- per-item, per-choice log-likelihood: lm-eval's logged ``filtered_resps`` against flood's ``scores``
  (max |difference|, and the is-greedy flags); acc and acc_norm of both (lm-eval normalises by characters,
  flood by bytes: the same on ASCII);
- lm-eval at batch size 1, 8 and 32: how much its scores move with the batch size (padding changes the shapes);
- flood at ``--max-batch-tokens`` 64 and 1024, and with ``--no-prefix-sharing``: its scores must be
  bit-identical (count of differing floats);
- wall time of each side, model load excluded: lm-eval's ``simple_evaluate`` (the HF model is built in this
  process beforehand), and of that the time in ``HFLM.loglikelihood``; flood's evaluation time from ``--json``
  (``results[0].seconds``: without the checkpoint load; its whole process time is shown too). Both sides are
  warmed up on 4 items first. Ratio = lm-eval seconds / flood seconds at ``--max-batch-tokens 1024``: above 1
  means flood is faster. flood computes an item's context once for its four choices (prefix sharing), lm-eval
  once per choice; the run without prefix sharing shows how much of the ratio that is.

A full run (200 items, one round) takes about 2.5 minutes on 2 cores; ``--quick`` (40 items) under a minute.

Every side runs with one compute thread: ``torch.set_num_threads(1)`` here, ``--threads 1`` for flood.

    .venv/bin/python bench/flood_eval_vs_lm_eval.py [--quick] [--items N] [--rounds N] [--json] [--save FILE]

Needs the ``bench`` extra (``make bench-deps``: transformers and lm-eval). Everything runs offline.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before lm-eval and datasets are imported: they read these at import time.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from flood_vs_hf import build_hf, build_ling, ling_config, logit_diff, versions  # noqa: E402

from lingctl.model.checkpoint import save_checkpoint  # noqa: E402
from lingctl.model.hf_files import EOS_TOKEN  # noqa: E402
from lingctl.model.tokenizer import train_tokenizer  # noqa: E402

SEED = 0
TASK = "mc_stories"
LINGCTL = Path(sys.executable).parent / "lingctl"
LM_EVAL_BATCHES = (1, 8, 32)
# (--max-batch-tokens, prefix sharing): the scores must not depend on either; the second is the timed one.
FLOOD_RUNS = ((64, True), (1024, True), (1024, False))
FLOOD_MAIN = 1
TOKENIZER_VOCAB = 4096

# -- the task ---------------------------------------------------------------------------------------------------

NAMES = "Ada Bram Cleo Dov Eli Fay Gus Hana Ivo Juno Kai Lena Milo Nia Otto Pia Quin Rosa Sami Tova".split()
ADJS = "old young quiet loud small tall red green bright dark brave tired happy careful lazy clever".split()
NOUNS = (
    "miller baker dog cat river market bridge lamp garden boat letter window apple basket hill road "
    "tower kettle horse field school song"
).split()
VERBS = "found carried painted visited fixed sold watched followed opened cleaned built counted".split()
PLACES = "at dawn|in the rain|after lunch|before the storm|near the gate|by the old mill|on a cold morning".split("|")


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)} {rng.choice(VERBS)} the {rng.choice(ADJS)} {rng.choice(NOUNS)} {rng.choice(PLACES)}."


def _choice(rng: random.Random) -> str:
    """A phrase of 1-16 words with a leading space (the separator after "Answer:" belongs to the choice)."""
    n = rng.choice([1, 1, 2, 3, 4, 6, 8, 11, 16])
    words = [rng.choice(NAMES + ADJS + NOUNS + VERBS) for _ in range(n)]
    text = " " + " ".join(words)
    return text + "." if n > 2 else text


def make_items(n: int) -> list[dict]:
    rng = random.Random(SEED + 10)
    items = []
    for i in range(n):
        story = " ".join(_sentence(rng) for _ in range(rng.randint(2, 7)))
        who, noun = rng.choice(NAMES), rng.choice(NOUNS)
        context = f"Story {i}: {story}\nQuestion: what did {who} do with the {noun}?\nAnswer:"
        choices: list[str] = []
        while len(choices) < 4:
            c = _choice(rng)
            if c not in choices:
                choices.append(c)
        items.append({"id": f"q{i}", "context": context, "choices": choices, "answer": rng.randrange(4)})
    return items


def write_task(items: list[dict], directory: Path) -> tuple[Path, Path]:
    """The JSONL task file (flood reads it directly) and an lm-eval task YAML that reads the same file."""
    data = directory / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    # doc_to_choice / doc_to_target name fields, so lm-eval takes the list and the index as they are.
    yaml = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
    tasks = directory / "lm_eval_tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(yaml)
    return data, tasks


# -- lm-eval ------------------------------------------------------------------------------------------------------


def run_lm_eval(hf: torch.nn.Module, tokenizer, tasks_dir: Path, batch: int, limit: int | None = None) -> dict:
    """One ``simple_evaluate`` with the in-process HF model: metrics, per-item choice scores, seconds."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=batch, device="cpu")
    # Only the model calls, for a second figure that leaves out lm-eval's task and request bookkeeping.
    ll_seconds = 0.0
    loglikelihood = lm.loglikelihood

    def timed_loglikelihood(requests, disable_tqdm: bool = False):
        nonlocal ll_seconds
        t = time.perf_counter()
        out = loglikelihood(requests, disable_tqdm=disable_tqdm)
        ll_seconds += time.perf_counter() - t
        return out

    lm.loglikelihood = timed_loglikelihood
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    # lm-eval's progress bars write to stderr whatever the settings; they would bury the table.
    with contextlib.redirect_stderr(io.StringIO()):
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[TASK],
            num_fewshot=0,
            task_manager=manager,
            log_samples=True,
            limit=limit,
            random_seed=SEED,
            numpy_random_seed=SEED,
            torch_random_seed=SEED,
            fewshot_random_seed=SEED,
        )
        seconds = time.perf_counter() - start
    assert out is not None
    metrics = out["results"][TASK]
    items = {}
    for s in out["samples"][TASK]:
        doc = s["doc"]
        # Check that lm-eval asked for exactly flood's (context, choice) pairs.
        want = [[doc["context"], c] for c in doc["choices"]]
        got = [list(a) for a in s["arguments"]]
        if got != want:
            raise RuntimeError(f"lm-eval built other requests for {doc['id']}: {got!r} != {want!r}")
        resps = [r[0] if isinstance(r[0], (list, tuple)) else r for r in s["filtered_resps"]]
        items[doc["id"]] = {
            # lm-eval's own split of (context, choice) into tokens, to set beside flood's token counts
            "tokens": [len(lm._encode_pair(doc["context"], c)[1]) for c in doc["choices"]],
            "scores": [float(r[0]) for r in resps],
            "greedy": [bool(r[1]) for r in resps],
            "correct": bool(s["acc"]),
            "correct_norm": bool(s["acc_norm"]),
        }
    return {
        "batch_size": batch,
        "seconds": seconds,
        "loglikelihood_seconds": ll_seconds,
        "acc": metrics["acc,none"],
        "acc_stderr": metrics["acc_stderr,none"],
        "acc_norm": metrics["acc_norm,none"],
        "acc_norm_stderr": metrics["acc_norm_stderr,none"],
        "items": items,
    }


# -- flood -------------------------------------------------------------------------------------------------------


def run_flood(model_dir: Path, task: Path, batch_tokens: int, out: Path, *, prefix_sharing: bool = True) -> dict:
    cmd = [
        str(LINGCTL),
        "flood",
        "eval",
        str(task),
        "--model",
        str(model_dir),
        "-o",
        str(out),
        "--max-batch-tokens",
        str(batch_tokens),
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--prefix-sharing" if prefix_sharing else "--no-prefix-sharing",
        "--json",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    summary = json.loads(proc.stdout)
    (result,) = summary["results"]
    if result["reused"]:
        raise RuntimeError(f"flood reused an earlier output instead of evaluating: {out}")
    metrics = result["tasks"][task.stem]
    items = {}
    for line in out.read_text().splitlines():
        r = json.loads(line)
        items[r["id"]] = {k: r[k] for k in ("scores", "scores_norm", "greedy", "tokens", "pred", "correct") if k in r}
    return {
        "max_batch_tokens": batch_tokens,
        "prefix_sharing": prefix_sharing,
        "label": f"max-batch-tokens {batch_tokens}" + ("" if prefix_sharing else ", no prefix sharing"),
        # the evaluation itself; the process also starts Python, imports torch and loads the checkpoint
        "seconds": result["seconds"],
        "load_seconds": round(result["load_seconds"], 3),
        "command_seconds": summary["seconds"],
        "wall_seconds": round(wall, 3),
        "tokens_per_s": result["tokens_per_s"],
        "prompt_tokens": result["prompt_tokens"],
        "cached_prompt_tokens": result["cached_prompt_tokens"],
        "scored_tokens": result["scored_tokens"],
        "acc": metrics["acc"],
        "acc_stderr": metrics["acc_stderr"],
        "acc_norm": metrics["acc_norm"],
        "acc_norm_stderr": metrics["acc_norm_stderr"],
        "items": items,
        "command": " ".join(cmd),
    }


# -- comparison ----------------------------------------------------------------------------------------------------


def score_diff(a: dict, b: dict) -> dict:
    """Max |difference| between two runs' per-choice scores (absolute, and relative to the score), where the
    absolute one is, how many floats differ at all, and the choices whose greedy flag or token count differ."""
    if set(a) != set(b):
        raise RuntimeError(f"the runs scored different items: {sorted(set(a) ^ set(b))[:5]} ...")
    worst: tuple[float, str | None, int, float, float] = (0.0, None, 0, 0.0, 0.0)
    rel = 0.0
    differ = total = greedy_differ = tokens_differ = 0
    for key in sorted(a, key=lambda k: int(k[1:])):
        for j, (x, y) in enumerate(zip(a[key]["scores"], b[key]["scores"])):
            d = abs(x - y)
            total += 1
            differ += x != y
            rel = max(rel, d / max(abs(x), abs(y), 1e-30))
            if d > worst[0]:
                worst = (d, key, j, x, y)
        greedy_differ += sum(g != h for g, h in zip(a[key]["greedy"], b[key]["greedy"]))
        if "tokens" in a[key] and "tokens" in b[key]:
            tokens_differ += sum(m != n for m, n in zip(a[key]["tokens"], b[key]["tokens"]))
    d, key, j, x, y = worst
    return {
        "max_abs_diff": d,
        "max_rel_diff": rel,
        "at": None if key is None else {"id": key, "choice": j, "a": x, "b": y},
        "differing_floats": differ,
        "floats": total,
        "greedy_flags_differing": greedy_differ,
        "token_counts_differing": tokens_differ,
    }


def _public(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "items"}


def bench(args: argparse.Namespace, log) -> dict:
    import lm_eval
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    # lm-eval warns about every model passed as an object and every overridden default; none apply here.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    res: dict = {"versions": {**versions(), "lm_eval": lm_eval.__version__}}
    items = make_items(args.items)
    with tempfile.TemporaryDirectory(prefix="flood-eval-bench-") as tmp_str:
        tmp = Path(tmp_str)
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "datasets-cache")  # nothing left behind in ~/.cache
        tok = train_tokenizer([it["context"] + "".join(it["choices"]) for it in items], TOKENIZER_VOCAB)
        config = ling_config("moe", 1024)
        ling = build_ling(config)
        hf = build_hf(ling, "moe", None)
        model_dir = tmp / "model"
        save_checkpoint(ling, model_dir, tokenizer_json=tok.to_str())
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), eos_token=EOS_TOKEN)
        task, tasks_dir = write_task(items, tmp)
        lens = [len(tok.encode(it["context"]).ids) for it in items]
        choice_lens = [len(tok.encode(it["context"] + c).ids) - n for it, n in zip(items, lens) for c in it["choices"]]
        res["model"] = {
            "parameters": sum(p.numel() for p in ling.parameters()),
            "peer": type(hf).__name__,
            "tokenizer_vocab": tok.get_vocab_size(),
            "max_logit_diff": logit_diff(ling, hf, tok.get_vocab_size()),
        }
        res["settings"] = {
            "quick": args.quick,
            "items": len(items),
            "choices_per_item": 4,
            "context_tokens": {"min": min(lens), "mean": round(sum(lens) / len(lens), 1), "max": max(lens)},
            "choice_tokens": {
                "min": min(choice_lens),
                "mean": round(sum(choice_lens) / len(choice_lens), 1),
                "max": max(choice_lens),
            },
            "num_fewshot": 0,
            "threads": 1,
            "dtype": "float32",
            "lm_eval_batch_sizes": list(args.lm_eval_batches),
            "flood_runs": [{"max_batch_tokens": n, "prefix_sharing": p} for n, p in FLOOD_RUNS],
        }
        log(
            f"model {res['model']['parameters'] / 1e6:.1f}M parameters, HF {res['model']['peer']}, "
            f"max |logit diff| {res['model']['max_logit_diff']:.2e}; {len(items)} items, "
            f"context {res['settings']['context_tokens']} tokens"
        )

        run_lm_eval(hf, hf_tok, tasks_dir, 1, limit=4)  # warm-up: dataset cache, first-call costs
        warm = tmp / "warm.jsonl"
        warm.write_text("".join(json.dumps(it) + "\n" for it in items[:4]))
        run_flood(model_dir, warm, 1024, tmp / "warm-out.jsonl")  # native kernels built once
        lm_best: dict[int, dict] = {}
        fl_best: dict[tuple[int, bool], dict] = {}
        repeats_differ = 0  # floats that changed between rounds of one configuration
        for i in range(args.rounds):  # the sides alternate round by round; each configuration's fastest counts
            for b in args.lm_eval_batches:
                r = run_lm_eval(hf, hf_tok, tasks_dir, b)
                log(
                    f"  lm-eval batch size {b:<4d} {r['seconds']:7.2f} s  acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}"
                )
                if b in lm_best:
                    repeats_differ += score_diff(lm_best[b]["items"], r["items"])["differing_floats"]
                if b not in lm_best or r["seconds"] < lm_best[b]["seconds"]:
                    lm_best[b] = r
            for n, sharing in FLOOD_RUNS:
                r = run_flood(model_dir, task, n, tmp / f"flood-{n}-{sharing}-{i}.jsonl", prefix_sharing=sharing)
                log(
                    f"  flood, {r['label']}: {r['seconds']:.2f} s ({r['wall_seconds']:.2f} s whole process)  "
                    f"acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}"
                )
                key = (n, sharing)
                if key in fl_best:
                    repeats_differ += score_diff(fl_best[key]["items"], r["items"])["differing_floats"]
                if key not in fl_best or r["seconds"] < fl_best[key]["seconds"]:
                    fl_best[key] = r
        lm_runs = [lm_best[b] for b in args.lm_eval_batches]
        fl_runs = [fl_best[key] for key in FLOOD_RUNS]
        res["settings"]["rounds"] = args.rounds
        res["repeat_rounds_differing_floats"] = repeats_differ if args.rounds > 1 else None

    base = lm_runs[0]
    flood = fl_runs[FLOOD_MAIN]
    res["lm_eval"] = [_public(r) for r in lm_runs]
    res["flood"] = [_public(r) for r in fl_runs]
    res["flood_vs_lm_eval"] = {f"bs{r['batch_size']}": score_diff(flood["items"], r["items"]) for r in lm_runs}
    res["lm_eval_batch_size_effect"] = {
        f"bs1_vs_bs{r['batch_size']}": score_diff(base["items"], r["items"]) for r in lm_runs[1:]
    }
    # flood's own settings against the timed run: every float must be the same
    res["flood_settings_effect"] = {
        r["label"]: score_diff(flood["items"], r["items"]) for i, r in enumerate(fl_runs) if i != FLOOD_MAIN
    }
    res["metrics_equal"] = {
        f"bs{r['batch_size']}": {
            "acc": r["acc"] == flood["acc"],
            "acc_norm": r["acc_norm"] == flood["acc_norm"],
            "acc_stderr_abs_diff": abs(r["acc_stderr"] - flood["acc_stderr"]),
            "items_acc_differing": sum(
                r["items"][k]["correct"] != flood["items"][k]["correct"] for k in flood["items"]
            ),
        }
        for r in lm_runs
    }
    # above 1: flood is faster; the second figure counts only lm-eval's model calls
    res["ratio_lm_eval_over_flood_seconds"] = {
        f"bs{r['batch_size']}": round(r["seconds"] / flood["seconds"], 2) for r in lm_runs
    }
    plain = next(r for r in fl_runs if not r["prefix_sharing"])
    res["ratio_lm_eval_over_flood_no_prefix_sharing_seconds"] = {
        f"bs{r['batch_size']}": round(r["seconds"] / plain["seconds"], 2) for r in lm_runs
    }
    res["ratio_lm_eval_model_calls_over_flood_seconds"] = {
        f"bs{r['batch_size']}": round(r["loglikelihood_seconds"] / flood["seconds"], 2) for r in lm_runs
    }
    return res


def print_table(res: dict) -> None:
    v, m, s = res["versions"], res["model"], res["settings"]
    print()
    print(
        f"lingctl {v['lingctl']} ({v['lingctl_commit']}) flood eval vs lm-eval {v['lm_eval']}; transformers "
        f"{v['transformers']}, torch {v['torch']}, Python {v['python']}"
    )
    print(
        f"CPU {v['cpu']} ({v['cores']} cores); 1 compute thread each side; float32; 0-shot; "
        f"{s['rounds']} round(s), fastest shown"
    )
    print(
        f"model: tiny Ling MoE, {m['parameters'] / 1e6:.1f}M parameters; lm-eval runs HF {m['peer']} with the same "
        f"weights (max |logit diff| {m['max_logit_diff']:.1e}); tokenizer vocab {m['tokenizer_vocab']}"
    )
    ct, ch = s["context_tokens"], s["choice_tokens"]
    print(
        f"task: {s['items']} items x 4 choices; context {ct['min']}-{ct['max']} tokens (mean {ct['mean']}), "
        f"choices {ch['min']}-{ch['max']} tokens (mean {ch['mean']})"
    )
    head = f"{'side':54s} {'seconds':>8s} {'items/s':>8s} {'acc':>7s} {'acc_norm':>8s} {'lm-eval s / flood s':>20s}"
    print()
    print(head)
    print("-" * len(head))
    flood = res["flood"][FLOOD_MAIN]
    for r in res["lm_eval"]:
        ratio = res["ratio_lm_eval_over_flood_seconds"][f"bs{r['batch_size']}"]
        print(
            f"{'lm-eval HFLM, batch size ' + str(r['batch_size']):54s} {r['seconds']:8.2f} "
            f"{s['items'] / r['seconds']:8.1f} {r['acc']:7.4f} {r['acc_norm']:8.4f} {ratio:20.2f}"
        )
        calls = res["ratio_lm_eval_model_calls_over_flood_seconds"][f"bs{r['batch_size']}"]
        print(f"{'  of which model calls':54s} {r['loglikelihood_seconds']:8.2f} {'':35s} {calls:8.2f}")
    for r in res["flood"]:
        print(
            f"{'flood eval, ' + r['label']:54s} {r['seconds']:8.2f} "
            f"{s['items'] / r['seconds']:8.1f} {r['acc']:7.4f} {r['acc_norm']:8.4f}"
        )
        print(
            f"{'  whole process (start, load)':54s} {r['wall_seconds']:8.2f}   (checkpoint load {r['load_seconds']:.2f} s; "
            f"{r['tokens_per_s']:,.0f} tok/s)"
        )
    ratios = ", ".join(f"{k} {v}" for k, v in res["ratio_lm_eval_over_flood_no_prefix_sharing_seconds"].items())
    print(f"lm-eval s / flood s with flood's prefix sharing off: {ratios}")
    print(f"\nper-choice log-likelihoods, flood ({flood['label']}) vs lm-eval:")
    for key, d in res["flood_vs_lm_eval"].items():
        eq = res["metrics_equal"][key]
        print(
            f"  {key:5s} max |diff| {d['max_abs_diff']:.2e} (relative {d['max_rel_diff']:.1e}; "
            f"{d['differing_floats']}/{d['floats']} floats differ; {d['greedy_flags_differing']} greedy flags and "
            f"{d['token_counts_differing']} token counts differ); acc equal {eq['acc']}, acc_norm equal {eq['acc_norm']}"
        )
    for key, d in res["lm_eval_batch_size_effect"].items():
        print(
            f"lm-eval {key}: max |diff| {d['max_abs_diff']:.2e} (relative {d['max_rel_diff']:.1e}), "
            f"{d['differing_floats']}/{d['floats']} floats differ"
        )
    for label, d in res["flood_settings_effect"].items():
        print(
            f"flood {label} vs {flood['label']}: {d['differing_floats']}/{d['floats']} floats differ "
            f"(max |diff| {d['max_abs_diff']:.2e})"
        )
    if res["repeat_rounds_differing_floats"] is not None:
        print(
            f"{res['settings']['rounds']} rounds (fastest shown): {res['repeat_rounds_differing_floats']} floats "
            "changed between rounds of one configuration"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 items (under a minute)")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each configuration; the fastest counts")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", type=Path, default=None, help="also write the JSON results to this file")
    args = parser.parse_args()
    if args.quick:
        args.items = min(args.items, 40)
    args.lm_eval_batches = LM_EVAL_BATCHES
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = bench(args, log)
    if args.save is not None:
        args.save.write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
