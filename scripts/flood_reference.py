#!/usr/bin/env python3
"""Reference generations for ``tests/fixtures/flood``: Ling's own ``BailingMoeForCausalLM`` run on tiny
checkpoints that lingctl writes, so lingctl's inference engine can be tested against it token for token.

Three modes, each run in a different environment (see tests/fixtures/flood/README.md for the commands):

``build OUTDIR``
    In lingctl's venv. Builds the tiny checkpoints ``moe-normhead`` and ``moe-variant`` with lingctl's
    model code (seeded weights, biases and norm weights perturbed so every path matters) and writes each
    to ``OUTDIR/<name>/`` with ``save_checkpoint`` (float32, no tokenizer). Prints sizes and a preview of
    lingctl's own greedy output (token diversity, smallest top-2 logit gap).

``reference CKPTDIR... --modeling-dir DIR --out FILE.json``
    In a throwaway venv with transformers 4.46.x, WITHOUT lingctl. ``DIR`` holds Ling's published
    ``modeling_bailing_moe.py`` and ``configuration_bailing_moe.py``, unmodified. Loads each checkpoint with
    ``BailingMoeForCausalLM.from_pretrained`` (eager attention, float32), fails if any weight was not
    loaded from the file, and records greedy generation for fixed prompts (with the KV cache, cross-checked
    against a run without it), the float32 logits of the first generated step, and top-2 logit gaps.

``check FIXTURES_DIR``
    In lingctl's venv. Greedy decoding with lingctl's model by re-running the full sequence at every step
    (no cache at all), compared with ``reference.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import random
import re
import shlex
import sys
from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = 24
PROMPT_LENGTHS = (1, 2, 5, 17, 33, 40, 64, 100)
PROMPT_SEED = 20250407
FIRST_PROMPT_ID = 2  # ids 0 (pad) and 1 (eos) never occur in a prompt
LOGIT_DECIMALS = 6
BIAS_STD = 0.2  # init_weights leaves biases at zero; a seeded normal makes the bias path matter
NORM_STD = 0.1  # RMSNorm weights become 1 + NORM_STD * normal

# Everything not listed takes LingConfig's value; fields are LingConfig's (= config.json's) names.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    # Ling-lite's shape in miniature: NormHead, untied head, GQA (4 query heads on 2 KV heads), a dense first
    # layer, one shared expert, renormalised top-2 routing, no biases.
    "moe-normhead": {
        "seed": 1,
        "config": dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            num_experts=8,
            num_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            norm_head=True,
            tie_word_embeddings=False,
            use_qkv_bias=False,
            use_bias=False,
            norm_topk_prob=True,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=512,
            initializer_range=0.2,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
            torch_dtype="float32",
        ),
    },
    # The other paths: tied embeddings, plain head, QKV and output biases, no GQA, head_dim * heads != hidden,
    # MoE from the first layer, two shared experts (one MLP twice as wide), top-3 without renormalisation.
    "moe-variant": {
        "seed": 2,
        "config": dict(
            vocab_size=384,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=24,
            intermediate_size=96,
            num_experts=6,
            num_shared_experts=2,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            first_k_dense_replace=0,
            norm_head=False,
            tie_word_embeddings=True,
            use_qkv_bias=True,
            use_bias=True,
            norm_topk_prob=False,
            rope_theta=50000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            initializer_range=0.2,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
            torch_dtype="float32",
        ),
    },
}


def prompts_for(name: str, vocab_size: int) -> list[list[int]]:
    rng = random.Random(f"{PROMPT_SEED}:{name}")
    return [[rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_SCALAR_LIST = re.compile(r"\[\n\s*([^\[\]{}]*?)\n\s*\]")


def dumps(obj: Any) -> str:
    """Indented JSON with every list of numbers on one line (diffable, and a tenth of the lines)."""
    text = json.dumps(obj, indent=1)
    return _SCALAR_LIST.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text) + "\n"


def top2_gap(logits_V: Any) -> float:
    top = logits_V.float().topk(2).values
    return float(top[0] - top[1])


# -- build (lingctl's venv) -------------------------------------------------------------------------------


def build_model(name: str) -> Any:
    import torch

    from lingctl.model.config import LingConfig
    from lingctl.model.ling import LingForCausalLM

    spec = CHECKPOINTS[name]
    model = LingForCausalLM(LingConfig(**spec["config"]))
    generator = torch.Generator().manual_seed(spec["seed"])
    model.init_weights(generator)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, BIAS_STD, generator=generator)
            elif pname.endswith("norm.weight"):
                p.copy_(1.0 + NORM_STD * torch.randn(p.shape, generator=generator))
    return model.eval()


def greedy_full_recompute(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[Any]]:
    """Greedy decoding by running the whole sequence again at every step: no cache anywhere."""
    import torch

    ids = list(prompt)
    step_logits = []
    with torch.no_grad():
        for _ in range(steps):
            last = model(torch.tensor([ids])).logits[0, -1]
            step_logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt) :], step_logits


def cmd_build(args: argparse.Namespace) -> None:
    from lingctl.model.checkpoint import save_checkpoint

    out = Path(args.outdir)
    for name in CHECKPOINTS:
        model = build_model(name)
        directory = out / name
        save_checkpoint(model, directory)
        sizes = {p.name: p.stat().st_size for p in sorted(directory.iterdir())}
        total = sum(sizes.values())
        print(f"{name}: {directory} {total / 2**20:.2f} MiB {sizes}")
        if total >= 2 * 2**20:
            sys.exit(f"{name}: {total} bytes, over the 2 MiB budget")
        if args.no_preview:
            continue
        distinct: set[int] = set()
        gaps = []
        for prompt in prompts_for(name, model.config.vocab_size):
            generated, step_logits = greedy_full_recompute(model, prompt, MAX_NEW_TOKENS)
            distinct.update(generated)
            gaps.append(min(top2_gap(x) for x in step_logits))
            print(f"  prompt len {len(prompt):3d}: {generated}  min top-2 gap {gaps[-1]:.4g}")
        print(f"  {len(distinct)} distinct generated tokens; smallest top-2 gap {min(gaps):.4g}")


# -- reference (transformers 4.46 venv, no lingctl) -------------------------------------------------------

_PACKAGE = "bailing_moe_reference"


def import_reference(modeling_dir: Path) -> tuple[Any, Any, Any]:
    """Ling's two files imported as they are published. ``modeling_bailing_moe.py`` imports its config with
    ``from .configuration_bailing_moe import ...``, so the directory is registered as a package here
    (instead of adding an ``__init__.py`` to it); it is also put on sys.path for an absolute import."""
    modeling_dir = modeling_dir.resolve()
    for file in ("modeling_bailing_moe.py", "configuration_bailing_moe.py"):
        if not (modeling_dir / file).is_file():
            sys.exit(f"--modeling-dir {modeling_dir}: no {file}")
    sys.path.insert(0, str(modeling_dir))
    spec = importlib.machinery.ModuleSpec(_PACKAGE, None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(modeling_dir)]
    sys.modules[_PACKAGE] = package
    configuration = importlib.import_module(f"{_PACKAGE}.configuration_bailing_moe")
    modeling = importlib.import_module(f"{_PACKAGE}.modeling_bailing_moe")
    return configuration.BailingMoeConfig, modeling.BailingMoeForCausalLM, modeling


def load_reference_model(ckpt: Path, config_cls: Any, model_cls: Any, modeling: Any) -> Any:
    import torch
    from safetensors.torch import load_file

    config = config_cls.from_json_file(str(ckpt / "config.json"))
    model, info = model_cls.from_pretrained(
        str(ckpt), config=config, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        sys.exit(f"{ckpt}: weights not loaded exactly from the file: {problems}")
    model.eval()
    for layer in model.model.layers:
        if type(layer.attention) is not modeling.BailingMoeAttention:
            sys.exit(f"{ckpt}: expected eager BailingMoeAttention, got {type(layer.attention).__name__}")
    # Every tensor of the model must be the file's, bit for bit (a tied head is the embedding itself).
    stored = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    expected = set(stored)
    if config.tie_word_embeddings:
        expected.add("lm_head.weight")
        if model.lm_head.weight.data_ptr() != model.model.word_embeddings.weight.data_ptr():
            sys.exit(f"{ckpt}: tie_word_embeddings is set but lm_head is not tied to the embeddings")
    if set(state) != expected:
        sys.exit(
            f"{ckpt}: model tensors differ from the file's: only in model "
            f"{sorted(set(state) - expected)}, only in file {sorted(expected - set(state))}"
        )
    for key, tensor in state.items():
        source = stored["model.word_embeddings.weight" if key not in stored else key]
        if tensor.dtype != torch.float32 or not torch.equal(tensor, source):
            sys.exit(f"{ckpt}: tensor {key} is not the file's (newly initialised or converted)")
    return model


def hf_generate(model: Any, prompt: list[int], use_cache: bool) -> tuple[list[int], list[Any]]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            num_beams=1,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=use_cache,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, len(prompt) :].tolist()
    if out.sequences[0, : len(prompt)].tolist() != prompt or len(generated) != MAX_NEW_TOKENS:
        sys.exit(f"generate returned {out.sequences.tolist()} for prompt {prompt}")
    logits = [x[0] for x in out.logits]
    if [int(x.argmax()) for x in logits] != generated:
        sys.exit("generated tokens are not the argmax of the returned logits")
    return generated, logits


def cmd_reference(args: argparse.Namespace) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls, modeling = import_reference(Path(args.modeling_dir))
    result: dict[str, Any] = {
        "produced_with": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "modeling_code": args.modeling_code,
            "command": args.command or " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        },
        "settings": {
            "max_new_tokens": MAX_NEW_TOKENS,
            "greedy": True,
            "batch_size": 1,
            "padding": False,
            "eos_stops_generation": False,
            "attn_implementation": "eager",
            "dtype": "float32",
            "logit_decimals": LOGIT_DECIMALS,
            "first_logits": "float32 logits at the last prompt position (the first generated token's step)",
            "top2_gaps": "per generated step, largest minus second-largest logit",
        },
        "checkpoints": {},
    }
    for ckpt in map(Path, args.checkpoints):
        name = ckpt.name
        model = load_reference_model(ckpt, config_cls, model_cls, modeling)
        vocab = model.config.vocab_size
        cases = []
        for prompt in prompts_for(name, vocab):
            cached, logits = hf_generate(model, prompt, use_cache=True)
            uncached, logits_nc = hf_generate(model, prompt, use_cache=False)
            gaps = [round(top2_gap(x), LOGIT_DECIMALS) for x in logits]
            case: dict[str, Any] = {
                "prompt": prompt,
                "generated": cached,
                "cache_agrees": cached == uncached,
                "first_logits": [round(v, LOGIT_DECIMALS) for v in logits[0].float().tolist()],
                "min_top2_gap": min(gaps),
                "top2_gaps": gaps,
            }
            if cached != uncached:
                case["generated_no_cache"] = uncached
                print(f"WARNING {name}: cached and uncached generation disagree for prompt len {len(prompt)}")
            # Logits of every step, KV cache against full recomputation (the argmax may not be what differs).
            case["cache_vs_no_cache_max_abs_logit_diff"] = max(
                float((a - b).abs().max()) for a, b in zip(logits, logits_nc)
            )
            cases.append(case)
            print(
                f"{name} len {len(prompt):3d}: {cached} min gap {case['min_top2_gap']:.4g} "
                f"cache agrees {case['cache_agrees']}"
            )
        result["checkpoints"][name] = {
            "weights_sha256": sha256_file(ckpt / "model.safetensors"),
            "config_sha256": sha256_file(ckpt / "config.json"),
            "cases": cases,
        }
    Path(args.out).write_text(dumps(result))
    print(f"wrote {args.out}")


# -- check (lingctl's venv) -------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> None:
    import torch

    from lingctl.model.checkpoint import load_checkpoint

    root = Path(args.fixtures)
    reference = json.loads((root / "reference.json").read_text())
    ok = True
    for name, entry in reference["checkpoints"].items():
        directory = root / name
        if sha256_file(directory / "model.safetensors") != entry["weights_sha256"]:
            sys.exit(f"{name}: model.safetensors is not the file the reference was produced from")
        model = load_checkpoint(directory).eval()
        worst = 0.0
        for case in entry["cases"]:
            generated, step_logits = greedy_full_recompute(model, case["prompt"], len(case["generated"]))
            diff = float((step_logits[0] - torch.tensor(case["first_logits"])).abs().max())
            worst = max(worst, diff)
            same = generated == case["generated"]
            ok &= same
            print(
                f"{name} len {len(case['prompt']):3d}: tokens {'match' if same else 'DIFFER'}, "
                f"first-step logits max abs diff {diff:.3g}"
            )
            if not same:
                print(f"  reference {case['generated']}\n  lingctl   {generated}")
        print(f"{name}: max abs first-step logit difference {worst:.3g}")
    if not ok:
        sys.exit("lingctl's greedy output differs from the reference")
    print("all cases match")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("build", help="write the tiny checkpoints with lingctl")
    p.add_argument("outdir")
    p.add_argument("--no-preview", action="store_true", help="skip lingctl's greedy preview")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("reference", help="run Ling's BailingMoeForCausalLM on the checkpoints")
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories; each directory's name names it")
    p.add_argument(
        "--modeling-dir",
        required=True,
        help="directory with Ling's modeling_bailing_moe.py and configuration_bailing_moe.py",
    )
    p.add_argument(
        "--modeling-code",
        default="unknown",
        help="where the modeling code came from (repo@commit path), recorded in the output",
    )
    p.add_argument("--command", default=None, help="the command line to record (default: sys.argv)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_reference)
    p = sub.add_parser("check", help="compare lingctl's uncached greedy decoding with reference.json")
    p.add_argument("fixtures")
    p.set_defaults(func=cmd_check)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
