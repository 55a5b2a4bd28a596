"""CheckpointSource on local files: exact byte ranges equal the safetensors library's tensors,
and its counters (the ground truth of every I/O number) are exact."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.format import tensor_blocks
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.writer import to_float32
from mergepipe.storage.source import CheckpointSource

# 96 and 1000 leave ragged last blocks for 128-byte and 256-byte rows; 1 MiB
# makes every tensor a single block.
BLOCK_SIZES = [96, 1000, 4096, 1 << 20]


def raw_tensor_bytes(path, name) -> bytes:
    """A tensor's bytes as the safetensors library stores them (the reference)."""
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name).reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
def test_blocks_equal_safetensors(any_checkpoint, block_bytes):
    ckpt = open_checkpoint(any_checkpoint)
    expected_bytes = 0
    with CheckpointSource() as source:
        buffer = bytearray(block_bytes + 4096)  # reused: reads must not depend on fresh memory
        for file, entry in ckpt.iter_tensors():
            with safe_open(str(file.path), framework="pt") as handle:
                reference = handle.get_tensor(entry.name).float()
            flat_reference = reference.reshape(-1)
            parts = []
            for block in tensor_blocks(entry, block_bytes):
                out = buffer if block.nbytes <= len(buffer) else None
                raw = source.read(file.path, block.begin, block.end, out=out, tag="base")
                values = to_float32(raw, entry.dtype, block.shape(entry))
                assert torch.equal(values.reshape(-1), flat_reference[block.flat_start : block.flat_end])
                parts.append(values.reshape(-1))
                expected_bytes += block.nbytes
            whole = torch.cat(parts).reshape(entry.shape)
            assert torch.equal(whole, reference)
        assert source.bytes_read == expected_bytes == ckpt.total_bytes
        assert source.bytes_by_tag() == {"base": expected_bytes}


def test_whole_tensor_reads_match_safetensors(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("llama", "f16", True))
    with CheckpointSource() as source:
        for file, entry in ckpt.iter_tensors():
            raw = source.read(file.path, entry.begin, entry.end, tag="e1")
            assert bytes(raw) == raw_tensor_bytes(file.path, entry.name)
        assert source.bytes_by_tag() == {"e1": ckpt.total_bytes}
        assert source.bytes_read == ckpt.total_bytes


def test_read_lands_in_the_callers_buffer(checkpoint_factory):
    path = checkpoint_factory("llama", "bf16", False) / "model.safetensors"
    data = path.read_bytes()
    out = bytearray(b"\xaa" * 64)
    with CheckpointSource() as source:
        view = source.read(path, 100, 140, out=out)
        assert bytes(view) == data[100:140]
        assert bytes(out[:40]) == data[100:140]  # the view is the buffer's prefix, not a copy
        assert bytes(out[40:]) == b"\xaa" * 24  # bytes past the range are untouched
        view[0] = 0x11
        assert out[0] == 0x11


def test_counters_per_tag(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("qwen3", "bf16", True))
    file, entry = next(ckpt.iter_tensors())
    with CheckpointSource() as source:
        source.read(file.path, entry.begin, entry.begin + 10, tag="base")
        source.read(file.path, entry.begin, entry.begin + 30, tag="math")
        source.read(file.path, entry.begin + 5, entry.begin + 12, tag="math")
        source.read(file.path, entry.begin, entry.begin + 1)  # untagged: only in the total
        source.read(file.path, entry.begin, entry.begin, tag="empty")  # empty: not a read
        assert source.bytes_read == 48
        assert source.bytes_by_tag() == {"base": 10, "math": 37}


def test_threaded_reads_count_exactly(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("llama", "bf16", False))
    jobs = [(f, b, f"t{i % 3}") for i, (f, e) in enumerate(ckpt.iter_tensors()) for b in tensor_blocks(e, 256)]
    with CheckpointSource() as source:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda job: bytes(source.read(job[0].path, job[1].begin, job[1].end, tag=job[2])), jobs))
        assert source.bytes_read == ckpt.total_bytes == sum(len(r) for r in results)
        expected_tags: dict[str, int] = {}
        for _, b, tag in jobs:
            expected_tags[tag] = expected_tags.get(tag, 0) + b.nbytes
        assert source.bytes_by_tag() == expected_tags
        data = ckpt.files[0].path.read_bytes()
        assert all(r == data[b.begin : b.end] for r, (_, b, _) in zip(results, jobs))


def test_truncated_file_is_corrupt(tmp_path, checkpoint_factory):
    original = checkpoint_factory("llama", "bf16", False) / "model.safetensors"
    ckpt = open_checkpoint(original.parent)
    _, entry = list(ckpt.iter_tensors())[-1]
    damaged = shutil.copy(original, tmp_path / "model.safetensors")
    with open(damaged, "r+b") as handle:
        handle.truncate(entry.end - 10)
    with CheckpointSource() as source:
        with pytest.raises(CorruptCheckpointError, match="truncated") as info:
            source.read(damaged, entry.begin, entry.end, tag="e")
        assert str(damaged) in str(info.value)
        assert str(entry.end - 10) in str(info.value)  # where the file really ends
        assert source.bytes_read == 0 and source.bytes_by_tag() == {}


@pytest.mark.parametrize(
    "call",
    [
        "read",
        pytest.param(
            "advise_random",
            marks=pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="a no-op without posix_fadvise"),
        ),
    ],
)
def test_missing_file_is_a_checkpoint_error(tmp_path, call):
    path = tmp_path / "gone.safetensors"
    with CheckpointSource() as source:
        with pytest.raises(CheckpointError, match="gone.safetensors disappeared") as info:
            if call == "read":
                source.read(path, 0, 8)
            else:
                getattr(source, call)(path)
        assert not isinstance(info.value, CorruptCheckpointError)


def test_out_buffer_and_range_checks(checkpoint_factory):
    path = checkpoint_factory("llama", "bf16", False) / "model.safetensors"
    with CheckpointSource() as source:
        with pytest.raises(ValueError, match="holds 50 bytes"):
            source.read(path, 0, 100, out=bytearray(50))
        with pytest.raises(ValueError, match="writable"):
            source.read(path, 0, 8, out=memoryview(bytes(8)))
        with pytest.raises(ValueError, match="invalid byte range"):
            source.read(path, 10, 5)
        with pytest.raises(ValueError, match="invalid byte range"):
            source.read(path, -1, 5)
        view = source.read(path, 0, 8, out=bytearray(64))
        assert len(view) == 8 and bytes(view) == path.read_bytes()[:8]
    with pytest.raises(ValueError, match="closed"):
        source.read(path, 0, 8)
    assert source.bytes_read == 8  # counters stay readable after close
    source.close()  # idempotent


def test_advise_random_keeps_reads_and_counters_exact(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("llama", "bf16", sharded=False))
    file, entry = next(iter(ckpt.iter_tensors()))
    with CheckpointSource() as source:
        source.advise_random(file.path)
        data = source.read(file.path, entry.begin, entry.end, tag="e")
        assert bytes(data) == raw_tensor_bytes(file.path, entry.name)
        assert source.bytes_by_tag() == {"e": entry.nbytes}
