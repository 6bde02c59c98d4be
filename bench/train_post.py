"""lingctl's packed SFT and DPO against TRL (Hugging Face ``trl``): the same model, the same token ids.

A Ling MoE (the ``small`` preset: hidden 256, 4 layers, 16 experts top-2 plus a shared one, NormHead) with
seeded random weights is saved as a lingctl checkpoint (its transformers code beside the weights, Ling's chat
template in tokenizer_config.json). A second checkpoint, the DPO policy, is the first with noise added to every
weight matrix (N(0, 1) x half the matrix's std), so that the policy differs from the reference and the DPO
logits beta * ((pc - rc) - (pr - rr)) are not all zero (about +-1 on this data).

Data: ``--examples`` SFT lines ``{"prompt", "completion"}`` and as many DPO lines ``{"prompt", "chosen",
"rejected"}`` of random words from a small vocabulary, whose token lengths (prompt + answer + end-of-text)
follow a log-normal distribution clipped to 30..2000 tokens. lingctl reads the JSONL into token ids and loss
masks (``lingctl.train.post.examples.read_examples``), and TRL gets exactly those ids and masks, pre-tokenized:
``SFTTrainer`` a dataset of ``input_ids`` + ``completion_mask`` (with ``completion_only_loss=True``),
``DPOTrainer`` one of ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` (the columns its own tokenization step
produces; the subclass here only skips that step, which would tokenize text again).

1. Exactness, fp32, eval mode, no dropout, one example (or pair) per batch:
   - SFT: ``SFTTrainer.compute_loss`` (the mean NLL of the completion tokens) against lingctl's
     ``-example_logps / trained tokens``;
   - DPO: ``DPOTrainer.compute_loss`` with ``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1, nll]``, beta 0.1
     (TRL 1.x dropped ``rpo_alpha``; its documented replacement is the ``"sft"`` loss type with a weight: the
     mean NLL of the chosen answer's tokens), the reference a frozen copy of the starting checkpoint; the
     policy's summed log-probabilities of the chosen and rejected answers as that call logs them
     (``logps/chosen``, ``logps/rejected``), the reference's from ``DPOTrainer.compute_ref_log_probs``. lingctl:
     ``example_logps`` of policy and reference, and -log sigmoid(beta * ((pc - rc) - (pr - rr))) + nll * NLL.
   Reported: the largest absolute and relative difference of each quantity.
2. Speed and memory, each side in its own process (peak RSS from ``os.wait4``), the same number of optimizer
   steps (AdamW, fp32), the same number of torch threads (``os.cpu_count()``, what ``lingctl train`` uses):
   - TRL ``SFTTrainer.train()`` and ``DPOTrainer.train()`` with their defaults (right-padded batches of
     ``--batch-size`` examples or pairs, no packing, the reference forward in every DPO step), except fp32
     instead of bf16 and no gradient checkpointing (the Ling code does not support it); real (non-padding)
     tokens per second over the steps after ``--warmup``;
   - ``lingctl train sft`` / ``train dpo`` (packed rows of ``--seq-len`` tokens): tokens/s from its run's
     metrics.jsonl over the steps after ``--warmup`` (and its own ``tokens_per_s``, which counts every step),
     plus the process's wall clock. lingctl computes the reference log-probabilities once before its training
     loop: that pass is in its wall clock, not in its tokens/s. The batch is matched in examples as closely as
     packing allows: lingctl takes round(batch x rows / examples) rows per step, rows and examples counted by
     packing the data as ``lingctl train`` does.

The model's NormHead stays on. TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) multiplies by
``lm_head.weight`` directly and so skips it; both checkpoints store ``lm_head`` with unit-norm columns, on which
NormHead is the identity (to 1e-7), so both sides compute the same function at the start.

    /path/to/venv/bin/python bench/train_post.py [--quick] [--repeats N] [--only exact|speed] [--json PATH] [--keep]

TRL's step times vary several-fold with the longest example of each random batch (its padded length), and
other load on the machine shows in both sides' figures: ``--repeats`` runs the speed part N times, the sides
alternating, and keeps each side's faster run; each side's per-step seconds are in the ``--json`` report.

The venv: ``python -m venv V && V/bin/pip install torch==2.13.0`` then, with a constraints file holding
``torch==2.13.0``, ``V/bin/pip install -c constraints.txt trl transformers accelerate datasets`` and
``V/bin/pip install -c constraints.txt -e .``; written against TRL 1.16 (transformers 5.25). Everything runs
offline, under a temporary directory. On 2 idle cores a full run takes about 6 minutes, ``--quick`` (24 examples,
3 timed steps) about 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

SEED = 0
MIN_LEN, MAX_LEN = 30, 2000  # tokens of one sequence (prompt + answer + end-of-text)
LEN_MEDIAN, LEN_SIGMA = 250.0, 0.8  # the log-normal of sequence lengths, before clipping
POLICY_NOISE = 0.5  # the DPO policy: each weight matrix plus this x its std x N(0, 1)
GOAL_DPO = 3.0  # lingctl packed DPO / TRL padded DPO, real tokens/s
GOAL_SFT = 1.5  # lingctl packed SFT / TRL SFT
MiB = 1 << 20
# Compared one by one: the SFT loss per example; per pair the DPO loss, its logit beta * ((pc - rc) - (pr - rr))
# (TRL's logged rewards/margins), and the summed log-probabilities of policy and reference.
QUANTITIES = ("sft_loss", "dpo_loss", "dpo_margin", "policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected")


@dataclasses.dataclass
class Settings:
    examples: int = 256
    # TRL: examples (SFT) or pairs (DPO) per step. 6: one lingctl row of 2048 (SFT) or 4096 (DPO) tokens holds
    # about as many of this data's examples or pairs.
    batch_size: int = 6
    steps: int = 16  # timed optimizer steps
    warmup: int = 2  # optimizer steps before the timed ones
    exact_n: int = 64  # examples and pairs compared one by one
    beta: float = 0.1
    nll_weight: float = 0.05
    preset: str = "small"
    threads: int = os.cpu_count() or 1
    seq_len_sft: int = 2048
    seq_len_dpo: int = 4096
    sft_rows: int = 1  # lingctl rows per step (set from packing)
    dpo_rows: int = 1
    sft_rows_per_example: float = 0.0
    dpo_rows_per_pair: float = 0.0


# -- data ---------------------------------------------------------------------------------------------------


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct lowercase words of 2-4 syllables: letters only, so a word with its leading space is
    one piece for the byte-level pre-tokenizer and a text's token count is the sum of its words'."""
    onsets, vowels = "bdfgklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 4))))
    return sorted(words)


