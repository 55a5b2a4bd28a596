"""The suite's cache control (benchmarks/coldcache.py): files read are resident in the page cache, and after
``drop_cache`` none of their pages are (``mincore``, counted independently of how they were evicted)."""

from __future__ import annotations

import os

from benchmarks.coldcache import PAGE_BYTES, drop_cache, resident_bytes


def test_a_dropped_file_has_no_page_in_the_cache_and_a_read_one_has_them_all(tmp_path):
    sizes = {"a/one.bin": 3 * PAGE_BYTES + 17, "a/two.bin": 1, "b.bin": 4 * PAGE_BYTES, "a/empty.bin": 0}
    for name, size in sizes.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
    os.sync()  # written pages are dirty until then, and an advice to drop them is ignored
    paths = [tmp_path / "a", tmp_path / "b.bin"]
    assert drop_cache(paths) == sum(sizes.values())
    assert resident_bytes(paths) == 0
    (tmp_path / "b.bin").read_bytes()
    assert resident_bytes(paths) == 4 * PAGE_BYTES
