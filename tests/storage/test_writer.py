"""The streaming writer: files safetensors and transformers load, never a partial one."""

from __future__ import annotations

import errno
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from mergepipe.errors import CorruptCheckpointError
from mergepipe.storage.writer import StreamingSafetensorsWriter
from tests.fixtures.checkpoints import checkpoint_files
from tests.storage.helpers import raw_header

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
               torch.uint8: "U8"}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def load_file(path):
    with safe_open(str(path), framework="pt") as handle:
        return {n: handle.get_tensor(n) for n in handle.keys()}, handle.metadata()


def write_shuffled(path, tensors, metadata, chunk_bytes, seed=0):
    """Write ``tensors`` through the writer in random chunk order."""
    entries = [(n, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    pieces = []
    for name, t in tensors.items():
        data = tensor_bytes(t)
        pieces += [(name, off, data[off : off + chunk_bytes]) for off in range(0, len(data), chunk_bytes)]
    random.Random(seed).shuffle(pieces)
    with StreamingSafetensorsWriter(path, entries, metadata) as writer:
        for name, off, data in pieces:
            writer.write(name, off, data)
    return writer


@pytest.mark.parametrize("variant", [("llama", "bf16", False), ("qwen3", "f32", True), ("llama", "f16", True)])
def test_round_trip_random_block_order(tmp_path, checkpoint_factory, variant):
    for source in checkpoint_files(checkpoint_factory(*variant)):
        tensors, metadata = load_file(source)
        out = tmp_path / source.name
        writer = write_shuffled(out, tensors, metadata, chunk_bytes=300)
        got, got_meta = load_file(out)
        assert got_meta == metadata
        assert set(got) == set(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t)
        header_len, _ = raw_header(out)
        assert (8 + header_len) % 8 == 0
        assert writer.bytes_written == out.stat().st_size


def test_edge_tensors_round_trip(tmp_path):
    tensors = {
        "scalar": torch.tensor(1.25),
        "empty": torch.zeros((0, 3), dtype=torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([1, 0, 1], dtype=torch.uint8),
    }
    write_shuffled(tmp_path / "e.safetensors", tensors, None, chunk_bytes=7)
    got, meta = load_file(tmp_path / "e.safetensors")
    assert meta is None
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def test_layout_follows_entry_order(tmp_path):
    entries = [("b", "F32", (2,)), ("a", "F32", (3,))]
    with StreamingSafetensorsWriter(tmp_path / "o.safetensors", entries) as writer:
        assert writer.data_offset("b") == writer.data_start
        assert writer.data_offset("a") == writer.data_start + 8
        writer.write("a", 0, torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes())
        writer.write("b", 0, torch.tensor([4.0, 5.0]).numpy().tobytes())
    _, doc = raw_header(tmp_path / "o.safetensors")
    assert doc["b"]["data_offsets"] == [0, 8] and doc["a"]["data_offsets"] == [8, 20]


def test_transformers_loads_written_model(tmp_path, checkpoint_factory):
    from transformers import AutoModelForCausalLM

    source = checkpoint_factory("llama", "bf16", False)
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    out = tmp_path / "written"
    out.mkdir()
    shutil.copy(source / "config.json", out / "config.json")
    state = {n: t.detach() for n, t in original.state_dict().items()}
    write_shuffled(out / "model.safetensors", state, {"format": "pt"}, chunk_bytes=1024, seed=3)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 42, 7, 200, 3]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, reloaded(ids).logits)


def test_incomplete_write_raises_and_leaves_nothing(tmp_path):
    path = tmp_path / "partial.safetensors"
    writer = StreamingSafetensorsWriter(path, [("w", "F32", (4,)), ("v", "F16", (2,))])
    writer.write("w", 0, bytes(8))
    writer.write("v", 0, bytes(4))
    with pytest.raises(ValueError, match="'w', 8 of 16"):
        writer.close()
    writer.abort()
    assert not path.exists()


def test_incomplete_inside_with_leaves_nothing(tmp_path):
    path = tmp_path / "partial.safetensors"
    with pytest.raises(ValueError):
        with StreamingSafetensorsWriter(path, [("w", "F32", (4,))]) as writer:
            writer.write("w", 4, bytes(12))
    assert not path.exists()


def test_exception_inside_with_leaves_nothing(tmp_path):
    path = tmp_path / "boom.safetensors"
    with pytest.raises(RuntimeError):
        with StreamingSafetensorsWriter(path, [("w", "F32", (1,))]) as writer:
            writer.write("w", 0, bytes(4))  # complete, but must not be finalised
            raise RuntimeError("boom")
    assert not path.exists()


def test_overlap_and_range_errors(tmp_path):
    with StreamingSafetensorsWriter(tmp_path / "o.safetensors", [("w", "U8", (10,))]) as writer:
        writer.write("w", 2, b"abc")
        with pytest.raises(ValueError, match="overlap"):
            writer.write("w", 4, b"xy")
        with pytest.raises(ValueError, match="overlap"):
            writer.write("w", 0, b"xyz")
        with pytest.raises(ValueError, match="outside"):
            writer.write("w", 9, b"xy")
        with pytest.raises(ValueError, match="no tensor"):
            writer.write("nope", 0, b"x")
        writer.write("w", 0, b"01")
        writer.write("w", 5, b"56789")
    got, _ = load_file(tmp_path / "o.safetensors")
    assert bytes(got["w"].numpy()) == b"01abc56789"


def test_never_overwrites(tmp_path):
    path = tmp_path / "exists.safetensors"
    path.write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        StreamingSafetensorsWriter(path, [("w", "U8", (1,))])
    assert path.read_bytes() == b"keep"


def test_invalid_entries(tmp_path):
    for entries in ([("w", "F12", (1,))], [("w", "F32", (1,)), ("w", "F32", (1,))], [("w", "F32", (-1,))]):
        with pytest.raises(ValueError):
            StreamingSafetensorsWriter(tmp_path / "x.safetensors", entries)
    assert not (tmp_path / "x.safetensors").exists()


def test_threaded_writes(tmp_path):
    data = os.urandom(64 * 1000)
    path = tmp_path / "t.safetensors"
    with StreamingSafetensorsWriter(path, [("w", "U8", (64, 1000))]) as writer:
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda i: writer.write("w", i * 1000, data[i * 1000 : (i + 1) * 1000]), range(64)))
    got, _ = load_file(path)
    assert got["w"].numpy().tobytes() == data