class Texts:
    """Random-word texts of a chosen token length under a trained tokenizer."""

    def __init__(self, words: list[str], weights: list[float], tok: Any, rng: random.Random) -> None:
        self.words, self.weights, self.rng = words, weights, rng
        self.first = {w: len(tok.encode(w).ids) for w in words}  # at the start of a text
        self.inner = {w: len(tok.encode(" " + w).ids) for w in words}  # after a space

    def text(self, tokens: int, *, leading_space: bool) -> str:
        """About ``tokens`` tokens (exact but for the last word), at least one word."""
        out: list[str] = []
        n = 0
        while n < tokens or not out:
            w = self.rng.choices(self.words, self.weights)[0]
            n += self.inner[w] if (out or leading_space) else self.first[w]
            out.append(w)
        return (" " if leading_space else "") + " ".join(out)


def seq_lengths(rng: random.Random, n: int) -> list[int]:
    mu = math.log(LEN_MEDIAN)
    return [min(MAX_LEN, max(MIN_LEN, round(rng.lognormvariate(mu, LEN_SIGMA)))) for _ in range(n)]


def split(total: int, rng: random.Random) -> tuple[int, int]:
    """(prompt tokens, answer words' tokens) of a sequence of ``total`` tokens; the answer's end-of-text token
    is the one left over."""
    prompt = max(5, round(total * rng.uniform(0.1, 0.5)))
    return prompt, max(5, total - prompt - 1)


