"""create_shard + ShardWriter: files that safetensors and transformers load,
written in any order from any thread, every byte exactly once."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from mergepipe.storage.writer import ShardWriter, create_shard
from tests.fixtures.checkpoints import checkpoint_files
from tests.storage.helpers import raw_header

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
               torch.uint8: "U8"}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def load_file(path):
    with safe_open(str(path), framework="pt") as handle:
        return {n: handle.get_tensor(n) for n in handle.keys()}, handle.metadata()


def entries_of(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(n, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]


def shuffled_pieces(tensors, chunk_bytes: int, seed: int) -> list[tuple[str, int, bytes]]:
    """Every tensor cut into ``chunk_bytes`` pieces, in a random order across tensors."""
    pieces = []
    for name, t in tensors.items():
        data = tensor_bytes(t)
        pieces += [(name, off, data[off : off + chunk_bytes]) for off in range(0, len(data), chunk_bytes)]
    random.Random(seed).shuffle(pieces)
    return pieces


def write_shuffled(path, tensors, metadata, chunk_bytes, seed=0, threads=1):
    """Create ``path`` and write ``tensors`` into it in random chunk order."""
    layout = create_shard(path, entries_of(tensors), metadata)
    writer = ShardWriter(layout)
    pieces = shuffled_pieces(tensors, chunk_bytes, seed)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda piece: writer.write(*piece), pieces))
    writer.finish()
    return layout, writer


def assert_loads_as(path, tensors, metadata):
    got, got_meta = load_file(path)
    assert got_meta == metadata
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


# -- round trips ----------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("variant", [("llama", "bf16", False), ("qwen3", "f32", True), ("llama", "f16", True)])
def test_round_trip_random_block_order(tmp_path, checkpoint_factory, variant, threads):
    for source in checkpoint_files(checkpoint_factory(*variant)):
        tensors, metadata = load_file(source)
        out = tmp_path / source.name
        layout, writer = write_shuffled(out, tensors, metadata, chunk_bytes=300, seed=threads, threads=threads)
        assert_loads_as(out, tensors, metadata)
        header_len, _ = raw_header(out)
        data_bytes = sum(len(tensor_bytes(t)) for t in tensors.values())
        assert layout.data_start == 8 + header_len
        assert writer.bytes_written == data_bytes  # data only, no header
        assert out.stat().st_size == layout.data_start + writer.bytes_written == layout.file_size


def test_several_writers_fill_one_shard(tmp_path, checkpoint_factory):
    """Workers own disjoint tensors of one created file and write concurrently."""
    source = checkpoint_files(checkpoint_factory("llama", "bf16", False))[0]
    tensors, metadata = load_file(source)
    out = tmp_path / "shared.safetensors"
    layout = create_shard(out, entries_of(tensors), metadata)
    names = list(tensors)
    groups = [names[0::3], names[1::3], names[2::3]]

    def work(group: list[str]) -> int:
        with ShardWriter(layout, group) as w:
            for name, off, data in shuffled_pieces({n: tensors[n] for n in group}, 512, seed=len(group)):
                w.write(name, off, data)
            w.finish()
            return w.bytes_written

    with ThreadPoolExecutor(max_workers=3) as pool:
        written = list(pool.map(work, groups))
    assert written == [sum(len(tensor_bytes(tensors[n])) for n in g) for g in groups]
    assert out.stat().st_size == layout.data_start + sum(written)
    assert_loads_as(out, tensors, metadata)


def test_edge_tensors_round_trip(tmp_path):
    tensors = {
        "scalar": torch.tensor(1.25),
        "empty": torch.zeros((0, 3), dtype=torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([1, 0, 1], dtype=torch.uint8),
    }
    path = tmp_path / "e.safetensors"
    write_shuffled(path, tensors, None, chunk_bytes=7)
    assert_loads_as(path, tensors, None)
    _, doc = raw_header(path)
    assert "__metadata__" not in doc


def test_layout_follows_entry_order(tmp_path):
    path = tmp_path / "o.safetensors"
    layout = create_shard(path, [("b", "F32", (2,)), ("a", "F32", (3,))])
    header_len, doc = raw_header(path)
    assert doc["b"]["data_offsets"] == [0, 8] and doc["a"]["data_offsets"] == [8, 20]
    assert (layout.slot("b").begin, layout.slot("b").end) == (0, 8)
    assert (layout.slot("a").begin, layout.slot("a").end) == (8, 20)
    assert layout.slot("a").shape == (3,) and layout.slot("a").dtype == "F32"
    assert layout.data_start == 8 + header_len and layout.path == path
    assert path.stat().st_size == layout.file_size == layout.data_start + 20  # preallocated
    with pytest.raises(ValueError, match="no tensor 'c'"):
        layout.slot("c")
    with ShardWriter(layout) as writer:
        writer.write("a", 0, torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes())
        writer.write("b", 0, torch.tensor([4.0, 5.0]).numpy().tobytes())
        writer.finish()
    raw = path.read_bytes()[layout.data_start :]
    assert raw == torch.tensor([4.0, 5.0, 1.0, 2.0, 3.0]).numpy().tobytes()


@pytest.mark.parametrize("name_length", range(1, 9))
def test_header_is_padded_to_eight_bytes(tmp_path, name_length):
    """Names of every length mod 8 give headers whose padded end is aligned."""
    path = tmp_path / "a.safetensors"
    tensors = {"x" * name_length: torch.arange(6, dtype=torch.float32)}
    layout, _ = write_shuffled(path, tensors, {"k": "v" * name_length}, chunk_bytes=5)
    header_len, doc = raw_header(path)  # json.loads accepts the trailing spaces
    assert (8 + header_len) % 8 == 0
    assert layout.data_start == 8 + header_len
    text = path.read_bytes()[8 : 8 + header_len]
    body = text.rstrip(b" ")
    assert json.loads(body) == doc and len(text) - len(body) < 8  # padding: a few spaces, no more
    assert_loads_as(path, tensors, {"k": "v" * name_length})


def test_transformers_loads_written_model(tmp_path, checkpoint_factory):
    from transformers import AutoModelForCausalLM

    source = checkpoint_factory("llama", "bf16", False)
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    out = tmp_path / "written"
    out.mkdir()
    shutil.copy(source / "config.json", out / "config.json")
    state = {n: t.detach() for n, t in original.state_dict().items()}
    write_shuffled(out / "model.safetensors", state, {"format": "pt"}, chunk_bytes=1024, seed=3, threads=3)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 42, 7, 200, 3]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, reloaded(ids).logits)


# -- creating ---------------------------------------------------------------------


def test_create_never_overwrites(tmp_path):
    path = tmp_path / "exists.safetensors"
    path.write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        create_shard(path, [("w", "U8", (1,))])
    assert path.read_bytes() == b"keep"


def test_second_create_leaves_the_first_shard_alone(tmp_path):
    path = tmp_path / "s.safetensors"
    tensors = {"w": torch.arange(5, dtype=torch.uint8)}
    write_shuffled(path, tensors, None, chunk_bytes=2)
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        create_shard(path, [("w", "U8", (1000,))])
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "entries, metadata",
    [
        ([("w", "F12", (1,))], None),
        ([("w", "F32", (1,)), ("w", "F32", (1,))], None),
        ([("w", "F32", (-1,))], None),
        ([("w", "F32", (2.0,))], None),
        ([("w", "F32", (True,))], None),
        ([("__metadata__", "F32", (1,))], None),
        ([("w", "F32", (1,))], {"k": 1}),
    ],
)
def test_invalid_entries_create_nothing(tmp_path, entries, metadata):
    with pytest.raises(ValueError):
        create_shard(tmp_path / "x.safetensors", entries, metadata)
    assert not (tmp_path / "x.safetensors").exists()


def test_failed_preallocation_removes_the_file(tmp_path, monkeypatch):
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate: nothing to fail")

    def disk_full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", disk_full)
    path = tmp_path / "big.safetensors"
    with pytest.raises(OSError) as info:
        create_shard(path, [("w", "U8", (100,))])
    assert info.value.errno == errno.ENOSPC
    assert not path.exists()


def test_filesystem_without_fallocate_still_gets_a_full_size_file(tmp_path, monkeypatch):
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate")

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    path = tmp_path / "s.safetensors"
    layout = create_shard(path, [("w", "U8", (100,))])
    assert path.stat().st_size == layout.file_size == layout.data_start + 100


# -- completeness and refusals ---------------------------------------------------


def test_incomplete_tensor_makes_finish_raise(tmp_path):
    path = tmp_path / "partial.safetensors"
    layout = create_shard(path, [("v", "F16", (2,)), ("w", "F32", (4,))])
    writer = ShardWriter(layout)
    writer.write("w", 0, bytes(8))
    writer.write("v", 0, bytes(4))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) not fully written \(first: 'w', 8 of 16 bytes\)"):
        writer.finish()
    assert path.exists()  # removing the staging area is the caller's job
    with pytest.raises(ValueError, match="closed"):  # finish closes even when it refuses
        writer.write("w", 8, bytes(8))


def test_first_incomplete_tensor_is_named(tmp_path):
    layout = create_shard(tmp_path / "p.safetensors", [("a", "U8", (4,)), ("b", "U8", (4,))])
    with ShardWriter(layout) as writer:
        writer.write("b", 1, b"x")
        with pytest.raises(ValueError, match=r"2 tensor\(s\) not fully written \(first: 'a', 0 of 4 bytes\)"):
            writer.finish()


def test_overlap_and_range_errors(tmp_path):
    path = tmp_path / "o.safetensors"
    layout = create_shard(path, [("w", "U8", (10,))])
    with ShardWriter(layout) as writer:
        writer.write("w", 2, b"abc")
        with pytest.raises(ValueError, match="overlap"):
            writer.write("w", 4, b"xy")
        with pytest.raises(ValueError, match="overlap"):
            writer.write("w", 0, b"xyz")
        with pytest.raises(ValueError, match="overlap"):
            writer.write("w", 2, b"abc")  # the same bytes twice
        with pytest.raises(ValueError, match="outside"):
            writer.write("w", 9, b"xy")
        with pytest.raises(ValueError, match="outside"):
            writer.write("w", -1, b"x")
        with pytest.raises(ValueError, match="no tensor"):
            writer.write("nope", 0, b"x")
        writer.write("w", 0, b"01")
        writer.write("w", 5, b"56789")
        assert writer.bytes_written == 10  # refused writes count nothing
        writer.finish()
    got, _ = load_file(path)
    assert bytes(got["w"].numpy()) == b"01abc56789"


def test_writer_for_a_subset_refuses_other_tensors(tmp_path):
    path = tmp_path / "s.safetensors"
    layout = create_shard(path, [("a", "U8", (3,)), ("b", "U8", (2,))])
    with pytest.raises(ValueError, match="no tensor 'zz'"):
        ShardWriter(layout, ["a", "zz"])
    with ShardWriter(layout, ["a"]) as writer:
        with pytest.raises(ValueError, match="'b' is not one this writer writes"):
            writer.write("b", 0, b"xy")
        writer.write("a", 0, b"abc")
        writer.finish()  # complete: 'b' is another writer's business
        assert writer.bytes_written == 3
    with ShardWriter(layout, ["b"]) as other:
        other.write("b", 0, b"de")
        other.finish()
    got, _ = load_file(path)
    assert bytes(got["a"].numpy()) + bytes(got["b"].numpy()) == b"abcde"


def test_threaded_writes_to_one_tensor(tmp_path):
    data = os.urandom(64 * 1000)
    path = tmp_path / "t.safetensors"
    layout = create_shard(path, [("w", "U8", (64, 1000))])
    with ShardWriter(layout) as writer:
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda i: writer.write("w", i * 1000, data[i * 1000 : (i + 1) * 1000]), range(64)))
        assert writer.bytes_written == len(data)
        writer.finish()
    got, _ = load_file(path)
    assert got["w"].numpy().tobytes() == data


def test_failed_write_makes_finish_raise(tmp_path, monkeypatch):
    layout = create_shard(tmp_path / "f.safetensors", [("a", "U8", (4,)), ("b", "U8", (4,))])
    writer = ShardWriter(layout)
    real_pwrite = os.pwrite

    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", disk_full)
    with pytest.raises(OSError):
        writer.write("a", 0, b"abcd")
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    writer.write("b", 0, b"efgh")
    assert writer.bytes_written == 4
    with pytest.raises(ValueError, match="a write failed"):
        writer.finish()


def test_exception_inside_with_closes_and_keeps_the_file(tmp_path):
    """Leaving the block closes the writer without a completeness check; the
    file stays for the caller to publish or remove with its staging area."""
    path = tmp_path / "boom.safetensors"
    layout = create_shard(path, [("w", "F32", (2,))])
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(layout) as writer:
            writer.write("w", 0, bytes(4))
            raise RuntimeError("boom")
    assert path.stat().st_size == layout.file_size
    with pytest.raises(ValueError, match="closed"):
        writer.write("w", 4, bytes(4))


def test_write_after_close_is_refused(tmp_path):
    layout = create_shard(tmp_path / "c.safetensors", [("a", "U8", (2,))])
    writer = ShardWriter(layout)
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        writer.write("a", 0, b"xy")
