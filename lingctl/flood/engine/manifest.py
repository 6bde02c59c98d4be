"""What produced an output of flood (``flood run``'s answers, ``flood eval``'s results): the manifest saved
beside it, which a resume or a reuse must match."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lingctl.flood.engine.options import EngineOptions

# The engine's numerics: raised when a change to the engine changes what an output holds.
ENGINE_VERSION = "flood/1"
# What changes an output's numbers. Batch size, threads, cache size, stages and prefix sharing do not: the
# engine is batch-invariant.
NUMERICS = ("engine", "model_fingerprint", "dtype", "quantize", "prompt_chunk")


def output_manifest(
    *,
    model: str,
    fingerprint: str,
    engine: EngineOptions,
    own: dict[str, Any],
    compared: Sequence[str],
) -> dict[str, Any]:
    """The manifest of an output: the engine and model that made it and ``own``, the command's own entries
    (its format, its inputs), of which ``compared`` must match too."""
    return {
        "engine": ENGINE_VERSION,
        "model": model,
        "model_fingerprint": fingerprint,
        "dtype": engine.dtype,
        "quantize": engine.quantize,
        "prompt_chunk": engine.chunk,
        **own,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "compare": [*NUMERICS, *compared],
    }
