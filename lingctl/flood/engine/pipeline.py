"""Pipeline-parallel stages: the model's layers split across N stage processes fed by this one.

Flood (Ling report, offline inference) runs fully pipeline-parallel with a many-to-one process-to-accelerator
mapping: one extra process, the scheduler, feeds the first stage. Here rank 0 is the scheduler (the engine
loop in this process) and ranks 1..N run contiguous slices of the layers. A micro-batch (one engine step) goes

    rank 0 --pickled StepBatch--> stage 1 --batch + hidden [T, D]--> ... --> stage N --logits [R, V]--> rank 0

over ``torch.distributed`` point-to-point messages, so with ``depth = N`` steps in flight every stage has
work. Each stage handles micro-batches strictly in order: the scheduler relies on it, since a later
micro-batch may read k/v that an earlier one wrote at the same layer.

The messages are those of ``stage_link``. Shutdown travels the same path as the steps, so it arrives
after every step already sent and comes back to rank 0 as the last message.

Timeouts: a stage may wait indefinitely for its next micro-batch (the engine reads and tokenizes all requests
before the first step, which can take long), so the process group's own timeout is long and the bounds are
enforced here: rank 0 waits at most ``timeout_s`` for the stages to load and for each step's logits, and
notices at once when a stage process exits; a stage exits when rank 0 (its parent) is gone.

The stage processes run ``python -m lingctl.flood.engine.pipeline`` (``stage_process.stage_main``).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from lingctl.core.errors import LingctlError
from lingctl.core.net import free_port
from lingctl.flood.engine.cpu_load import read_budget
from lingctl.flood.engine.forward import StepBatch
from lingctl.flood.engine.stage_link import (
    LINK_TIMEOUT,
    LOADED,
    SHUTDOWN,
    STEP,
    Message,
    Pending,
    backend_for,
    loaded_key,
    pack_batch,
    recv_message,
    send_message,
)
from lingctl.flood.engine.stage_process import StageArgs, stage_main
from lingctl.flood.weights.model_dir import ModelDir

log = logging.getLogger(__name__)

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

        # The CPUs of the affinity mask, not os.cpu_count(): in a container or under taskset that oversubscribes.
        threads = threads_per_stage or max(1, len(read_budget().cpus) // stages)
        try:
            self._start(mdir.path, dtype, quantize, kv_cache_tokens, threads)
        except BaseException:
            self._abort()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="pipeline-results", daemon=True)
        self._receiver.start()
        log.info("pipeline: %d stages, layers %s, %d threads each", stages, self.split, threads)

    def _start(
        self, model_dir: Path, dtype: torch.dtype, quantize: str | None, kv_cache_tokens: int, threads: int
    ) -> None:
        """Start the stage processes, wait until each has loaded its layers, then join them in a process group."""
        world = self.depth + 1
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False, timeout=LINK_TIMEOUT)
        for rank, (first, last) in enumerate(self.split, start=1):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                WORLD_SIZE=str(world),
                RANK=str(rank),
                OMP_NUM_THREADS=str(threads),
            )
            stage = StageArgs(model_dir, first, last, dtype, quantize, kv_cache_tokens, threads, self.device)
            with open(self._logs[rank - 1], "wb") as err:
                self._procs.append(
                    subprocess.Popen(
                        stage.command(), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
                    )
                )
        self._wait_loaded(store)
        dist.init_process_group(backend_for(self.device), store=store, rank=0, world_size=world, timeout=LINK_TIMEOUT)
        self._group = True

    def _wait_loaded(self, store: dist.TCPStore) -> None:
        deadline = time.monotonic() + self.timeout_s
        loaded: set[int] = set()
        while len(loaded) < self.depth:
            for i, p in enumerate(self._procs):
                rank = i + 1
                if rank in loaded:
                    continue
                key = loaded_key(rank)
                if store.check([key]):
                    status = store.get(key).decode()
                    if status != LOADED:
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


if __name__ == "__main__":  # a stage process (started by PipelineRunner)
    sys.exit(stage_main())
