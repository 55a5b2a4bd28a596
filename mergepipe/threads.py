"""How many cores torch's intra-op pool may use while MergePipe works.

Analysis and merging overlap reads (and blake3 hashing) on a background
thread with torch math on the main one. Letting torch's OpenMP pool take
every core then makes its workers spin against our own I/O thread (on a
small machine analysis runs several times slower: BENCHMARKS.md, "Analysis
throughput"). So by default torch gets all cores but one while MergePipe runs, and the
previous setting is restored afterwards.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch


def default_compute_threads() -> int:
    """All cores but one (at least one): the spare core runs reads and hashing."""
    return max(1, (os.cpu_count() or 1) - 1)


@contextmanager
def compute_threads(threads: int | None = None) -> Iterator[int]:
    """Run a block with ``threads`` intra-op torch threads (default above)."""
    wanted = default_compute_threads() if threads is None else max(1, threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(previous)
