"""The engine settings a command takes (``flood run``, ``flood eval``), checked the one way for both."""

from __future__ import annotations

from dataclasses import dataclass

from lingctl.core.errors import UsageError


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    max_batch_tokens: int = 1024
    max_seqs: int = 256
    kv_cache_tokens: int | None = None
    dtype: str = "float32"
    quantize: str | None = None  # "int8": weight-only int8 linear layers
    threads: int | None = None
    prefix_sharing: bool = True
    chunk: int = 16  # prompt chunk / prefix block; fixes the numerics, so an output's manifest records it

    def validate(self) -> None:
        if self.max_batch_tokens < self.chunk:
            raise UsageError(f"--max-batch-tokens must be at least {self.chunk}, got {self.max_batch_tokens}")
        if self.max_seqs < 1:
            raise UsageError(f"--max-seqs must be >= 1, got {self.max_seqs}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise UsageError(f"--kv-cache-tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.threads is not None and self.threads < 0:
            raise UsageError(f"--threads must be >= 0 (0: chosen from the free cores), got {self.threads}")
        if self.quantize not in (None, "int8"):
            raise UsageError(f"--quantize {self.quantize!r} is not supported; use int8")
        if self.dtype not in ("float32", "bfloat16"):
            raise UsageError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