def write_data(work: Path, s: Settings) -> tuple[Any, dict[str, list[int]]]:
    """The tokenizer, sft.jsonl and dpo.jsonl; returns the tokenizer and the drawn sequence lengths."""
    from lingctl.model.tokenizer import train_tokenizer

    rng = random.Random(SEED)
    words = pseudo_words(rng, 3000)
    weights = [1.0 / (i + 1) for i in range(len(words))]  # Zipf
    corpus = [" ".join(rng.choices(words, weights, k=200)) for _ in range(2000)]
    tok = train_tokenizer(corpus, 8192)
    texts = Texts(words, weights, tok, rng)
    drawn: dict[str, list[int]] = {"sft": seq_lengths(rng, s.examples), "dpo": []}
    with (work / "sft.jsonl").open("w") as f:
        for total in drawn["sft"]:
            p, a = split(total, rng)
            line = {"prompt": texts.text(p, leading_space=False), "completion": texts.text(a, leading_space=True)}
            f.write(json.dumps(line) + "\n")
    chosen_totals, rejected_totals = seq_lengths(rng, s.examples), seq_lengths(rng, s.examples)
    with (work / "dpo.jsonl").open("w") as f:
        for tc, tr in zip(chosen_totals, rejected_totals):
            p, a = split(tc, rng)
            r = max(5, min(MAX_LEN, max(tr, p + 6)) - p - 1)
            drawn["dpo"] += [p + a + 1, p + r + 1]
            line = {
                "prompt": texts.text(p, leading_space=False),
                "chosen": texts.text(a, leading_space=True),
                "rejected": texts.text(r, leading_space=True),
            }
            f.write(json.dumps(line) + "\n")
    return tok, drawn


def unit_head_columns(model: Any) -> None:
    """lm_head.weight with each hidden column of unit L2 norm over the vocabulary: NormHead is then the identity."""
    with torch.no_grad():
        w = model.lm_head.weight
        w.div_(torch.linalg.vector_norm(w, ord=2, dim=0, keepdim=True))


def write_checkpoints(work: Path, tok: Any, s: Settings) -> None:
    """``base`` (the SFT model, the DPO reference and the start of every training run) and ``policy``."""
    from lingctl.model.checkpoint import save_checkpoint
    from lingctl.model.hf_files import LING_CHAT_TEMPLATE
    from lingctl.model.ling import LingForCausalLM
    from lingctl.model.presets import preset
    from lingctl.model.tokenizer import eos_id

    cfg = preset(s.preset)
    cfg.vocab_size = tok.get_vocab_size()
    cfg.eos_token_id = cfg.pad_token_id = eos_id(tok)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, s.seq_len_dpo)
    model = LingForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(SEED))
    unit_head_columns(model)
    save_checkpoint(model, work / "base", tokenizer_json=tok.to_str())
    template = json.loads((work / "base" / "tokenizer_config.json").read_text()).get("chat_template")
    assert template == LING_CHAT_TEMPLATE, "the checkpoint's chat template is not lingctl's own"
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * (POLICY_NOISE * float(p.std())))
    unit_head_columns(model)
    save_checkpoint(model, work / "policy", tokenizer_json=tok.to_str())


def lingctl_tokens(work: Path) -> dict[str, Any]:
    """lingctl's token ids and loss masks of both files: what TRL is given."""
    from lingctl.train.post.examples import read_examples

    sft = read_examples(work / "sft.jsonl", work / "base", kind="sft")
    dpo = read_examples(work / "dpo.jsonl", work / "base", kind="dpo")
    rows_sft = [{"input_ids": e.ids, "completion_mask": [int(m) for m in e.loss_mask]} for e in sft]
    rows_dpo = []
    for pair in dpo:
        c, r = pair.chosen, pair.rejected
        p = c.loss_mask.index(True)
        ok = (
            r.loss_mask.index(True) == p
            and c.ids[:p] == r.ids[:p]
            and all(c.loss_mask[p:])
            and all(r.loss_mask[p:])
            and not any(c.loss_mask[:p] + r.loss_mask[:p])
        )
        if not ok:
            raise SystemExit(f"{pair.where}: not a shared prompt plus fully trained answers, as TRL's collator needs")
        rows_dpo.append({"prompt_ids": c.ids[:p], "chosen_ids": c.ids[p:], "rejected_ids": r.ids[p:]})
    return {"sft": rows_sft, "dpo": rows_dpo}


def match_batches(work: Path, s: Settings) -> None:
    """lingctl rows per step for about ``batch_size`` examples (pairs), from how its packing fills rows."""
    from lingctl.runs.train_config import Stage
    from lingctl.train.post.examples import read_examples
    from lingctl.train.post.packing import pack

    for kind, seq_len in (("sft", s.seq_len_sft), ("dpo", s.seq_len_dpo)):
        items = read_examples(work / f"{kind}.jsonl", work / "base", kind=kind)
        rows = len(pack(items, [Stage(seq_len, None)]))
        per_item = rows / len(items)
        setattr(s, f"{kind}_rows", max(1, round(s.batch_size * per_item)))
        setattr(s, "sft_rows_per_example" if kind == "sft" else "dpo_rows_per_pair", per_item)


