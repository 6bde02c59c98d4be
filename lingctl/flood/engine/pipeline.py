"""Pipeline-parallel stages: the model's layers split across N stage processes fed by this one.

Flood (Ling report, offline inference) runs fully pipeline-parallel with a many-to-one process-to-accelerator
mapping: one extra process, the scheduler, feeds the first stage. Here rank 0 is the scheduler (the engine
loop in this process) and ranks 1..N run contiguous slices of the layers. A micro-batch (one engine step) goes

    rank 0 --pickled StepBatch--> stage 1 --batch + hidden [T, D]--> ... --> stage N --logits [R, V]--> rank 0

over ``torch.distributed`` point-to-point messages, so with ``depth = N`` steps in flight every stage has
work. Each stage handles micro-batches strictly in order: the scheduler relies on it, since a later
micro-batch may read k/v that an earlier one wrote at the same layer.

A message is an int64 header ``[kind, tag, payload bytes, rows, cols]``, then the payload (uint8) and the
tensor ``[rows, cols]`` when they are not empty. Shutdown travels the same path as the steps, so it arrives
after every step already sent and comes back to rank 0 as the last message.

Timeouts: a stage may wait indefinitely for its next micro-batch (the engine reads and tokenizes all requests
before the first step, which can take long), so the process group's own timeout is long and the bounds are
enforced here: rank 0 waits at most ``timeout_s`` for the stages to load and for each step's logits, and
notices at once when a stage process exits; a stage exits when rank 0 (its parent) is gone.

The stage processes run ``python -m lingctl.flood.engine.pipeline`` (``stage_main`` below).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lingctl.core.errors import LingctlError
from lingctl.core.net import free_port
from lingctl.flood.engine.forward import StageModel, StepBatch
from lingctl.flood.engine.segment_cache import KVPool
from lingctl.flood.weights.model_dir import ModelDir

log = logging.getLogger(__name__)

STEP, SHUTDOWN = 1, 0
HEADER_LEN = 5  # kind, tag, payload bytes, rows, cols
# Bounds every gloo wait, including a stage's wait for its next micro-batch; see the module docstring.
LINK_TIMEOUT = timedelta(days=7)
STOP_GRACE_S = 5.0  # after shutdown, how long stages get to exit before they are terminated
POLL_S = 0.05


def split_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous ``(first, last)`` layer ranges, sizes differing by at most one. The larger slices go to the
    first stages: the last stage also runs the final norm and the LM head."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers across {stages} stages: each stage needs a layer")
    base, extra = divmod(num_layers, stages)
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(stages):
        last = first + base + (1 if i < extra else 0)
        out.append((first, last))
        first = last
    return out


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# -- messages -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Message:
    kind: int
    tag: int
    payload: torch.Tensor | None  # uint8
    tensor: torch.Tensor | None  # [rows, cols]


@dataclass(slots=True)
class Pending:
    """An isend'ed message: the works, and the buffers they read from, kept alive until the works finish."""

    works: list[dist.Work]
    buffers: list[torch.Tensor]

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def send_message(
    dst: int,
    kind: int,
    tag: int,
    payload: torch.Tensor | None = None,
    tensor: torch.Tensor | None = None,
    device: str = "cpu",
) -> Pending:
    nbytes = 0 if payload is None else payload.numel()
    rows, cols = (0, 0) if tensor is None else tuple(tensor.shape)
    header = torch.tensor([kind, tag, nbytes, rows, cols], dtype=torch.int64, device=device)
    buffers = [header]
    if payload is not None and nbytes:
        buffers.append(payload)
    if tensor is not None and rows * cols:
        buffers.append(tensor.contiguous())
    return Pending([_isend(b, dst) for b in buffers], buffers)


def _isend(buffer: torch.Tensor, dst: int) -> dist.Work:
    work = dist.isend(buffer, dst)
    assert work is not None  # None only for a rank outside the group; every stage is in the default group
    return work


