"""The end-to-end tour behind `make demo`: each tool adds its part as it lands.

1. `lingctl doctor`; later, a storage round trip (put, list, get, verify) through a local S3-compatible
   server (`rclone serve s3`) that this script starts on 127.0.0.1 and stops again.
2. `lingctl train`: the `small` Ling MoE preset (16 fine-grained experts top-2 + a shared expert) trained
   for about two minutes on the built-in corpus (the Python standard library's sources), loss falling,
   ending with a Ling checkpoint in runs/demo-small.
3. `lingctl babel`: that checkpoint synced to the local S3 server (full CRC verification, config.json
   committed last), listed, and verified again by sampling.
4. `lingctl pcache`: a plan for Ling-plus on 16 nodes x 8 ranks (one node's disk at half speed) compared
   with rank-0 writers and DCP's default planner; the training state of that checkpoint (written through
   pcache's planner and writer) uploaded to the S3 server marker last, and `pcache status` before and
   after.
5. `lingctl flood`: 48 completion requests (OpenAI batch format, a shared instruction prefix, outputs of
   8-64 tokens) and 2 chat requests (through the checkpoint's Ling chat template) answered by that
   checkpoint, a few answers shown.
6. `lingctl flood eval`: both checkpoints of the run scored on two small tasks made from standard-library
   code (which line comes next, multiple choice; how a line ends, generation): a table and a PNG of each
   task's accuracy against training tokens.
7. `lingctl timer`: a short `tiny` training run traced with `timer run`, then `timer diagnose` (its
   verdict) and `timer export` (a Perfetto timeline).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from lingctl.core.local_s3 import serve_s3


def lingctl(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "lingctl", *args]
    print(f"\n$ lingctl {' '.join(args)}", flush=True)
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0:
        sys.exit(f"demo: 'lingctl {' '.join(args)}' exited with {rc}")


def main() -> None:
    lingctl("doctor")

    run = Path("runs/demo-small")
    # The demo's own directories; nothing else is touched.
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(run.with_name(run.name + ".eval"), ignore_errors=True)
    lingctl(
        "train",
        "--preset",
        "small",
        "--steps",
        "160",
        "--max-seconds",
        "150",
        "--eval-every",
        "40",
        "--save-every",
        "80",
        "--out",
        str(run),
    )
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in steps if r["event"] == "step"]
    print(
        "\nloss by step:",
        ", ".join(f"{s}: {loss:.2f}" for s, loss in losses[:: max(1, len(losses) // 8)]),
        f"... {losses[-1][0]}: {losses[-1][1]:.2f}",
    )
    latest = json.loads((run / "latest.json").read_text())
    checkpoint = run / latest["path"]
    print(f"checkpoint (a Ling / Hugging Face bailing_moe directory): {checkpoint}")

    with tempfile.TemporaryDirectory(prefix="lingctl-demo-") as tmp:
        with serve_s3(Path(tmp) / "s3", buckets=["demo"]) as server:
            print(f"\nlocal S3 server (rclone serve s3) at {server.endpoint}, pid {server.pid}", flush=True)
            env = {**os.environ, **server.env()}
            lingctl("doctor", "--probe", "s3://demo/roundtrip", "--probe-size", "64MiB", env=env)
            target = f"s3://demo/checkpoints/{checkpoint.name}"
            lingctl(
                "babel", "sync", str(checkpoint), target, "--verify", "full", "--commit-last", "config.json", env=env
            )
            lingctl("babel", "ls", target, "--recursive", env=env)
            lingctl("babel", "verify", str(checkpoint), target, "--mode", "sampled", env=env)
            pcache(checkpoint, run, env)
    print("\nthe S3 server is stopped and its files removed.")
    flood(checkpoint, run)
    evaluate(run)
    timer()
    print("\ndemo finished.")


def pcache(checkpoint: Path, run: Path, env: dict[str, str]) -> None:
    """Checkpoint planning for a big job, then the flash tier on the run just trained."""
    bandwidth = ",".join(["2"] * 15 + ["1"])
    lingctl(
        "pcache",
        "plan",
        "--model",
        "ling-plus",
        "--nodes",
        "16",
        "--ranks-per-node",
        "8",
        "--tp",
        "8",
        "--pp",
        "2",
        "--ep",
        "4",
        "--node-bandwidth",
        bandwidth,
    )
    lingctl("pcache", "status", str(run))
    state = checkpoint / "state"
    lingctl("pcache", "upload", str(state), "--to", f"s3://demo/runs/{run.name}/{checkpoint.name}/state", env=env)
    lingctl("pcache", "status", str(state), env=env)


def timer() -> None:
    """A traced training run: every Python process of the command writes its trace under runs/demo-timer."""
    out = Path("runs/demo-timer")
    shutil.rmtree(out, ignore_errors=True)
    lingctl(
        "timer",
        "run",
        "--out",
        str(out),
        "--",
        sys.executable,
        "-m",
        "lingctl",
        "train",
        "--preset",
        "tiny",
        "--steps",
        "60",
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--out",
        str(out / "run"),
    )
    lingctl("timer", "diagnose", str(out))
    lingctl("timer", "export", str(out), "-o", str(out / "trace.json"))
    print(f"open {out / 'trace.json'} in https://ui.perfetto.dev or chrome://tracing to see the timeline")


def flood(checkpoint: Path, run: Path) -> None:
    """Batch inference with the checkpoint just trained: code-completion prompts that share a prefix."""
    prefix = '"""Helpers for parsing and formatting text, written in the style of the standard library."""\n\n'
    starts = [
        "import os",
        "def main(",
        "class Parser",
        "    def __init__(self",
        "for line in",
        "if __name__",
        "return ",
        "raise ValueError(",
        "with open(",
        "    except ",
        "from collections import",
        "while ",
    ]
    batch = run / "flood-batch.jsonl"
    with open(batch, "w") as f:
        for i in range(48):
            body = {
                "model": "demo-small",
                "prompt": prefix + starts[i % len(starts)],
                "max_tokens": 8 + (i * 7) % 57,
                "temperature": 0 if i % 2 == 0 else 0.7,
                "seed": i,
            }
            f.write(
                json.dumps({"custom_id": f"req-{i:02d}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )
        # Chat requests go through the checkpoint's own chat template (Ling's <role>HUMAN</role> format).
        for i, question in enumerate(["Write a function that reverses a list.", "How do I read a file?"]):
            body = {
                "model": "demo-small",
                "messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": question}],
                "max_tokens": 16,
            }
            f.write(
                json.dumps({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
                + "\n"
            )
    out = run / "flood-output.jsonl"
    for stale in (out, run / "flood-errors.jsonl", run / "flood-output.jsonl.manifest.json"):
        stale.unlink(missing_ok=True)
    lingctl(
        "flood",
        "run",
        str(batch),
        "--model",
        str(checkpoint),
        "-o",
        str(out),
        "--errors",
        str(run / "flood-errors.jsonl"),
    )
    answers = {}
    for line in out.read_text().splitlines():
        r = json.loads(line)
        choice = r["response"]["body"]["choices"][0]
        answers[r["custom_id"]] = choice["message"]["content"] if "message" in choice else choice["text"]
    for cid in ("req-00", "req-01", "req-02"):
        print(f"{cid}: {starts[int(cid[-2:]) % len(starts)]!r} -> {answers[cid]!r}")
    print(f"chat-0: 'Write a function that reverses a list.' -> {answers['chat-0']!r}")


def evaluate(run: Path) -> None:
    """Every checkpoint of the run on two small tasks made from a standard-library module's lines."""
    source = Path(sysconfig.get_paths()["stdlib"]) / "email" / "_header_value_parser.py"
    lines = [ln for ln in source.read_text().splitlines() if 12 <= len(ln.strip()) <= 60]
    rng = random.Random(0)
    tasks = run.with_name(run.name + ".eval-tasks")
    tasks.mkdir(exist_ok=True)
    with open(tasks / "next_line.jsonl", "w") as f:
        for i in rng.sample(range(3, len(lines)), 60):
            # Distractors of about the same length, so a choice's summed log-likelihood is not a length contest.
            near = [ln for ln in lines if ln != lines[i] and abs(len(ln) - len(lines[i])) <= 4]
            others = rng.sample(near if len(near) >= 3 else [ln for ln in lines if ln != lines[i]], 3)
            choices = ["\n" + c for c in [lines[i], *others]]
            rng.shuffle(choices)
            context = "\n".join(lines[i - 3 : i])
            f.write(
                json.dumps(
                    {"id": f"l{i}", "context": context, "choices": choices, "answer": choices.index("\n" + lines[i])}
                )
                + "\n"
            )
    with open(tasks / "line_end.jsonl", "w") as f:
        for i in rng.sample(range(len(lines)), 30):
            cut = len(lines[i]) * 2 // 3
            prompt, answer = lines[i][:cut], lines[i][cut:]
            f.write(
                json.dumps({"id": f"e{i}", "prompt": prompt, "answer": answer, "stop": ["\n"], "max_tokens": 24}) + "\n"
            )
    lingctl("flood", "eval", str(tasks / "next_line.jsonl"), str(tasks / "line_end.jsonl"), "--model", str(run))
    print(f"\n{run.name}.eval/scores.md:\n" + (run.with_name(run.name + ".eval") / "scores.md").read_text())


if __name__ == "__main__":
    main()