def describe_lengths(lengths: list[int]) -> str:
    xs = sorted(lengths)
    p95 = xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]
    return f"mean {statistics.fmean(xs):.0f}, median {statistics.median(xs):.0f}, p95 {p95}, max {xs[-1]} (n={len(xs)})"


# -- processes ----------------------------------------------------------------------------------------------


def run_process(cmd: list[str], work: Path, name: str) -> dict[str, Any]:
    """Run ``cmd`` to completion; its exit code, wall time, peak RSS (its own, from wait4) and output."""
    out_path, err_path = work / f"{name}.out", work / f"{name}.err"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", ""), "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if v != ""}
    with out_path.open("wb") as out, err_path.open("wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    return {
        "rc": os.waitstatus_to_exitcode(status),
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(usage.ru_maxrss * 1024 / MiB, 1),  # ru_maxrss is in KiB on Linux
        "stdout": out_path.read_text(errors="replace"),
        "stderr_tail": err_path.read_text(errors="replace")[-2500:],
    }


def run_side(side: str, work: Path) -> dict[str, Any]:
    """This script as one side (``--side``) in its own process; what the side wrote, plus the process figures."""
    proc = run_process([sys.executable, str(Path(__file__).resolve()), "--side", side, "--work", str(work)], work, side)
    result_path = work / f"{side}.json"
    result = json.loads(result_path.read_text()) if proc["rc"] == 0 and result_path.exists() else {}
    return {**result, **{k: proc[k] for k in ("rc", "wall_s", "peak_rss_mib")}, "error": _error(proc)}


def _error(proc: dict[str, Any]) -> str | None:
    if proc["rc"] == 0:
        return None
    lines = [line for line in proc["stderr_tail"].splitlines() if line.strip()]
    return f"exit {proc['rc']}: " + " | ".join(lines[-4:])


def load_settings(work: Path) -> Settings:
    return Settings(**json.loads((work / "settings.json").read_text()))


def write_result(work: Path, side: str, result: dict[str, Any]) -> None:
    (work / f"{side}.json").write_text(json.dumps(result))


# -- lingctl side -------------------------------------------------------------------------------------------


def side_lingctl_exact(work: Path, s: Settings) -> dict[str, Any]:
    """lingctl's per-example SFT losses and per-pair DPO log-probabilities and losses (packed)."""
    from lingctl.model.checkpoint import load_checkpoint
    from lingctl.train.post.examples import read_examples
    from lingctl.train.post.logps import example_logps

    torch.set_num_threads(s.threads)
    sft = read_examples(work / "sft.jsonl", work / "base", kind="sft")[: s.exact_n]
    pairs = read_examples(work / "dpo.jsonl", work / "base", kind="dpo")[: s.exact_n]
    base, policy = load_checkpoint(work / "base").eval(), load_checkpoint(work / "policy").eval()
    logp = example_logps(base, sft, seq_len=s.seq_len_sft).to(torch.float64)
    n_sft = torch.tensor([e.n_loss for e in sft], dtype=torch.float64)
    chosen, rejected = [p.chosen for p in pairs], [p.rejected for p in pairs]
    pc = example_logps(policy, chosen, seq_len=s.seq_len_sft).to(torch.float64)
    pr = example_logps(policy, rejected, seq_len=s.seq_len_sft).to(torch.float64)
    rc = example_logps(base, chosen, seq_len=s.seq_len_sft).to(torch.float64)
    rr = example_logps(base, rejected, seq_len=s.seq_len_sft).to(torch.float64)
    n_chosen = torch.tensor([e.n_loss for e in chosen], dtype=torch.float64)
    dpo = -torch.nn.functional.logsigmoid(s.beta * ((pc - rc) - (pr - rr))) + s.nll_weight * (-pc / n_chosen)
    return {
        "sft_loss": (-logp / n_sft).tolist(),
        "dpo_loss": dpo.tolist(),
        "dpo_margin": (s.beta * ((pc - rc) - (pr - rr))).tolist(),
        "policy_chosen": pc.tolist(),
        "policy_rejected": pr.tolist(),
        "ref_chosen": rc.tolist(),
        "ref_rejected": rr.tolist(),
    }