def recv_message(src: int, dtype: torch.dtype, device: str = "cpu") -> Message:
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, src)
    kind, tag, nbytes, rows, cols = header.tolist()
    payload = tensor = None
    if nbytes:
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.recv(payload, src)
    if rows * cols:
        tensor = torch.empty(rows, cols, dtype=dtype, device=device)
        dist.recv(tensor, src)
    elif kind == STEP:  # e.g. logits [0, V] of a step that samples nothing
        tensor = torch.empty(rows, cols, dtype=dtype, device=device)
    return Message(kind, tag, payload, tensor)


def pack_batch(batch: StepBatch, device: str = "cpu") -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8).to(
        device
    )


def unpack_batch(payload: torch.Tensor) -> StepBatch:
    return pickle.loads(payload.cpu().numpy().data)


# -- rank 0 ---------------------------------------------------------------------------------------------


def _with_last_line(what: str, stderr: Path) -> str:
    """``what``, then the last non-empty line the stage wrote to stderr (its one-line error), if any."""
    try:
        with open(stderr, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return f"{what}: {lines[-1]}" if lines else what


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the processes to exit, then terminate, then kill what is left."""
    deadline = time.monotonic() + grace_s
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None and sig is not None:
                p.send_signal(sig)
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return
        deadline = time.monotonic() + 2.0


def _cleanup(procs: list[subprocess.Popen], log_dir: str) -> None:
    """Last resort when a runner is dropped without close() or the interpreter exits: no stage outlives us."""
    _stop_processes(procs, 0.0)
    shutil.rmtree(log_dir, ignore_errors=True)


def _cpu_count() -> int:
    # The affinity mask, not os.cpu_count(): in a container or under taskset the machine's count oversubscribes.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class PipelineRunner:
    """``engine.StageRunner`` over ``stages`` stage processes; this process is rank 0 (the scheduler)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        stages: int,
        dtype: torch.dtype,
        quantize: str | None,
        kv_cache_tokens: int,
        threads_per_stage: int | None = None,
        timeout_s: float = 600,
        device: str = "cpu",
    ) -> None:
        mdir = ModelDir.open(Path(model_dir))
        self.split = split_layers(mdir.config.num_hidden_layers, stages)
        if dist.is_initialized():
            raise LingctlError(
                "cannot start pipeline stages: this process already has a torch.distributed process group"
            )
        self.depth = stages
        self.device = device
        self.timeout_s = timeout_s
        self._closed = False
        self._failed: str | None = None
        self._procs: list[subprocess.Popen] = []
        self._log_dir = tempfile.mkdtemp(prefix="lingctl-pipeline-")
        self._logs = [Path(self._log_dir) / f"stage{i + 1}.stderr" for i in range(stages)]
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, self._log_dir)
        self._tags: deque[int] = deque()
        self._sends: deque[Pending] = deque()
        self._results: queue.Queue[Message | BaseException] = queue.Queue()
        self._wanted = threading.Semaphore(0)
        self._receiver: threading.Thread | None = None
        self._group = False

        world = stages + 1
        port = free_port()
        threads = threads_per_stage or max(1, _cpu_count() // stages)
        try:
            store = dist.TCPStore(
                "127.0.0.1", port, world, is_master=True, wait_for_workers=False, timeout=LINK_TIMEOUT
            )
            for rank, (first, last) in enumerate(self.split, start=1):
                env = dict(
                    os.environ,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    WORLD_SIZE=str(world),
                    RANK=str(rank),
                    OMP_NUM_THREADS=str(threads),
                )
                cmd = [
                    sys.executable,
                    "-m",
                    "lingctl.flood.engine.pipeline",
                    "--model-dir",
                    str(mdir.path),
                    "--first",
                    str(first),
                    "--last",
                    str(last),
                    "--dtype",
                    str(dtype).removeprefix("torch."),
                    "--kv-cache-tokens",
                    str(kv_cache_tokens),
                    "--threads",
                    str(threads),
                    "--device",
                    device,
                    "--parent-pid",
                    str(os.getpid()),
                ]
                if quantize is not None:
                    cmd += ["--quantize", quantize]
                with open(self._logs[rank - 1], "wb") as err:
                    self._procs.append(
                        subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
                    )
            self._wait_loaded(store)
            dist.init_process_group(backend_for(device), store=store, rank=0, world_size=world, timeout=LINK_TIMEOUT)
            self._group = True
        except BaseException:
            self._abort()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="pipeline-results", daemon=True)
        self._receiver.start()
        log.info("pipeline: %d stages, layers %s, %d threads each", stages, self.split, threads)

    def _wait_loaded(self, store: dist.TCPStore) -> None:
        deadline = time.monotonic() + self.timeout_s
        loaded: set[int] = set()
        while len(loaded) < self.depth:
            for i, p in enumerate(self._procs):
                rank = i + 1
                if rank in loaded:
                    continue
                key = f"lingctl/loaded/{rank}"
                if store.check([key]):
                    status = store.get(key).decode()
                    if status != "ok":
                        raise self._stage_error(rank, f"failed to start: {status}")
                    loaded.add(rank)
                elif p.poll() is not None:
                    raise self._stage_error(
                        rank, _with_last_line(f"{_exit_status(p.returncode)} while loading", self._logs[i])
                    )
            if time.monotonic() > deadline:
                waiting = sorted(set(range(1, self.depth + 1)) - loaded)
                raise LingctlError(
                    f"pipeline stage(s) {waiting} did not load within {self.timeout_s:.0f} s",
                    hint="raise the timeout for large checkpoints or slow disks",
                )
            time.sleep(POLL_S)

    def _stage_error(self, rank: int, what: str) -> LingctlError:
        first, last = self.split[rank - 1]
        return LingctlError(f"pipeline stage {rank} (layers {first}-{last - 1}) {what}")

    def _receive_loop(self) -> None:
        """Receives the last stage's messages, one per permit: a blocked recv is bounded by the link timeout,
        so this thread only waits while a step (or the shutdown) is on its way."""
        src = self.depth
        while True:
            self._wanted.acquire()
            try:
                msg = recv_message(src, torch.float32, self.device)
            except BaseException as exc:  # a stage died or the group was torn down
                self._results.put(exc)
                return
            self._results.put(msg)
            if msg.kind == SHUTDOWN:
                return

    def _dead_stage(self) -> LingctlError | None:
        """Every stage that has exited, in one line. A stage killed by a signal comes first: its neighbours
        then exit with link errors, which are the consequence, not the cause."""
        dead = [(p.returncode >= 0, i) for i, p in enumerate(self._procs) if p.poll() is not None]
        if not dead:
            return None
        return LingctlError(
            "; ".join(
                self._stage_error(
                    i + 1, _with_last_line(_exit_status(self._procs[i].returncode), self._logs[i])
                ).message
                for _, i in sorted(dead)
            )
        )

    def _fail(self, error: LingctlError) -> LingctlError:
        self._failed = error.message
        self._abort()
        return error

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise LingctlError(f"the pipeline has failed: {self._failed}")
        if self._closed:
            raise LingctlError("the pipeline is closed")

    # -- StageRunner ----------------------------------------------------------------------------------
    def submit(self, batch: StepBatch) -> None:
        self._check_usable()
        payload = pack_batch(batch, self.device)
        try:
            self._sends.append(send_message(1, STEP, batch.tag, payload, device=self.device))
        except RuntimeError as exc:
            raise self._fail(self._dead_stage() or LingctlError(f"pipeline link to stage 1 failed: {exc}")) from None
        self._tags.append(batch.tag)
        self._wanted.release()

    def result(self) -> torch.Tensor:
        self._check_usable()
        if not self._tags:
            raise RuntimeError("result() called with no step in flight")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                item = self._results.get(timeout=POLL_S)
                break
            except queue.Empty:
                dead = self._dead_stage()
                if dead is not None:
                    raise self._fail(dead) from None
                if time.monotonic() > deadline:
                    raise self._fail(
                        LingctlError(
                            f"pipeline returned no result within {self.timeout_s:.0f} s (step {self._tags[0]})"
                        )
                    ) from None
        if isinstance(item, BaseException):
            # The link broke because a stage died: give its exit code and last words once the OS reports it.
            end = time.monotonic() + 2.0
            dead = self._dead_stage()
            while dead is None and time.monotonic() < end:
                time.sleep(POLL_S)
                dead = self._dead_stage()
            raise self._fail(dead or LingctlError(f"pipeline link failed: {item}")) from None
        tag = self._tags.popleft()
        if item.kind != STEP or item.tag != tag:
            raise self._fail(
                LingctlError(
                    f"pipeline returned message kind {item.kind} for step {item.tag} "
                    f"while step {tag} was the oldest in flight"
                )
            )
        self._sends.popleft().wait()  # stage 1 has long received it
        assert item.tensor is not None  # the last stage always answers a step with its logits
        return item.tensor

    def close(self) -> None:
        """Send the shutdown down the pipe, let the stages finish what is in flight and exit, then tear down.
        Idempotent; processes that do not exit within a few seconds are terminated."""
        if self._closed:
            return
        self._closed = True
        if self._failed is None and self._group and self._dead_stage() is None:
            try:
                self._sends.append(send_message(1, SHUTDOWN, -1, device=self.device))
            except RuntimeError as exc:
                log.warning("pipeline shutdown: %s", exc)
            else:
                # Steps still in flight are computed first; the shutdown's echo is the last message back.
                self._wanted.release()
                deadline = time.monotonic() + self.timeout_s
                while (
                    self._receiver is not None
                    and self._receiver.is_alive()
                    and self._dead_stage() is None
                    and time.monotonic() < deadline
                ):
                    self._receiver.join(timeout=POLL_S)
        self._abort(grace_s=STOP_GRACE_S)

    def _abort(self, grace_s: float = 0.0) -> None:
        self._closed = True
        _stop_processes(self._procs, grace_s)
        if self._receiver is not None:
            self._receiver.join(timeout=5.0)  # its recv fails once the stages' sockets close
        self._sends.clear()
        if self._group:
            self._group = False
            dist.destroy_process_group()
        self._finalizer()

    def __enter__(self) -> PipelineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- stage processes ----------------------------------------------------------------------------------


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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ctrl-C reaches the whole process group; rank 0 decides how the pipeline stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"stage {rank}: %(message)s")
    _exit_with_parent(args.parent_pid)
    torch.set_num_threads(args.threads)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=LINK_TIMEOUT
    )
    key = f"lingctl/loaded/{rank}"
    try:
        dtype = getattr(torch, args.dtype)
        model = ModelDir.open(args.model_dir).load(dtype=dtype, quantize=args.quantize, layers=(args.first, args.last))
        if torch.device(args.device).type != "cpu":
            model.to(args.device)
        mc = model.config
        pool = KVPool(
            args.last - args.first,
            args.kv_cache_tokens + 1,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype,
            device=args.device,
        )
        stage = StageModel(model, pool, args.first, args.last)
    except Exception as exc:
        traceback.print_exc()
        print(_one_line(exc), file=sys.stderr, flush=True)
        store.set(key, _one_line(exc))
        return 1
    store.set(key, "ok")
    dist.init_process_group(backend_for(args.device), store=store, rank=rank, world_size=world, timeout=LINK_TIMEOUT)
    try:
        serve(stage, rank, world, dtype, args.device)
    except Exception as exc:
        traceback.print_exc()
        print(_one_line(exc), file=sys.stderr, flush=True)
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(stage_main())
