"""``flood quantize``: a converted checkpoint loads into the very tensors a direct int8/w8a8 load makes, by
plain copies (each byte read once, no conversion temporaries in the plan), answers identically, and is
written only where lingctl may write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lingctl.core.errors import LingctlError, UsageError
from lingctl.flood.engine.experts import stack_of
from lingctl.flood.engine.plan import plan_memory
from lingctl.flood.weights.converted import MARKER, ConvertedForm, convert
from lingctl.flood.weights.loader import CHUNK_BYTES
from lingctl.flood.weights.model_dir import ModelDir
from lingctl.model.checkpoint import load_checkpoint
from lingctl.model.safetensors_io import read_entries
from tests.conftest import run_lingctl
from tests.flood.test_loader import assert_same_bits, tiny_ckpt_of

CASES = [("int8", "float32"), ("w8a8", "float32"), ("int8", "bfloat16")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("convert-src")
    return {
        "bf16": tiny_ckpt_of(tmp, file_dtype=torch.bfloat16),
        "tied": tiny_ckpt_of(tmp, file_dtype=torch.bfloat16, tied=True),
    }


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Path]:
    """Every case converted once, into several shards (30 kB each at most)."""
    tmp = tmp_path_factory.mktemp("convert-dst")
    out = {}
    for file, src in sources.items():
        for mode, dtype in CASES:
            dst = tmp / f"{file}-{mode}-{dtype}"
            convert(ModelDir.open(src), dst, mode=mode, dtype=dtype, shard_bytes=30_000)
            out[(file, mode, dtype)] = dst
    return out


@pytest.mark.parametrize("file", ["bf16", "tied"])
@pytest.mark.parametrize(("mode", "dtype"), CASES)
def test_a_converted_checkpoint_loads_the_same_bits_as_converting_at_load(
    sources, converted, file, mode, dtype
) -> None:
    torch_dtype = getattr(torch, dtype)
    direct = ModelDir.open(sources[file]).load(dtype=torch_dtype, quantize=mode)
    md = ModelDir.open(converted[(file, mode, dtype)])
    assert md.converted is not None and (md.converted.mode, md.converted.dtype) == (mode, dtype)
    got, stats = md.load_with_stats(dtype=torch_dtype, quantize=mode)
    assert_same_bits(direct, got)
    # plain copies: every stored byte read once, and the expert stacks are int8 as the kernels want them
    files = sorted(md.path.glob("*.safetensors"))
    assert len(files) > 1
    assert stats.bytes_read == stats.bytes_needed == sum(e.nbytes for f in files for e in read_entries(f))
    for block in got.moe_blocks():
        stack = stack_of(block)
        assert stack is not None and stack.quantized and stack.gate_up_EXD.dtype == torch.int8
    # the w8a8 head is int8 with int8 activations, as the direct load makes it
    assert getattr(got.lm_head, "act_int8", False) == getattr(direct.lm_head, "act_int8", False)


def test_a_pipeline_stage_of_a_converted_checkpoint_holds_only_its_layers(sources, converted) -> None:
    direct = ModelDir.open(sources["bf16"]).load(dtype=torch.float32, quantize="w8a8", layers=(1, 3))
    got = ModelDir.open(converted[("bf16", "w8a8", "float32")]).load(
        dtype=torch.float32, quantize="w8a8", layers=(1, 3)
    )
    assert_same_bits(direct, got)


def test_the_plan_of_a_converted_checkpoint_has_no_conversion_temporaries(converted) -> None:
    md = ModelDir.open(converted[("bf16", "w8a8", "float32")])
    kwargs = dict(
        dtype=torch.float32, quantize="w8a8", kv_cache_tokens=64, max_batch_tokens=64, max_seqs=4,
        batch_kv_tokens=64, largest_request_tokens=8, available_bytes=2**34, runtime_bytes=0,
    )  # fmt: skip
    plain = plan_memory(md.config, **kwargs)  # type: ignore[arg-type]
    conv = plan_memory(md.config, converted=True, **kwargs)  # type: ignore[arg-type]
    assert conv.loader_bytes == 2 * CHUNK_BYTES < plain.loader_bytes
    assert conv.weights_bytes == plain.weights_bytes


def test_training_tools_refuse_a_converted_checkpoint_in_one_line(converted) -> None:
    with pytest.raises(LingctlError, match="quantized checkpoint .*lingctl-int8.*for inference only"):
        load_checkpoint(converted[("bf16", "int8", "float32")])


def test_a_run_must_ask_for_what_the_checkpoint_was_converted_for(converted) -> None:
    form = ModelDir.open(converted[("bf16", "w8a8", "float32")]).converted
    assert form is not None
    assert form.serving_quantize(None, "float32", Path("x")) == "w8a8"
    with pytest.raises(UsageError, match="converted for --quantize w8a8 --dtype float32"):
        form.serving_quantize("int8", "float32", Path("x"))
    with pytest.raises(UsageError, match="this run asks for --quantize w8a8 --dtype bfloat16"):
        form.serving_quantize("w8a8", "bfloat16", Path("x"))
    assert ConvertedForm.of_directory(Path("/nonexistent")) is None


def test_flood_quantize_then_run_answers_as_the_original(tiny_ckpt, tmp_path) -> None:
    """Through the CLI: the converted checkpoint's greedy answers equal the original's under w8a8; a mismatched
    --quantize, an occupied DST and a converted SRC each get one line and change nothing."""
    dst = tmp_path / "q"
    r = run_lingctl("flood", "quantize", str(tiny_ckpt), str(dst), "--quantize", "w8a8", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["mode"] == "w8a8" and report["bytes_written"] > 0 and not report["reused"]
    assert not (dst / MARKER).exists()
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "prompt": list(range(3, 9 + i)), "max_tokens": 8, "temperature": 0})
            + "\n"
            for i in range(5)
        )
    )
    texts = []
    for model, extra in ((tiny_ckpt, ["--quantize", "w8a8"]), (dst, [])):
        out = tmp_path / f"{model.name}.out.jsonl"
        r = run_lingctl("flood", "run", str(batch), "-m", str(model), "-o", str(out), *extra)
        assert r.returncode == 0, r.stderr
        texts.append(
            [json.loads(line)["response"]["body"]["choices"][0]["text"] for line in out.read_text().splitlines()]
        )
    assert texts[0] == texts[1] and len(texts[0]) == 5
    r = run_lingctl("flood", "run", str(batch), "-m", str(dst), "--quantize", "int8", "-o", str(tmp_path / "x.jsonl"))
    assert r.returncode == 2 and "converted for --quantize w8a8" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.jsonl").exists()
    # the same conversion again: nothing to do; another into the same place: refused
    r = run_lingctl("flood", "quantize", str(tiny_ckpt), str(dst), "--quantize", "w8a8")
    assert r.returncode == 0 and "nothing to do" in r.stdout
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    r = run_lingctl("flood", "quantize", str(tiny_ckpt), str(dst), "--quantize", "int8")
    assert r.returncode == 2 and "not empty" in r.stderr
    r = run_lingctl("flood", "quantize", str(dst), str(tmp_path / "again"))
    assert r.returncode == 2 and "already a converted checkpoint" in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before


def test_an_unfinished_conversion_is_redone_and_a_foreign_directory_is_left_alone(tiny_ckpt, tmp_path) -> None:
    dst = tmp_path / "q"
    dst.mkdir()
    (dst / MARKER).write_text("{}\n")
    (dst / "model-00001-of-00001.safetensors").write_bytes(b"torn")
    convert(ModelDir.open(tiny_ckpt), dst, mode="int8", dtype="float32")
    assert not (dst / MARKER).exists()
    assert ModelDir.open(dst).load(dtype=torch.float32, quantize="int8") is not None
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not empty"):
        convert(ModelDir.open(tiny_ckpt), foreign, mode="int8", dtype="float32")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_a_destination_that_cannot_be_created_is_one_line(tiny_ckpt, tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    r = run_lingctl("flood", "quantize", str(tiny_ckpt), str(tmp_path / "file" / "q"))
    assert r.returncode != 0 and r.returncode != 1, r.stderr  # a usage or path error, not an internal one
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2 and (tmp_path / "file").read_text() == "x"