def lingctl_train(kind: str, work: Path, s: Settings, extra: list[str]) -> dict[str, Any]:
    """``lingctl train sft|dpo`` from the base checkpoint, in its own process."""
    run_dir = work / f"run-{kind}"
    shutil.rmtree(run_dir, ignore_errors=True)
    seq_len, rows = (s.seq_len_sft, s.sft_rows) if kind == "sft" else (s.seq_len_dpo, s.dpo_rows)
    cmd = [sys.executable, "-m", "lingctl", "train", kind, "--init-from", str(work / "base")]
    cmd += ["--data", str(work / f"{kind}.jsonl"), "--out", str(run_dir), "--steps", str(s.warmup + s.steps)]
    cmd += ["--batch-size", str(rows), "--seq-len", str(seq_len), "--json"]
    if kind == "dpo":
        cmd += ["--beta", str(s.beta), "--nll-weight", str(s.nll_weight)]
    proc = run_process(cmd + extra, work, f"lingctl-{kind}")
    done = _last_json(proc["stdout"])
    result: dict[str, Any] = {
        "cmd": " ".join(cmd[1:] + extra),
        **{k: proc[k] for k in ("rc", "wall_s", "peak_rss_mib")},
        "error": _error(proc),
        "tokens_per_s_reported": done.get("tokens_per_s"),
        "missing": [k for k in ("tokens_per_s", "tokens", "steps") if k not in done] if proc["rc"] == 0 else [],
        "rows_per_step": rows,
        "examples_per_step": rows / (s.sft_rows_per_example if kind == "sft" else s.dpo_rows_per_pair),
    }
    result.update(_steady(run_dir / "metrics.jsonl", s.warmup))
    return result


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return {}


def _steady(metrics: Path, warmup: int) -> dict[str, Any]:
    """Real tokens/s over the steps after ``warmup``, from the run's step records (cumulative ``tokens``,
    per-step ``step_s``)."""
    if not metrics.exists():
        return {"tokens_per_s": None}
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"]
    steps.sort(key=lambda r: r["step"])
    timed = steps[warmup:]
    if not timed or warmup < 1 or len(steps) <= warmup or "step_s" not in timed[0]:
        return {"tokens_per_s": None, "timed_steps": len(timed)}
    tokens = timed[-1]["tokens"] - steps[warmup - 1]["tokens"]
    seconds = sum(r["step_s"] for r in timed)
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "timed_steps": len(timed),
        "tokens_per_step": round(tokens / len(timed), 1),
        "step_s": [r["step_s"] for r in steps],
    }


# -- TRL side -----------------------------------------------------------------------------------------------


def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)


def trl_classes() -> tuple[type, type]:
    """SFTTrainer and DPOTrainer subclasses: the DPO one takes a dataset already in the columns its own
    tokenization step writes (``prompt_ids``, ``chosen_ids``, ``rejected_ids``); both count each optimizer
    step's real and padded tokens."""
    from trl import DPOTrainer, SFTTrainer

    class Counting:
        tokens: list[tuple[int, int]]

        def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            mask = inputs["attention_mask"]
            self.tokens.append((int(mask.sum()), mask.numel()))
            return super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]

    class SFT(Counting, SFTTrainer):
        tokens: list[tuple[int, int]] = []

    class DPO(Counting, DPOTrainer):
        tokens: list[tuple[int, int]] = []

        def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
            return dataset

    return SFT, DPO


def trl_args(kind: str, work: Path, s: Settings, **kw: Any) -> Any:
    """TRL's config for ``kind``: its defaults but fp32, no gradient checkpointing, no truncation, no saving."""
    from trl import DPOConfig, SFTConfig

    if "loss_weights" not in {f.name for f in dataclasses.fields(DPOConfig)}:
        raise SystemExit("this benchmark needs TRL 1.x: DPOConfig.loss_weights and the 'sft' loss type")
    common: dict[str, Any] = dict(
        output_dir=str(work / f"trl-{kind}-out"),
        bf16=False,
        gradient_checkpointing=False,
        max_length=None,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=SEED,
        per_device_train_batch_size=s.batch_size,
        router_aux_loss_coef=0.0,
    )
    common.update(kw)
    if kind == "sft":
        return SFTConfig(completion_only_loss=True, **common)
    return DPOConfig(beta=s.beta, loss_type=["sigmoid", "sft"], loss_weights=[1.0, s.nll_weight], **common)


