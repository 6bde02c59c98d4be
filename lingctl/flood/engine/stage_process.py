"""One pipeline stage process of ``flood run --stages N``: it loads its slice of the layers, then receives each
micro-batch from the previous rank, runs its layers and passes the result on, in order, until the shutdown
comes through (``pipeline.py`` starts the stages and describes the whole). Started as
``python -m lingctl.flood.engine.pipeline`` with the arguments of ``StageArgs``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from lingctl.core.errors import LingctlError
from lingctl.flood.engine.forward import StageModel
from lingctl.flood.engine.segment_cache import KVPool
from lingctl.flood.engine.stage_link import (
    LINK_TIMEOUT,
    LOADED,
    SHUTDOWN,
    STEP,
    Pending,
    backend_for,
    loaded_key,
    recv_message,
    send_message,
    unpack_batch,
)
from lingctl.flood.weights.model_dir import ModelDir


@dataclass(frozen=True, slots=True)
class StageArgs:
    """What one stage process is started with: ``command`` writes it, ``parse`` reads it back."""

    model_dir: Path
    first: int  # the stage's layers: [first, last)
    last: int
    dtype: torch.dtype
    quantize: str | None
    kv_cache_tokens: int
    threads: int
    device: str
    parent_pid: int = field(default_factory=os.getpid)  # rank 0, which starts the stage

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "lingctl.flood.engine.pipeline", "--model-dir", str(self.model_dir)]
        cmd += ["--first", str(self.first), "--last", str(self.last)]
        cmd += ["--dtype", str(self.dtype).removeprefix("torch."), "--kv-cache-tokens", str(self.kv_cache_tokens)]
        cmd += ["--threads", str(self.threads), "--device", self.device, "--parent-pid", str(self.parent_pid)]
        return cmd + (["--quantize", self.quantize] if self.quantize is not None else [])

    @staticmethod
    def parse(argv: list[str] | None = None) -> StageArgs:
        parser = argparse.ArgumentParser(
            prog="python -m lingctl.flood.engine.pipeline",
            description="One pipeline stage of lingctl flood (started by rank 0).",
        )
        parser.add_argument("--model-dir", type=Path, required=True)
        parser.add_argument("--first", type=int, required=True)
        parser.add_argument("--last", type=int, required=True)
        parser.add_argument("--dtype", default="float32")
        parser.add_argument("--quantize", default=None)
        parser.add_argument("--kv-cache-tokens", type=int, required=True)
        parser.add_argument("--threads", type=int, default=1)
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--parent-pid", type=int, required=True)
        args = parser.parse_args(argv)
        return StageArgs(
            model_dir=args.model_dir,
            first=args.first,
            last=args.last,
            dtype=getattr(torch, args.dtype),
            quantize=args.quantize,
            kv_cache_tokens=args.kv_cache_tokens,
            threads=args.threads,
            device=args.device,
            parent_pid=args.parent_pid,
        )


def _exit_with_parent(parent_pid: int) -> None:
    """Rank 0 is our parent; once it is gone nothing will arrive, whatever gloo's timeout says."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        print(f"scheduler process {parent_pid} is gone; stage exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, LingctlError):
        return exc.message
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def serve(stage: StageModel, rank: int, world: int, dtype: torch.dtype, device: str) -> None:
    """Receive a micro-batch, run the layers, pass it on; in order, until the shutdown comes through."""
    nxt = (rank + 1) % world  # the last stage answers rank 0
    pending: Pending | None = None
    while True:
        msg = recv_message(rank - 1, dtype, device)
        if msg.kind == SHUTDOWN:
            if pending is not None:
                pending.wait()
            send_message(nxt, SHUTDOWN, msg.tag, device=device).wait()
            return
        assert msg.payload is not None  # every step message carries its batch
        out = stage.run(unpack_batch(msg.payload), msg.tensor if rank > 1 else None)
        # The previous micro-batch's send went on while this one was computed; one message in the air at most.
        if pending is not None:
            pending.wait()
        if stage.is_last:
            pending = send_message(0, STEP, msg.tag, tensor=out, device=device)
        else:
            pending = send_message(nxt, STEP, msg.tag, msg.payload, out, device=device)


def stage_main(argv: list[str] | None = None) -> int:
    args = StageArgs.parse(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ctrl-C reaches the whole process group; rank 0 decides how the pipeline stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"stage {rank}: %(message)s")
    _exit_with_parent(args.parent_pid)
    torch.set_num_threads(args.threads)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=LINK_TIMEOUT
    )
    try:
        stage = _load(args)
    except Exception as exc:
        store.set(loaded_key(rank), _report(exc))
        return 1
    store.set(loaded_key(rank), LOADED)
    dist.init_process_group(backend_for(args.device), store=store, rank=rank, world_size=world, timeout=LINK_TIMEOUT)
    try:
        serve(stage, rank, world, args.dtype, args.device)
    except Exception as exc:
        _report(exc)
        return 1
    dist.destroy_process_group()
    return 0


def _load(args: StageArgs) -> StageModel:
    """The stage's layers, and a KV pool for them."""
    model = ModelDir.open(args.model_dir).load(dtype=args.dtype, quantize=args.quantize, layers=(args.first, args.last))
    if torch.device(args.device).type != "cpu":
        model.to(args.device)
    mc = model.config
    layers = args.last - args.first
    pool = KVPool(layers, args.kv_cache_tokens + 1, mc.num_key_value_heads, mc.head_dim, args.dtype, device=args.device)
    return StageModel(model, pool, args.first, args.last)


def _report(exc: BaseException) -> str:
    """The traceback, then the one line rank 0 shows, on stderr; that line."""
    traceback.print_exc()
    line = _one_line(exc)
    print(line, file=sys.stderr, flush=True)
    return line
