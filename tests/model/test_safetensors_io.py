"""Reading safetensors files piece by piece: neighbouring tensors come in one read, each piece with exactly its
tensor's bytes, whatever the tensors' sizes and alignment; and straight into place."""

from __future__ import annotations

import torch

from lingctl.model.safetensors_io import StreamReader, read_entries, read_into, write_safetensors


def _file(tmp_path):
    # odd-sized uint8 tensors between float ones: pieces that would start at odd offsets in a shared read
    tensors = {
        "a.bytes": torch.arange(7, dtype=torch.uint8),
        "b.f32": torch.randn(5, 3),
        "c.bytes": torch.arange(13, dtype=torch.uint8),
        "d.bf16": torch.randn(9, 4).to(torch.bfloat16),
        "e.f32": torch.randn(300, 2),
    }
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as f:
        write_safetensors(f, tensors)
    return path, tensors


def test_pieces_give_each_tensor_its_bytes_with_reads_gathered(tmp_path) -> None:
    path, tensors = _file(tmp_path)
    entries = sorted(read_entries(path), key=lambda e: e.begin)
    for chunk in (64, 256, 1 << 20):
        reader = StreamReader(path, chunk)
        got: dict[str, list[torch.Tensor]] = {}
        for piece in reader.pieces(entries):
            e = piece.entry
            got.setdefault(e.name, []).append(piece.data.view(e.dtype).reshape(piece.rows, *e.shape[1:]).clone())
        for name, t in tensors.items():
            assert torch.equal(torch.cat(got[name]).reshape(t.shape), t), (chunk, name)
        assert reader.bytes_read == sum(e.nbytes for e in entries)


def test_read_into_fills_each_tensor_in_place(tmp_path) -> None:
    path, tensors = _file(tmp_path)
    homes = {name: torch.empty_like(t) for name, t in tensors.items()}
    items = [(e, homes[e.name].view(-1).view(torch.uint8)) for e in read_entries(path)]
    assert read_into(path, items, batch_bytes=32) == sum(e.nbytes for e, _ in items)
    for name, t in tensors.items():
        assert torch.equal(homes[name], t), name
