"""One flood engine on a node of the cluster (a Ray actor): loads the model once, then answers blocks.

The class is plain Python; ``engines.py`` wraps it with ``ray.remote`` and Ray runs it in a worker process on
some node. Everything it is given (``EngineSpec``, blocks of ``GenRequest``) and returns (``BlockAnswers``) is a
dataclass that pickles, and the same engine code as on one machine computes the answers: a greedy answer does
not depend on the block it came in or on the node's thread count.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from lingctl.flood.cluster.blocks import Block
from lingctl.flood.engine.loop import EngineStats, GenResult
from lingctl.flood.engine.options import EngineOptions


@dataclass(kw_only=True, slots=True)
class EngineSpec:
    model: str  # as the user gave it: a path on every node, an s3:// checkpoint, or a Hugging Face id
    engine: EngineOptions
    cpus: float  # what Ray gave this engine: the cap on its compute threads


@dataclass(kw_only=True, slots=True)
class BlockAnswers:
    index: int
    results: list[GenResult]
    stats: EngineStats  # this block's engine counters
    seconds: float  # computing the block
    where: dict[str, Any] = field(default_factory=dict)  # node id, host, pid
    load_seconds: float = 0.0  # the model's load, on the engine's first block only
    load_bytes_read: int = 0
    threads: dict[str, Any] = field(default_factory=dict)


class BlockEngine:
    """Serves one model for the driver's blocks (one block at a time: Ray runs an actor's calls in order)."""

    def __init__(self, spec: EngineSpec) -> None:
        from lingctl.flood.text.tokens import TextCodec
        from lingctl.flood.weights.model_dir import ModelDir
        from lingctl.flood.weights.remote_model import flood_model_dir

        self.spec = spec
        # An s3:// model is copied into this node's cache once (engines on one node wait for the first copy).
        self.md = ModelDir.open(flood_model_dir(spec.model))
        codec = TextCodec.for_model(
            self.md.path, chat_template=None, special_tokens=self.md.special_tokens(), limits=None
        )
        # Stop strings are found in the decoded text, so the engine needs the tokenizer (never a template).
        self.stop_check = codec.stop_check if codec.tokenizer is not None else None
        self.session: Any = None  # made by ready()
        self.blocks = 0
        self.where = {"node": _node_id(), "host": socket.gethostname(), "pid": os.getpid(), "cpus": spec.cpus}

    def ready(self) -> dict[str, Any]:
        """Load the model; then say where this engine runs. The driver sends blocks only to a ready engine, so
        the time it measures answering excludes the loads, as a local run's does."""
        from lingctl.flood.engine.session import EngineSession

        self.session = EngineSession(
            self.md, self.spec.engine, self._plan([]), dtype=self._dtype(), stop_check=self.stop_check
        )
        self.session.max_threads = max(1, int(self.spec.cpus))
        self.session.load()
        return self.where

    def _dtype(self) -> Any:
        from lingctl.model.checkpoint import parse_dtype

        return parse_dtype(self.spec.engine.dtype)

    def _plan(self, requests: list[Any]) -> Any:
        from lingctl.flood.engine.session import plan_requests

        converted = self.md.converted is not None
        return plan_requests(self.md.config, requests, self.spec.engine, self._dtype(), converted=converted)

    def answer(self, block: Block) -> BlockAnswers:
        first = not self.blocks
        self.blocks += 1
        self.session.plan = self._plan(block.requests)  # the KV cache this block needs
        results = list(self.session.results(block.requests))
        return BlockAnswers(
            index=block.index,
            results=results,
            stats=self.session.stats,
            seconds=self.session.seconds,
            where=self.where,
            load_seconds=self.session.load_seconds if first else 0.0,
            load_bytes_read=self.session.load_bytes_read if first else 0,
            threads=self.session.threads,
        )


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())