def trl_datasets(work: Path, n: int | None = None) -> tuple[Any, Any]:
    from datasets import Dataset

    data = json.loads((work / "tokens.json").read_text())
    sft, dpo = data["sft"][:n], data["dpo"][:n]
    sft_ds = Dataset.from_dict({k: [r[k] for r in sft] for k in ("input_ids", "completion_mask")})
    dpo_ds = Dataset.from_dict({k: [r[k] for r in dpo] for k in ("prompt_ids", "chosen_ids", "rejected_ids")})
    return sft_ds, dpo_ds


def side_trl_exact(work: Path, s: Settings) -> dict[str, Any]:
    """TRL's per-example SFT losses and per-pair DPO losses and log-probabilities, one per batch."""
    from transformers import AutoTokenizer

    torch.set_num_threads(s.threads)
    SFT, DPO = trl_classes()
    sft_ds, dpo_ds = trl_datasets(work, s.exact_n)
    tok = AutoTokenizer.from_pretrained(work / "base")
    sft = SFT(model=load_hf(work / "base"), args=trl_args("sft", work, s), train_dataset=sft_ds, processing_class=tok)
    assert len(sft.train_dataset) == len(sft_ds), "SFTTrainer dropped examples"
    sft.model.eval()
    out: dict[str, list[float]] = {k: [] for k in QUANTITIES}
    with torch.no_grad():
        for row in sft.train_dataset:
            out["sft_loss"].append(float(sft.compute_loss(sft.model, sft.data_collator([row]))))
    del sft
    dpo = DPO(
        model=load_hf(work / "policy"),
        ref_model=load_hf(work / "base"),
        args=trl_args("dpo", work, s),
        train_dataset=dpo_ds,
        processing_class=tok,
    )
    dpo.model.eval()
    metrics = dpo._metrics["eval"]
    with torch.no_grad():
        for row in dpo.train_dataset:
            batch = dpo.data_collator([row])
            out["dpo_loss"].append(float(dpo.compute_loss(dpo.model, batch)))
            out["dpo_margin"].append(metrics["rewards/margins"][-1])
            out["policy_chosen"].append(metrics["logps/chosen"][-1])
            out["policy_rejected"].append(metrics["logps/rejected"][-1])
            rc, rr = dpo.compute_ref_log_probs(dpo.ref_model, batch)
            out["ref_chosen"].append(float(rc[0]))
            out["ref_rejected"].append(float(rr[0]))
    return out


def side_trl_train(kind: str, work: Path, s: Settings) -> dict[str, Any]:
    """TRL's own training loop for ``warmup + steps`` optimizer steps; real tokens/s after the warm-up."""
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(s.threads)
    SFT, DPO = trl_classes()
    sft_ds, dpo_ds = trl_datasets(work)
    tok = AutoTokenizer.from_pretrained(work / "base")
    args = trl_args(kind, work, s, max_steps=s.warmup + s.steps, logging_steps=s.warmup + s.steps)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    if kind == "sft":
        trainer = SFT(model=load_hf(work / "base"), args=args, train_dataset=sft_ds, processing_class=tok)
    else:
        ref = load_hf(work / "base")
        trainer = DPO(
            model=load_hf(work / "base"), ref_model=ref, args=args, train_dataset=dpo_ds, processing_class=tok
        )
    trainer.tokens = []
    trainer.add_callback(Clock())
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MiB
    began = time.perf_counter()
    trainer.train()
    loop_s = time.perf_counter() - began
    real = [t for t, _ in trainer.tokens[s.warmup :]]
    padded = [p for _, p in trainer.tokens[s.warmup :]]
    seconds = ends[-1] - ends[s.warmup - 1] if s.warmup >= 1 else ends[-1] - began
    return {
        "tokens_per_s": round(sum(real) / seconds, 1),
        "timed_steps": len(real),
        "tokens_per_step": round(statistics.fmean(real), 1),
        "padded_per_step": round(statistics.fmean(padded), 1),
        "examples_per_step": s.batch_size,
        "loop_s": round(loop_s, 2),
        "rss_before_training_mib": round(rss_start, 1),
        "step_s": [round(b - a, 3) for a, b in zip([began, *ends], ends)],
        "optim": str(trainer.args.optim),
        "attn": str(trainer.model.config._attn_implementation),
    }


