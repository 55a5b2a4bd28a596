"""FileHash: the blake3 of a file fed with its pieces as they are written, in any order, from any thread,
equals the blake3 library's hash of the file read back from disk (what ``b3sum`` prints); file_digest hashes
a file on disk with either algorithm a manifest can name."""

from __future__ import annotations

import hashlib
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import blake3
import pytest
import torch

from mergepipe.storage import source as hashing
from mergepipe.storage.source import FileHash, file_digest
from mergepipe.storage.writer import ShardWriter, create_shard

SIZE = 300_000


def on_disk(path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def pieces(size: int, seed: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut at random points into (offset, length) pieces."""
    rng = random.Random(seed)
    cuts = sorted({0, size, *(rng.randrange(1, size) for _ in range(60))})
    return [(a, b - a) for a, b in zip(cuts, cuts[1:])]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(SIZE))
    return path


def test_pieces_in_order_hash_as_they_come(data_file):
    data = data_file.read_bytes()
    hasher = FileHash(data_file, SIZE)
    for offset, n in pieces(SIZE, 1):
        hasher.add(offset, data[offset : offset + n])
        assert hasher.hashed_bytes == offset + n  # nothing waits
    assert hasher.hexdigest() == on_disk(data_file)
    assert hasher.read_back_bytes == 0


@pytest.mark.parametrize("reorder_bytes", [0, 10_000, SIZE])
@pytest.mark.parametrize("seed", [2, 3])
def test_pieces_in_any_order_from_threads_give_the_files_hash(data_file, reorder_bytes, seed):
    """Out-of-order pieces wait as copies within the bound, else are read back from the file in turn."""
    data = data_file.read_bytes()
    parts = pieces(SIZE, seed)
    random.Random(seed).shuffle(parts)
    hasher = FileHash(data_file, SIZE, reorder_bytes=reorder_bytes)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: hasher.add(p[0], memoryview(data)[p[0] : p[0] + p[1]]), parts))
    assert hasher.hexdigest() == on_disk(data_file)
    if reorder_bytes == 0:
        assert hasher.read_back_bytes > 0  # nothing out of order was kept in memory
    if reorder_bytes == SIZE:
        assert hasher.read_back_bytes == 0  # everything fitted


def test_a_range_given_by_length_is_read_from_the_file(data_file):
    data = data_file.read_bytes()
    hasher = FileHash(data_file, SIZE)
    hasher.add(1000, data[1000:])
    hasher.add(0, length=1000)  # e.g. a header written by someone else
    assert hasher.hexdigest() == on_disk(data_file)
    assert hasher.read_back_bytes == 1000


def test_a_caller_may_reuse_its_buffer_after_add(data_file):
    """A piece that waits is copied: the writer's buffer goes back to its pool at once."""
    data = data_file.read_bytes()
    hasher = FileHash(data_file, SIZE)
    buffer = bytearray(data[SIZE // 2 :])
    hasher.add(SIZE // 2, buffer)
    buffer[:] = bytes(len(buffer))  # reused for something else
    hasher.add(0, data[: SIZE // 2])
    assert hasher.hexdigest() == on_disk(data_file)


def test_missing_bytes_refuse_a_digest(data_file):
    data = data_file.read_bytes()
    hasher = FileHash(data_file, SIZE)
    hasher.add(0, data[:100])
    hasher.add(200, data[200:])
    with pytest.raises(ValueError, match="hashed 100 of 300000 bytes"):
        hasher.hexdigest()


@pytest.mark.parametrize("offset, n", [(0, 10), (-1, 5), (SIZE - 5, 10)])
def test_bytes_added_twice_or_outside_the_file_are_refused(data_file, offset, n):
    hasher = FileHash(data_file, SIZE)
    hasher.add(0, bytes(10))
    with pytest.raises(ValueError):
        hasher.add(offset, bytes(n))


def test_a_failed_read_back_leaves_no_digest(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(50))
    hasher = FileHash(path, 100)  # the file is shorter than the writer claims
    with pytest.raises(ValueError, match="ends at 50"):
        hasher.add(0, length=100)
    with pytest.raises(ValueError, match="failed part-way"):
        hasher.hexdigest()


@pytest.mark.parametrize("threads", [1, 4])
def test_shard_writers_feed_the_hash_of_the_shard_they_write(tmp_path, threads):
    """create_shard's header (added by length) and tensors written by several writers in random order."""
    tensors = {f"t{i}": torch.randn(37 + 13 * i, 11) for i in range(6)}
    layout = create_shard(tmp_path / "m.safetensors", [(n, "F32", tuple(t.shape)) for n, t in tensors.items()],
                          {"format": "pt"})
    hasher = FileHash(layout.path, layout.file_size, reorder_bytes=4096)
    hasher.add(0, length=layout.data_start)
    names = list(tensors)
    owned = [names[0::2], names[1::2]]
    writers = [ShardWriter(layout, own, hasher=hasher) for own in owned]
    jobs = []
    for writer, own in zip(writers, owned):
        for name in own:
            raw = tensors[name].numpy().tobytes()
            jobs += [(writer, name, off, raw[off : off + 700]) for off in range(0, len(raw), 700)]
    random.Random(5).shuffle(jobs)
    lock = threading.Lock()
    done: list[int] = []

    def write(job):
        writer, name, offset, raw = job
        writer.write(name, offset, raw)
        with lock:
            done.append(offset)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, jobs))
    for writer in writers:
        writer.finish()
    assert len(done) == len(jobs)
    assert hasher.hexdigest() == on_disk(layout.path)


@pytest.mark.parametrize("piece", [1, 7, 4096, 8 * 1024 * 1024])
def test_file_digest_of_either_algorithm_for_any_read_size(data_file, monkeypatch, piece):
    monkeypatch.setattr(hashing, "READ_BACK_BYTES", piece)
    data = data_file.read_bytes()
    assert file_digest(data_file) == blake3.blake3(data).hexdigest()
    assert file_digest(data_file, "blake3") == blake3.blake3(data).hexdigest()
    assert file_digest(data_file, "sha256") == hashlib.sha256(data).hexdigest()


def test_file_digest_refuses_an_unknown_algorithm(data_file):
    with pytest.raises(ValueError, match="unknown file hash 'md5'"):
        file_digest(data_file, "md5")