# -- copy_range ---------------------------------------------------------------


@pytest.fixture()
def source_fd(tmp_path):
    payload = os.urandom(5000)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    fd = os.open(src, os.O_RDONLY)
    yield fd, payload
    os.close(fd)


def copy_and_check(tmp_path, source_fd, name="out.safetensors"):
    fd, payload = source_fd
    path = tmp_path / name
    with StreamingSafetensorsWriter(path, [("a", "U8", (100,)), ("b", "U8", (3000,))]) as writer:
        assert writer.copy_range("b", 0, fd, 1000, 2000) == 2000
        assert writer.copy_range("b", 2000, fd, 0, 1000) == 1000
        writer.write("a", 0, payload[:100])
        assert writer.bytes_copied == 3000
    got, _ = load_file(path)
    assert got["b"].numpy().tobytes() == payload[1000:3000] + payload[:1000]
    assert got["a"].numpy().tobytes() == payload[:100]


def test_copy_range_kernel_path(tmp_path, source_fd):
    copy_and_check(tmp_path, source_fd)


def test_copy_range_fallback(tmp_path, source_fd, monkeypatch):
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    copy_and_check(tmp_path, source_fd)
    assert len(calls) == 1  # not retried once refused


def test_copy_range_short_copies(tmp_path, source_fd, monkeypatch):
    real = os.copy_file_range

    def short(src, dst, count, offset_src=None, offset_dst=None):
        return real(src, dst, min(count, 333), offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", short)
    copy_and_check(tmp_path, source_fd)


@pytest.mark.parametrize("kernel", [True, False])
def test_copy_range_truncated_source(tmp_path, source_fd, monkeypatch, kernel):
    if not kernel:
        monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSYS, "no")),
                            raising=False)
    fd, _ = source_fd
    path = tmp_path / "t.safetensors"
    with pytest.raises(CorruptCheckpointError, match="ended at byte 5000"):
        with StreamingSafetensorsWriter(path, [("b", "U8", (3000,))]) as writer:
            writer.copy_range("b", 0, fd, 4000, 3000)
    assert not path.exists()


def test_copy_range_from_real_checkpoint(tmp_path, checkpoint_factory):
    source = checkpoint_factory("llama", "bf16", False) / "model.safetensors"
    tensors, metadata = load_file(source)
    header_len, doc = raw_header(source)
    entries = [(n, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    out = tmp_path / "copied.safetensors"
    fd = os.open(source, os.O_RDONLY)
    try:
        with StreamingSafetensorsWriter(out, entries, metadata) as writer:
            for name in tensors:
                begin, end = doc[name]["data_offsets"]
                writer.copy_range(name, 0, fd, 8 + header_len + begin, end - begin)
    finally:
        os.close(fd)
    got, got_meta = load_file(out)
    assert got_meta == metadata
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
