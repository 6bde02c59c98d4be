"""Continuous batching over the segment KV cache: which tokens of which sequences go into the next step.

Every step: decode tokens of running sequences first (one each, so a long prompt never stalls decoding), then
prompt chunks and replayed tokens of running sequences, then newly admitted sequences, all within
``max_batch_tokens``. Sequences join as soon as their segment can be reserved and leave the moment they
finish, freeing their slots for the next admission.

A sequence is ``tokens`` (prompt, then what it generated) and ``computed`` (how many of them have k/v in the
cache). Positions below the prompt length are computed in whole chunks whose boundaries are multiples of
``chunk``; positions past it one at a time, exactly as decoding produced them. After a preemption a
sequence replays its generated tokens the same way, so its outputs never depend on memory pressure.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lingctl.flood.engine.forward import AttentionUnit, StepBatch
from lingctl.flood.engine.prefix import PrefixPlan
from lingctl.flood.engine.sampling import SamplingParams
from lingctl.flood.engine.segment_cache import Growth, SegmentAllocator, SequenceKV, grow


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    index: int
    key: Any
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    max_new: int
    prefix: int | None  # deepest shared prefix entry (for a prefix entry itself: its parent)
    shared_len: int = 0  # positions held by prefix segments
    is_prefix: bool = False
    phase: Phase = Phase.WAITING
    kv: SequenceKV | None = None
    computed: int = 0
    scheduled: int = 0  # tokens in the step being built or in flight
    in_flight: bool = False
    finish_reason: str | None = None
    error: str | None = None
    state: Any = None  # the engine's per-sequence sampling state

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(kw_only=True, slots=True)
class SchedulerStats:
    steps: int = 0
    prefill_tokens: int = 0  # prompt positions computed (prefix entries included)
    decode_tokens: int = 0
    replayed_tokens: int = 0
    padded_rows: int = 0
    preemptions: int = 0
    extended: int = 0
    appended: int = 0
    waits: int = 0
    peak_used_slots: int = 0


@dataclass(slots=True)
class Step:
    batch: StepBatch
    sampled: list[Sequence] = field(default_factory=list)  # in sample_rows order
    members: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens scheduled)


class Scheduler:
    def __init__(
        self,
        alloc: SegmentAllocator,
        *,
        scratch_slot: int,
        chunk: int,
        max_batch_tokens: int,
        max_seqs: int,
        output_reserve: int,
        growth: int,
        prefixes: PrefixPlan | None,
    ) -> None:
        self.alloc = alloc
        self.scratch_slot = scratch_slot
        self.chunk = chunk
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.output_reserve = output_reserve
        self.growth = growth
        self.plan = prefixes or PrefixPlan()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_seqs: dict[int, Sequence] = {}
        self.prefix_users: dict[int, int] = {e.index: e.users for e in self.plan.entries}
        self.stats = SchedulerStats()
        self._tag = 0

    # -- queue ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.prefix is not None:
            seq.shared_len = self.plan.entries[seq.prefix].end
        seq.computed = seq.shared_len
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.is_prefix for s in self.running)

    # -- building a step ----------------------------------------------------------------------------
    def schedule(self) -> Step | None:
        """The next step, or None when nothing can run now (everything in flight, or memory exhausted)."""
        step = Step(StepBatch(token_ids=[], positions=[], slots=[], units=[], sample_rows=[]))
        budget = self.max_batch_tokens
        ready = [s for s in self.running if not s.in_flight]
        for seq in ready:  # pure decode first: one token each
            if len(seq.tokens) - seq.computed == 1 and seq.computed >= seq.prompt_len:
                budget -= self._take(seq, step, budget)
        for seq in ready:
            if seq.scheduled == 0 and len(seq.tokens) > seq.computed:
                budget -= self._take(seq, step, budget)
        while self.waiting and budget > 0 and self._live_requests() < self.max_seqs:
            seq = self.waiting[0]
            prefixes = self._admit(seq)
            if prefixes is None:
                break
            self.waiting.popleft()
            for p in prefixes:
                budget -= self._take(p, step, budget)
            budget -= self._take(seq, step, budget)
        if not step.batch.units:
            return None
        for seq, _n in step.members:
            seq.in_flight = True
        step.batch.pad(self.scratch_slot)
        self.stats.padded_rows += len(step.batch.token_ids) - step.batch.real_tokens
        step.batch.tag = self._tag
        self._tag += 1
        self.stats.peak_used_slots = max(self.stats.peak_used_slots, self.alloc.used_slots)
        return step

    def _live_requests(self) -> int:
        return sum(1 for s in self.running if not s.is_prefix)

    def _chain_ready(self, seq: Sequence) -> bool:
        """Every prefix entry this sequence reads has all its tokens computed or scheduled before it."""
        for entry in self.plan.chain(seq.prefix):
            p = self.prefix_seqs.get(entry)
            # Tokens scheduled earlier in this step or in an earlier micro-batch still in flight count:
            # every stage writes a layer's k/v for all rows before any attention reads them, and handles
            # micro-batches in order.
            if p is None or p.computed + p.scheduled < len(p.tokens):
                return False
        return True

    def _take(self, seq: Sequence, step: Step, budget: int) -> int:
        """Schedule as many whole units of ``seq`` as fit; returns the tokens taken."""
        if not self._chain_ready(seq):
            return 0
        taken = 0
        batch = step.batch
        while True:
            pos = seq.computed + seq.scheduled
            if pos >= len(seq.tokens):
                break
            if pos < seq.prompt_len:
                n = min(seq.prompt_len, (pos // self.chunk + 1) * self.chunk) - pos
            else:
                n = 1
            if n > budget - taken:
                break
            assert seq.kv is not None
            if seq.kv.capacity_left() < n and not self._grow(seq, n):
                break
            q_start = len(batch.token_ids)
            batch.slots += seq.kv.slots_for_next(n)
            seq.kv.advance(n)
            batch.token_ids += seq.tokens[pos : pos + n]
            batch.positions += range(pos, pos + n)
            batch.units.append(AttentionUnit(q_start, n, seq.kv.ranges()))
            if pos < seq.prompt_len:
                self.stats.prefill_tokens += n
            elif pos + n == len(seq.tokens):
                self.stats.decode_tokens += n
            else:
                self.stats.replayed_tokens += n
            seq.scheduled += n
            taken += n
            if pos + n == len(seq.tokens) and not seq.is_prefix:
                batch.sample_rows.append(q_start + n - 1)
                step.sampled.append(seq)
        if taken:
            step.members.append((seq, taken))
        return taken

    def _grow(self, seq: Sequence, n: int) -> bool:
        assert seq.kv is not None
        result = grow(self.alloc, seq.kv, n, self.growth)
        if result is Growth.EXTENDED:
            self.stats.extended += 1
        elif result is Growth.APPENDED:
            self.stats.appended += 1
        else:
            self.stats.waits += 1
            return False
        return True

    # -- admission and release ------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> list[Sequence] | None:
        """Reserve the prefix chain (once per entry) and the sequence's own first segment; returns the
        prefix entries newly admitted for it, or None when memory is short (nothing changed)."""
        new_prefixes: list[Sequence] = []
        for entry in self.plan.chain(seq.prefix):
            if entry in self.prefix_seqs:
                continue
            p = self._prefix_sequence(entry)
            seg = self.alloc.allocate(len(p.tokens) - p.shared_len)
            if seg is None:
                for q in new_prefixes:
                    self._drop_prefix(q)
                return None
            p.kv = SequenceKV(shared=self._shared_segments(p.prefix), own=[seg])
            p.phase = Phase.RUNNING
            self.prefix_seqs[entry] = p
            self.running.append(p)
            new_prefixes.append(p)
        own = len(seq.tokens) - seq.shared_len + min(seq.max_new - seq.generated, self.output_reserve)
        seg = self.alloc.allocate(max(1, own))
        if seg is None:
            for q in new_prefixes:
                self._drop_prefix(q)
            return None
        seq.kv = SequenceKV(shared=self._shared_segments(seq.prefix), own=[seg])
        seq.phase = Phase.RUNNING
        self.running.append(seq)
        return new_prefixes

    def _shared_segments(self, entry: int | None) -> list:
        return [seg for e in self.plan.chain(entry) for seg in self.prefix_seqs[e].kv.own]  # type: ignore[union-attr]

    def _prefix_sequence(self, entry: int) -> Sequence:
        e = self.plan.entries[entry]
        tokens: list[int] = []
        for i in self.plan.chain(entry):
            tokens += self.plan.entries[i].tokens
        p = Sequence(
            index=-1 - entry,
            key=None,
            tokens=tokens,
            prompt_len=len(tokens),
            sampling=SamplingParams(),
            max_new=0,
            prefix=e.parent,
            is_prefix=True,
        )
        p.shared_len = e.start
        p.computed = e.start
        return p

    def _drop_prefix(self, p: Sequence) -> None:
        entry = -1 - p.index
        for seg in p.kv.own if p.kv else []:
            self.alloc.free(seg)
        self.prefix_seqs.pop(entry, None)
        self.running.remove(p)

    def release(self, seq: Sequence) -> None:
        """A request is done (finished or failed): free its segments and its hold on its prefixes."""
        if seq.kv is not None:
            for seg in seq.kv.own:
                self.alloc.free(seg)
            seq.kv = None
        if seq in self.running:
            self.running.remove(seq)
        seq.phase = Phase.FINISHED
        for entry in self.plan.chain(seq.prefix):
            self.prefix_users[entry] -= 1
            if self.prefix_users[entry] == 0 and entry in self.prefix_seqs:
                self._drop_prefix(self.prefix_seqs[entry])

    def preempt(self) -> bool:
        """Free the most recently admitted request's own segments and queue it again at the front; it will
        replay its tokens. Returns False when there is nothing to preempt."""
        for seq in reversed(self.running):
            if seq.is_prefix or seq.in_flight:
                continue
            assert seq.kv is not None
            for seg in seq.kv.own:
                self.alloc.free(seg)
            seq.kv = None
            seq.computed = seq.shared_len
            seq.phase = Phase.WAITING
            self.running.remove(seq)
            self.waiting.appendleft(seq)
            self.stats.preemptions += 1
            return True
        return False

    # -- results --------------------------------------------------------------------------------
    def complete(self, step: Step, on_sample: Callable[[Sequence, int], None]) -> None:
        """The step ran: advance ``computed`` and hand each sampling row to ``on_sample`` (which appends the
        token and decides whether the sequence finished)."""
        self.stats.steps += 1
        for seq, n in step.members:
            seq.computed += n
            seq.scheduled = 0
            seq.in_flight = False
        for row, seq in enumerate(step.sampled):
            on_sample(seq, row)
