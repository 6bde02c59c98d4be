"""Float linear layers with their weights pre-packed for oneDNN, the CPU's fastest float GEMM in torch.

``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out once in oneDNN's blocked format, and
``_linear_pointwise`` multiplies by it without re-packing per call (what torch's own CPU inference path uses
after freezing). Measured on this 2-core EPYC, one thread, fp32: the 8192x256 head on 64 rows 2.8 ms
against 4.1-8.4 ms through ``F.linear`` (MKL), a 1024-row prompt chunk through the fused QKV 1.4x faster;
for 4-12 rows (an expert's share of a decode step) it is slower, so experts do not use it.

Exactness: a row's result is the same bits whatever the other rows, their number (from 2 rows on) and the
thread count (measured; asserted by tests/flood/test_packed.py), so batch invariance holds as before. The
bits differ from MKL's by rounding (about 1e-6 relative), so a model run through flood and through its own
``forward`` agree to rounding, as they already did on attention.

The packed copy is held beside the weight (the module keeps its parameter for everything else), which
costs the size of those weights once more: ``packed_bytes`` tells the memory plan.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

# oneDNN caches one primitive per product shape (1,024 by default). A batch run's step sizes vary from step
# to step, so over a 48-request run the cache added ~73 MB and would keep growing toward its cap. 32 entries
# keep the shapes of the last few steps and bound it (+35 MB measured), at no measured cost in speed. Read
# by oneDNN when it creates its first primitive, so a value the user set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")

# Rows the packing is tuned for (a decode step of a full batch); any row count works with it.
ROWS_HINT = 64


@functools.lru_cache(maxsize=4)
def available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN linear ops exist in this torch build and work for ``dtype`` (x86 CPU builds; not every platform
    has them, and bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2-only CPU refuses it)."""
    try:
        w = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(4, 8, dtype=dtype), packed, None, "none", [], "")
        return bool(torch.equal(y, torch.full((4, 8), 8.0, dtype=dtype)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class PackedLinear:
    """``y = x W^T + b`` with W packed once. Falls back to ``F.linear`` where oneDNN is not available."""

    def __init__(self, weight_OI: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight_OI.shape
        self.bias = bias.detach() if bias is not None else None
        with torch.no_grad():
            if weight_OI.dtype in (torch.float32, torch.bfloat16) and available(weight_OI.dtype):
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight_OI.detach(), ROWS_HINT)
                self.packed = True
            else:
                self.weight = weight_OI.detach()
                self.packed = False

    @staticmethod
    def of(linear: nn.Module) -> PackedLinear | None:
        """A packed copy of a float ``nn.Linear``, or None for anything else (int8 layers, meta tensors)."""
        if type(linear) is not nn.Linear or linear.weight.device.type != "cpu":
            return None
        if linear.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        return PackedLinear(linear.weight, linear.bias)

    @property
    def nbytes(self) -> int:
        """Bytes held beside the module's own weight (the packed copy)."""
        return self.out_features * self.in_features * self.weight.element_size() if self.packed else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)
