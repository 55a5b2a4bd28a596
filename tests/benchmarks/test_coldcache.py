"""The suite's cache control (benchmarks/coldcache.py): a run's inputs read through once and evicted again
leave none of their pages in this machine's page cache, and every byte was read."""

from __future__ import annotations

import os

from benchmarks.coldcache import READ_THROUGH_CHUNK, read_through, resident_bytes


def test_read_through_reads_every_byte_and_leaves_nothing_cached(tmp_path):
    sizes = {"a/one.bin": 3 * READ_THROUGH_CHUNK + 17, "a/two.bin": 1, "b.bin": 4096, "a/empty.bin": 0}
    for name, size in sizes.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
    os.sync()  # written pages are dirty until then, and an advice to drop them is ignored
    paths = [tmp_path / "a", tmp_path / "b.bin"]
    assert read_through(paths) == sum(sizes.values())
    assert resident_bytes(paths) == 0
