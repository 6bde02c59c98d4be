"""The vLLM side of bench/flood_vs_vllm.py, run with the vLLM virtual environment's Python (``make bench-vllm``).

It loads the checkpoint once with vLLM's offline ``LLM`` API, warms up, then answers commands from stdin, one
JSON object a line, so that the benchmark can alternate between flood and vLLM without reloading either:

    {"cmd": "run"}   generate the workload once; answers {"seconds", "generated_tokens", "outputs"}
    {"cmd": "quit"}  exit

Answers go to the stdout the driver was started with; vLLM's own logging (which it writes to stdout) is sent to
stderr, which the benchmark keeps as the log of how vLLM configured itself. Threads are vLLM's business: the
benchmark sets VLLM_CPU_OMP_THREADS_BIND and friends in the environment and lets vLLM apply them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    # vLLM logs to stdout; keep a private copy of it for the answers and point fd 1 (inherited by the engine
    # and worker processes vLLM spawns) at stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON: {prompts, new_tokens, warmup_prompts, warmup_new}")
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.workload) as f:
        work = json.load(f)

    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        trust_remote_code=True,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=True,
        # Every repetition sends the same prompts: a prefix cache would answer the later ones from
        # the first one's KV, which flood's engine (built afresh per run) cannot.
        enable_prefix_caching=False,
        seed=args.seed,
    )
    load_seconds = time.perf_counter() - started

    def generate(prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return seconds, [list(o.outputs[0].token_ids) for o in outs]

    started = time.perf_counter()
    generate(work["warmup_prompts"], work["warmup_new"])
    warmup_seconds = time.perf_counter() - started

    config = llm.llm_engine.vllm_config
    sched, cache, comp = config.scheduler_config, config.cache_config, config.compilation_config
    ready = {
        "ready": True,
        "load_seconds": round(load_seconds, 2),
        "warmup_seconds": round(warmup_seconds, 2),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_chunked_prefill": sched.enable_chunked_prefill,
            "max_model_len": config.model_config.max_model_len,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "block_size": cache.block_size,
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "compilation_mode": str(comp.mode),
            "compilation_backend": comp.backend,
            "executor": config.parallel_config.distributed_executor_backend,
            "dtype": str(config.model_config.dtype),
        },
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_", "LD_PRELOAD"))},
    }
    answers.write(json.dumps(ready) + "\n")

    for line in sys.stdin:
        cmd = json.loads(line).get("cmd")
        if cmd == "run":
            seconds, outputs = generate(work["prompts"], work["new_tokens"])
            answers.write(
                json.dumps({"seconds": seconds, "generated_tokens": sum(map(len, outputs)), "outputs": outputs}) + "\n"
            )
        elif cmd == "quit":
            break
        else:
            answers.write(json.dumps({"error": f"unknown command {cmd!r}"}) + "\n")


if __name__ == "__main__":
    main()