# -- report -------------------------------------------------------------------------------------------------


def compare(lingctl: dict[str, Any], trl: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key in QUANTITIES:
        a, b = lingctl.get(key), trl.get(key)
        if not a or not b or len(a) != len(b):
            rows.append({"quantity": key, "n": 0})
            continue
        diffs = [abs(x - y) for x, y in zip(a, b)]
        rel = [d / max(abs(x), 1e-12) for d, x in zip(diffs, a)]
        rows.append(
            {"quantity": key, "n": len(a), "max_abs": max(diffs), "max_rel": max(rel), "mean": statistics.fmean(a)}
        )
    return rows


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "trl", "accelerate", "datasets", "lingctl"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _fmt(x: Any, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(r: dict[str, Any]) -> None:
    s = r["settings"]
    print("versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()))
    print(
        f"settings: preset {s['preset']}, {s['examples']} examples / pairs, torch threads {s['threads']}, "
        f"beta {s['beta']}, NLL weight {s['nll_weight']}, {s['warmup']} warm-up + {s['steps']} timed steps, "
        f"TRL batch {s['batch_size']}, lingctl seq-len {s['seq_len_sft']} (SFT) / {s['seq_len_dpo']} (DPO)"
    )
    for kind, text in r["lengths"].items():
        print(f"{kind} sequence tokens: {text}")
    print(
        f"batch per step: TRL {s['batch_size']} examples (SFT) / pairs (DPO), padded; lingctl {s['sft_rows']} row(s) of "
        f"{s['seq_len_sft']} tokens = {s['sft_rows'] / s['sft_rows_per_example']:.1f} examples on average (SFT), "
        f"{s['dpo_rows']} row(s) of {s['seq_len_dpo']} = {s['dpo_rows'] / s['dpo_rows_per_pair']:.1f} pairs (DPO)"
    )
    if r.get("exact"):
        print(f"\nexactness (fp32, one example or pair per batch; lingctl packed), {r['exact_error'] or 'ok'}")
        print(f"{'quantity':<18}{'n':>5}{'mean':>14}{'max |d|':>12}{'max rel d':>12}  (relative to |lingctl's|)")
        for row in r["exact"]:
            if not row["n"]:
                print(f"{row['quantity']:<18}{'-':>5}")
                continue
            print(
                f"{row['quantity']:<18}{row['n']:>5}{row['mean']:>14.5f}{row['max_abs']:>12.3e}{row['max_rel']:>12.3e}"
            )
    if r.get("speed"):
        print("\nspeed (real tokens/s after the warm-up steps; peak RSS per process)")
        print(
            f"{'side':<22}{'ex/step':>8}{'real tok/step':>14}{'padded':>9}{'tok/s':>9}{'own tok/s':>10}{'wall s':>8}{'RSS MiB':>9}"
        )
        for name, v in r["speed"].items():
            print(
                f"{name:<22}{_fmt(v.get('examples_per_step'), '.1f'):>8}{_fmt(v.get('tokens_per_step')):>14}"
                f"{_fmt(v.get('padded_per_step')):>9}{_fmt(v.get('tokens_per_s')):>9}"
                f"{_fmt(v.get('tokens_per_s_reported')):>10}{_fmt(v.get('wall_s'), '.1f'):>8}"
                f"{_fmt(v.get('peak_rss_mib')):>9}"
            )
            if v.get("error"):
                print(f"  {name}: {v['error'][:600]}")
            if v.get("missing"):
                print(f"  {name}: its done record lacks {', '.join(v['missing'])}")
            if v.get("rss_before_training_mib"):
                print(
                    f"  {name}: peak RSS before training (imports, models, data): {v['rss_before_training_mib']:,.0f} MiB"
                )
        for line in r["ratios"]:
            print(line)


def ratios(speed: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for kind, goal in (("dpo", GOAL_DPO), ("sft", GOAL_SFT)):
        a, b = speed.get(f"lingctl {kind} (packed)", {}), speed.get(f"TRL {kind} (padded)", {})
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            x = a["tokens_per_s"] / b["tokens_per_s"]
            met = "met" if x >= goal else "not met"
            lines.append(f"{kind.upper()} tokens/s lingctl / TRL: {x:.2f}x (goal >= {goal}x: {met})")
        else:
            lines.append(f"{kind.upper()} tokens/s lingctl / TRL: - (a side did not run)")
        if a.get("peak_rss_mib") and b.get("peak_rss_mib"):
            lines.append(
                f"{kind.upper()} peak RSS: lingctl {a['peak_rss_mib']:,.0f} MiB, TRL {b['peak_rss_mib']:,.0f} MiB "
                f"({a['peak_rss_mib'] / b['peak_rss_mib']:.2f}x)"
            )
    return lines


def prepare(work: Path, s: Settings) -> dict[str, str]:
    tok, drawn = write_data(work, s)
    write_checkpoints(work, tok, s)
    (work / "tokens.json").write_text(json.dumps(lingctl_tokens(work)))
    match_batches(work, s)
    (work / "settings.json").write_text(json.dumps(dataclasses.asdict(s)))
    tokens = json.loads((work / "tokens.json").read_text())
    return {
        "sft (drawn)": describe_lengths(drawn["sft"]),
        "sft (lingctl ids)": describe_lengths([len(r["input_ids"]) for r in tokens["sft"]]),
        "dpo (drawn, each side)": describe_lengths(drawn["dpo"]),
        "dpo (lingctl ids, each side)": describe_lengths(
            [len(r["prompt_ids"]) + len(r[k]) for r in tokens["dpo"] for k in ("chosen_ids", "rejected_ids")]
        ),
    }


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    s = Settings()
    if args.quick:
        s.examples, s.steps, s.exact_n, s.batch_size = 24, 3, 24, 4
    s.examples = args.examples or s.examples
    s.steps = args.steps or s.steps
    s.batch_size = args.batch_size or s.batch_size
    s.exact_n = min(args.exact_n or s.exact_n, s.examples)
    os.environ["BENCH_THREADS"] = str(s.threads)
    report: dict[str, Any] = {"versions": versions(), "work": str(work)}
    report["lengths"] = prepare(work, s)
    report["settings"] = dataclasses.asdict(s)
    if args.only in (None, "exact"):
        ours, theirs = run_side("lingctl-exact", work), run_side("trl-exact", work)
        report["exact"] = compare(ours, theirs)
        errors = [f"{name}: {v['error']}" for name, v in (("lingctl", ours), ("TRL", theirs)) if v.get("error")]
        report["exact_error"] = "; ".join(errors) or None
    if args.only in (None, "speed"):
        speed: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeats):  # the sides alternate; each keeps its faster run
            for kind in ("sft", "dpo"):
                runs = {
                    f"TRL {kind} (padded)": lambda kind=kind: run_side(f"trl-{kind}", work),
                    f"lingctl {kind} (packed)": lambda kind=kind: lingctl_train(kind, work, s, args.lingctl_arg),
                }
                for name, run in runs.items():
                    result = run()
                    if (result.get("tokens_per_s") or 0) >= (speed.get(name, {}).get("tokens_per_s") or 0):
                        speed[name] = result
        report["speed"] = speed
        report["ratios"] = ratios(speed)
    return report


SIDES = {
    "lingctl-exact": side_lingctl_exact,
    "trl-exact": side_trl_exact,
    "trl-sft": lambda work, s: side_trl_train("sft", work, s),
    "trl-dpo": lambda work, s: side_trl_train("dpo", work, s),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="24 examples, TRL batch 4, 3 timed steps")
    ap.add_argument("--examples", type=int, help="SFT examples and DPO pairs [256]")
    ap.add_argument("--batch-size", type=int, help="TRL examples (pairs) per step; lingctl rows matched [6]")
    ap.add_argument("--steps", type=int, help="timed optimizer steps, after 2 warm-up steps [16]")
    ap.add_argument("--exact-n", type=int, help="examples and pairs compared one by one [64]")
    ap.add_argument("--only", choices=("exact", "speed"), help="run one part")
    ap.add_argument("--repeats", type=int, default=1, help="speed runs per side; the faster counts [1]")
    ap.add_argument("--lingctl-arg", action="append", default=[], help="extra argument for lingctl train")
    ap.add_argument("--json", type=Path, help="also write the report as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (data, checkpoints, runs)")
    ap.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        s = load_settings(args.work)
        write_result(args.work, args.side, SIDES[args.side](args.work, s))
        return
    work = Path(tempfile.mkdtemp(prefix="lingctl-train-post-"))
    try:
        report = run_all(args, work)
        print_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if args.keep:
            print(f"\nkept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
