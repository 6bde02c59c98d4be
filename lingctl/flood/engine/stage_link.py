"""The messages between flood's pipeline processes (``pipeline.py``): rank 0 and the stages pass each
micro-batch on as an int64 header ``[kind, tag, payload bytes, rows, cols]``, then the payload (uint8: the
pickled ``StepBatch``) and the tensor ``[rows, cols]`` (hidden states, or the last stage's logits) when they
are not empty."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lingctl.flood.engine.forward import StepBatch

STEP, SHUTDOWN = 1, 0
HEADER_LEN = 5  # kind, tag, payload bytes, rows, cols
# Bounds every gloo wait, including a stage's wait for its next micro-batch: a stage may wait long (the engine
# reads and tokenizes every request before the first step), and rank 0 enforces the real bounds itself.
LINK_TIMEOUT = timedelta(days=7)
LOADED = "ok"  # what a stage sets at its loaded_key once its layers are in memory (else its one-line error)


def loaded_key(rank: int) -> str:
    """The store key where stage ``rank`` says whether it loaded."""
    return f"lingctl/loaded/{rank}"


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


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
