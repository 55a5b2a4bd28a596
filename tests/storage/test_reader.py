"""Block-by-block reads equal the safetensors library's tensors; counters are exact."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from mergepipe.errors import CorruptCheckpointError
from mergepipe.storage.blocks import tensor_blocks
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.convert import to_float32
from mergepipe.storage.reader import BlockReader, read_tensor

# 96 and 1000 leave ragged last blocks for 128-byte and 256-byte rows; 1 MiB
# makes every tensor a single block.
BLOCK_SIZES = [96, 1000, 4096, 1 << 20]


@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
def test_blocks_equal_safetensors(any_checkpoint, block_bytes):
    ckpt = open_checkpoint(any_checkpoint)
    expected_bytes = 0
    with BlockReader() as reader:
        buffer = bytearray(block_bytes + 4096)  # reused: reads must not depend on fresh memory
        for file, entry in ckpt.iter_tensors():
            with safe_open(str(file.path), framework="pt") as handle:
                reference = handle.get_tensor(entry.name).float()
            flat_reference = reference.reshape(-1)
            parts = []
            for block in tensor_blocks(entry, block_bytes):
                out = buffer if block.nbytes <= len(buffer) else None
                raw = reader.read(file.path, block.begin, block.end, out=out, tag="base")
                values = to_float32(raw, entry.dtype, block.shape(entry))
                assert torch.equal(values.reshape(-1), flat_reference[block.flat_start : block.flat_end])
                parts.append(values.reshape(-1))
                expected_bytes += block.nbytes
            whole = torch.cat(parts).reshape(entry.shape)
            assert torch.equal(whole, reference)
        assert reader.bytes_read == expected_bytes == ckpt.total_bytes
        assert reader.bytes_by_tag() == {"base": expected_bytes}
        assert reader.bytes_by_path() == {str(f.path): f.header.data_bytes for f in ckpt.files}


def test_counters_per_tag_and_path(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("qwen3", "bf16", True))
    file, entry = next(ckpt.iter_tensors())
    with BlockReader() as reader:
        reader.read(file.path, entry.begin, entry.begin + 10, tag="base")
        reader.read(file.path, entry.begin, entry.begin + 30, tag="math")
        reader.read(file.path, entry.begin + 5, entry.begin + 12, tag="math")
        reader.read(file.path, entry.begin, entry.begin + 1)  # untagged
        reader.read(file.path, entry.begin, entry.begin)  # empty: not a read
        assert reader.bytes_read == 48
        assert reader.read_calls == 4
        assert reader.bytes_by_tag() == {"base": 10, "math": 37}
        assert reader.bytes_by_path() == {str(file.path): 48}


def test_read_tensor_matches_safetensors(checkpoint_factory):
    root = checkpoint_factory("llama", "f16", True)
    ckpt = open_checkpoint(root)
    with BlockReader() as reader:
        for file, entry in ckpt.iter_tensors():
            raw = read_tensor(reader, file, entry, tag="e1")
            with safe_open(str(file.path), framework="pt") as handle:
                reference = handle.get_tensor(entry.name)
            assert bytes(raw) == reference.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert bytes(read_tensor(reader, file.path, entry)) == bytes(raw)
        assert reader.bytes_by_tag() == {"e1": ckpt.total_bytes}
        assert reader.bytes_read == 2 * ckpt.total_bytes


def test_threaded_reads_count_exactly(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("llama", "bf16", False))
    jobs = [(f, b) for f, e in ckpt.iter_tensors() for b in tensor_blocks(e, 256)]
    with BlockReader() as reader:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda job: bytes(reader.read(job[0].path, job[1].begin, job[1].end, tag="x")), jobs))
        assert reader.read_calls == len(jobs)
        assert reader.bytes_read == ckpt.total_bytes == sum(len(r) for r in results)
        data = ckpt.files[0].path.read_bytes()
        assert all(r == data[b.begin : b.end] for r, (_, b) in zip(results, jobs))


def test_truncated_file_raises(tmp_path, checkpoint_factory):
    source = checkpoint_factory("llama", "bf16", False) / "model.safetensors"
    ckpt = open_checkpoint(source.parent)
    file, entry = list(ckpt.iter_tensors())[-1]
    damaged = shutil.copy(source, tmp_path / "model.safetensors")
    with open(damaged, "r+b") as handle:
        handle.truncate(entry.end - 10)
    with BlockReader() as reader:
        with pytest.raises(CorruptCheckpointError, match="truncated") as info:
            reader.read(damaged, entry.begin, entry.end)
        assert str(damaged) in str(info.value)
        assert reader.bytes_read == 0


def test_out_buffer_checks(checkpoint_factory):
    path = checkpoint_factory("llama", "bf16", False) / "model.safetensors"
    with BlockReader() as reader:
        with pytest.raises(ValueError):
            reader.read(path, 0, 100, out=bytearray(50))
        with pytest.raises(ValueError):
            reader.read(path, 0, 8, out=memoryview(bytes(8)))
        with pytest.raises(ValueError):
            reader.read(path, 10, 5)
        view = reader.read(path, 0, 8, out=bytearray(64))
        assert len(view) == 8 and bytes(view) == path.read_bytes()[:8]
    with pytest.raises(ValueError):
        reader.read(path, 0, 8)
    assert reader.bytes_read == 8  # counters stay readable after close


def test_advise_random_keeps_reads_and_counters_exact(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("llama", "bf16", sharded=False))
    file, entry = next(iter(ckpt.iter_tensors()))
    with safe_open(str(file.path), framework="pt") as handle:
        expected = handle.get_tensor(entry.name).float()
    with BlockReader() as reader:
        reader.advise_random(file.path)
        data = read_tensor(reader, file, entry, tag="e")
        assert torch.equal(to_float32(data, entry.dtype, entry.shape), expected)
        assert reader.bytes_by_tag() == {"e": entry.nbytes}
