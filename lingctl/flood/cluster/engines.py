"""The driver's side of ``flood run --ray``: engines placed on the cluster's nodes, blocks sent to them, answers
gathered as blocks finish.

An engine is a Ray actor (``engine_actor.BlockEngine``) holding a node's CPUs (or ``--ray-cpus-per-engine``);
each has up to ``in_flight`` blocks queued so it never waits for the driver. When an engine dies (its process,
or its whole node), Ray fails its calls with ``RayActorError``; its unfinished blocks go back to the queue and are
answered by another engine, and a replacement engine is asked for wherever the cluster has room. A block's answers
are handed on only when the whole block is back, so a lost block leaves nothing behind, and a retried one cannot
give an answer twice. An error raised inside an engine (not a lost process) stops the run: answering the block
again would fail the same way.

``ClusterSession`` has ``EngineSession``'s interface (``results``, ``stats``, ``seconds``, ``load_seconds``,
``load_bytes_read``, ``threads``), so ``flood run`` uses either the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lingctl.core.errors import LingctlError, UsageError
from lingctl.flood.cluster.blocks import Block, block_size, make_blocks
from lingctl.flood.cluster.engine_actor import BlockAnswers, BlockEngine, EngineSpec
from lingctl.flood.cluster.options import ClusterOptions
from lingctl.flood.cluster.ray_connect import connect
from lingctl.flood.engine.loop import EngineStats, GenRequest, GenResult
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.engine.session import StopRequested

log = logging.getLogger(__name__)

WAIT_NOTICE_S = 60.0  # how often to say that no engine runs while the cluster has no room for one
MAX_ATTEMPTS = 4  # a block whose engine died this many times stops the run: something kills whoever takes it


@dataclass(kw_only=True, slots=True)
class EngineFigures:
    """What one engine did, for the summary and the progress line."""

    node: str = ""
    host: str = ""
    cpus: float = 0.0
    blocks: int = 0
    requests: int = 0
    generated_tokens: int = 0
    compute_seconds: float = 0.0  # its blocks' engine time, load excluded
    load_seconds: float = 0.0
    threads: int = 0
    lost: bool = False  # died during the run
    error: str | None = None  # why it could not start


def plan_engines(nodes: list[dict[str, Any]], opts: ClusterOptions) -> list[tuple[str, float]]:
    """(node id, CPUs) of each engine: one per alive node holding all its CPUs, or as many of
    ``cpus_per_engine`` as each node holds; at most ``opts.engines``, taken round the nodes in turn."""
    per_node: list[list[tuple[str, float]]] = []
    for node in nodes:
        cpus = float(node.get("Resources", {}).get("CPU", 0.0)) if node.get("Alive") else 0.0
        if cpus < 1 and opts.cpus_per_engine is None:
            continue
        size = opts.cpus_per_engine or cpus
        count = math.floor(cpus / size + 1e-9) if size > 0 else 0
        if count:
            per_node.append([(str(node["NodeID"]), size)] * count)
    order: list[tuple[str, float]] = []
    for turn in range(max((len(n) for n in per_node), default=0)):
        order.extend(n[turn] for n in per_node if turn < len(n))
    return order[: opts.engines] if opts.engines is not None else order


class ClusterSession:
    def __init__(self, opts: ClusterOptions, *, model: str, engine: EngineOptions) -> None:
        opts.validate()
        self.opts, self.model, self.engine = opts, model, engine
        self.stats = EngineStats()
        self.seconds = 0.0
        self.load_seconds = 0.0  # the slowest engine's load
        self.load_bytes_read = 0
        self.threads: dict[str, Any] = {}
        self.figures: dict[int, EngineFigures] = {}  # by engine number
        self.blocks = 0
        self.block_requests = 0
        self.retried_blocks = 0
        self.progress_label = ""  # each node's tokens/s so far, for the progress line

    def summary(self) -> dict[str, Any]:
        """The cluster part of the run's summary: per engine and per node."""
        nodes: dict[str, dict[str, Any]] = {}
        for f in self.figures.values():
            n = nodes.setdefault(f.node, {"node": f.node, "host": f.host, "engines": 0, "requests": 0})
            n["engines"] += 1
            n["requests"] += f.requests
            n["generated_tokens"] = n.get("generated_tokens", 0) + f.generated_tokens
            n["tokens_per_s"] = round(n["generated_tokens"] / self.seconds, 1) if self.seconds > 0 else 0.0
        return {
            "engines": [dataclasses.asdict(f) for f in self.figures.values()],
            "nodes": list(nodes.values()),
            "blocks": self.blocks,
            "block_requests": self.block_requests,
            "retried_blocks": self.retried_blocks,
        }

    def results(
        self,
        requests: list[GenRequest],
        *,
        on_step: Callable[[EngineStats], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[GenResult]:
        ray = connect(self.opts.address)
        actors: dict[int, Any] = {}
        try:
            yield from _Dispatch(self, ray, actors, requests, on_step, should_stop).run()
        finally:
            for actor in actors.values():
                ray.kill(actor)


class _Dispatch:
    """One run of blocks over the engines (see the module docstring)."""

    def __init__(
        self,
        session: ClusterSession,
        ray: Any,
        actors: dict[int, Any],
        requests: list[GenRequest],
        on_step: Callable[[EngineStats], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> None:
        self.s, self.ray, self.actors = session, ray, actors
        self.on_step, self.should_stop = on_step, should_stop
        opts = session.opts
        placements = plan_engines(ray.nodes(), opts)
        if not placements:
            raise UsageError(
                "--ray: no node of the cluster has the CPUs for an engine",
                hint="add nodes with CPUs, or lower --ray-cpus-per-engine",
            )
        target = opts.block_requests or block_size(len(requests), len(placements), session.engine.max_seqs)
        self.todo: deque[Block] = deque(make_blocks(requests, chunk=session.engine.chunk, target=target))
        session.blocks, session.block_requests = len(self.todo), target
        self.placements = placements[: len(self.todo)]  # an engine without a block would only load the model
        self.total = len({r.key[0] for r in requests})
        self.requests = len(requests)
        self.attempts: dict[int, int] = {}
        self.starting: dict[Any, int] = {}  # ready() call -> engine number
        self.live: dict[int, int] = {}  # engine number -> blocks in flight
        self.in_flight: dict[Any, tuple[int, Block]] = {}
        self.replacements = 0
        self.started = time.monotonic()
        self.answering = False
        self.idle_since: float | None = None  # since when no engine is running, while some are being placed
        self.done_requests = 0

    def run(self) -> Iterator[GenResult]:
        for node, cpus in self.placements:
            self._start_engine(cpus, node)
        while self.todo or self.in_flight:
            if self.should_stop is not None and self.should_stop():
                raise StopRequested
            self._feed()
            waiting = [*self.in_flight, *self.starting]
            if not waiting:
                raise LingctlError(
                    f"--ray: every engine failed; {sum(len(b.requests) for b in self.todo)} answers not computed",
                    hint=self._why_engines_failed(),
                )
            if not self.live and not self.in_flight:
                self._say_waiting()
            ready, _ = self.ray.wait(waiting, num_returns=1, timeout=0.5)
            for ref in ready:
                if ref in self.starting:
                    self._engine_started(ref)
                else:
                    yield from self._block_back(ref)
        self.s.seconds = time.monotonic() - self.started
        self.s.stats.requests = self.s.stats.finished = self.requests

    def _start_engine(self, cpus: float, node: str | None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        number = len(self.actors)
        options: dict[str, Any] = {"num_cpus": cpus, "max_restarts": 0, "max_task_retries": 0}
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        spec = EngineSpec(model=self.s.model, engine=self.s.engine, cpus=cpus)
        actor = self.ray.remote(BlockEngine).options(**options).remote(spec)
        self.actors[number] = actor
        self.s.figures[number] = EngineFigures(cpus=cpus, node=node or "")
        self.starting[actor.ready.remote()] = number

    def _say_waiting(self) -> None:
        """Once a minute while no engine runs: the engines asked for are waiting for room on the cluster."""
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since >= WAIT_NOTICE_S:
            cpus = sorted({self.s.figures[n].cpus for n in self.starting.values()})
            log.warning(
                "no engine is running: %d waiting for a node with %s free CPUs (add a node, or stop and lower "
                "--ray-cpus-per-engine; --resume continues)",
                len(self.starting),
                "/".join(f"{c:g}" for c in cpus),
            )
            self.idle_since = now

    def _engine_started(self, ref: Any) -> None:
        number = self.starting.pop(ref)
        figures = self.s.figures[number]
        try:
            where = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            figures.error = _cause(exc)
            log.warning("an engine could not start: %s", figures.error)
            return
        figures.node, figures.host = where["node"], where["host"]
        if not self.answering:  # answering starts with the first engine ready (its model loaded), as locally
            self.answering, self.started = True, time.monotonic()
        self.live[number] = 0
        self.idle_since = None

    def _feed(self) -> None:
        """One block to every idle engine first, then a second one queued behind it, except the blocks that
        engines still starting would otherwise find none of."""
        for depth in range(1, self.s.opts.in_flight + 1):
            for number in sorted(self.live, key=lambda n: self.live[n]):
                if not self.todo or (depth > 1 and len(self.todo) <= len(self.starting)):
                    return
                if self.live[number] < depth:
                    block = self.todo.popleft()
                    self.in_flight[self.actors[number].answer.remote(block)] = (number, block)
                    self.live[number] += 1

    def _block_back(self, ref: Any) -> Iterator[GenResult]:
        number, block = self.in_flight.pop(ref)
        try:
            answers: BlockAnswers = self.ray.get(ref)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.ObjectLostError) as exc:
            self._engine_lost(number, block, exc)
            return
        except self.ray.exceptions.RayTaskError as exc:
            raise LingctlError(
                f"--ray: an engine failed on a block of {len(block.requests)} requests: {_cause(exc)}"
            ) from None
        if number in self.live:
            self.live[number] -= 1
        self._count(number, answers)
        yield from answers.results

    def _engine_lost(self, number: int, block: Block, exc: Exception) -> None:
        """Its block goes back to the front of the queue; a replacement engine is asked for once per lost one."""
        figures = self.s.figures[number]
        if number in self.live:
            del self.live[number]
            figures.lost = True
            log.warning(
                "engine %d on %s was lost (%s); its blocks go to the other engines",
                number,
                figures.host or figures.node,
                _cause(exc),
            )
            if self.replacements < len(self.placements):
                self.replacements += 1
                self._start_engine(figures.cpus, None)
        tries = self.attempts[block.index] = self.attempts.get(block.index, 0) + 1
        if tries >= MAX_ATTEMPTS:
            raise LingctlError(
                f"--ray: a block of {len(block.requests)} requests lost its engine {tries} times: {_cause(exc)}"
            )
        self.s.retried_blocks += 1
        self.todo.appendleft(block)

    def _count(self, number: int, a: BlockAnswers) -> None:
        f, s = self.s.figures[number], self.s
        f.blocks += 1
        f.requests += len({r.key[0] for r in a.results})
        f.generated_tokens += a.stats.generated_tokens
        f.compute_seconds += a.seconds
        f.load_seconds += a.load_seconds
        f.threads = int(a.threads.get("final_threads") or a.threads.get("threads") or 0)
        s.load_seconds = max(s.load_seconds, f.load_seconds)
        s.load_bytes_read += a.load_bytes_read
        s.threads = {"threads": f.threads, "source": f"per engine ({len(self.live)} engines)"}
        _add_stats(s.stats, a.stats)
        self.done_requests += len({r.key[0] for r in a.results})
        s.seconds = time.monotonic() - self.started
        s.progress_label = self._label()
        if self.on_step is not None:
            progress = dataclasses.replace(
                s.stats,
                requests=self.total,
                finished=self.done_requests,
                seconds=s.seconds,
                running=sum(len(b.requests) for _, b in self.in_flight.values()),
                waiting=sum(len(b.requests) for b in self.todo),
            )
            self.on_step(progress)

    def _label(self) -> str:
        """``nodes: HOST/NODE 1,234 tok/s, ...``: each node's tokens per second of the run so far."""
        tokens: dict[str, int] = {}
        for f in self.s.figures.values():
            name = f"{f.host}/{f.node[:6]}" if f.host else f.node[:6]
            tokens[name] = tokens.get(name, 0) + f.generated_tokens
        seconds = max(self.s.seconds, 1e-9)
        return "nodes: " + ", ".join(f"{name} {t / seconds:,.0f} tok/s" for name, t in sorted(tokens.items()))

    def _why_engines_failed(self) -> str:
        errors = [f.error for f in self.s.figures.values() if f.error]
        return (
            f"first engine error: {errors[0]}" if errors else "see the nodes' logs under /tmp/ray/session_latest/logs"
        )


def _add_stats(total: EngineStats, part: EngineStats) -> None:
    """Adds ``part``'s counters into ``total`` (peaks are maxima)."""
    for name in ("generated_tokens", "prefix_entries", "prefix_hits", "prefix_tokens_saved", "decode_step_tokens"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    total.prefill_seconds += part.prefill_seconds
    total.decode_seconds += part.decode_seconds
    for f in dataclasses.fields(total.scheduler):
        a, b = getattr(total.scheduler, f.name), getattr(part.scheduler, f.name)
        setattr(total.scheduler, f.name, max(a, b) if f.name.startswith("peak") else a + b)


def _cause(exc: BaseException) -> str:
    """The first line of what went wrong, without Ray's traceback."""
    cause = getattr(exc, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
