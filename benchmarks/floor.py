"""The I/O floor of one merge on this machine, measured beside it in the same run.

floor = a cold ``cat`` of the base's weight files
      + the expert bytes the merge reads, read cold
      + a write of the output's size, fsync'd.

Each part runs alone, after ``os.sync()`` and a cold page cache for every
input (``coldcache.drop_cache``), so the floor is what the disk alone needs
for the bytes a merge cannot avoid. For a MergePipe run the expert part is
exactly the plan's ranges (adjacent planned blocks coalesced into one read,
no kernel readahead, as the engine reads them); for a full-read system it is
a cold ``cat`` of every expert's weight files. Each part is the best of
``TRIALS`` tries: a disk shared with other work is noisy, and a floor raised
by one slow try would flatter the merge. A merge overlaps reads, compute and
writes, so it may in principle come under the sum; ``wall / floor`` is how
far each run is from it.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from benchmarks.checkpoints import weight_files
from benchmarks.coldcache import drop_cache
from mergepipe.catalog import Catalog
from mergepipe.planner.reads import expert_ranges
from mergepipe.spec.plan import Plan

#: Bytes per write and per read of the floor's own I/O: large sequential requests, as ``cat`` and ``dd`` make.
CHUNK_BYTES = 8 * 1024 * 1024

#: Tries of each part; the floor takes the fastest.
TRIALS = 2

#: (file, begin, end) byte ranges.
Ranges = list[tuple[Path, int, int]]


@dataclass(frozen=True)
class Floor:
    base_seconds: float  # cold cat of the base's weight files
    expert_seconds: float  # the expert bytes, read cold
    expert_bytes: int
    write_seconds: float  # output_bytes written and fsync'd
    output_bytes: int

    @property
    def seconds(self) -> float:
        return self.base_seconds + self.expert_seconds + self.write_seconds


def _cold(inputs: Iterable[Path]) -> None:
    os.sync()
    drop_cache(list(inputs))


def cat_seconds(files: Sequence[Path], inputs: Sequence[Path]) -> float:
    """A cold ``cat FILES > /dev/null``."""
    _cold(inputs)
    started = time.perf_counter()
    if files:
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def ranges_seconds(ranges: Ranges, inputs: Sequence[Path]) -> float:
    """Positional reads of exactly ``ranges`` (sorted per file), cold, without kernel readahead."""
    _cold(inputs)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    fds: dict[Path, int] = {}
    started = time.perf_counter()
    try:
        for path, begin, end in sorted(ranges):
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_RANDOM)
            while begin < end:
                got = os.preadv(fds[path], [view[: min(CHUNK_BYTES, end - begin)]], begin)
                if got <= 0:
                    raise OSError(f"{path} ends at {begin}, before {end}")
                begin += got
    finally:
        for fd in fds.values():
            os.close(fd)
    return time.perf_counter() - started


def write_seconds(nbytes: int, scratch: Path) -> float:
    """Write ``nbytes`` into a new file under ``scratch`` and fsync it (``write_file``); the seconds it took."""
    path = scratch / "floor-write.bin"
    os.sync()
    started = time.perf_counter()
    write_file(path, nbytes)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def write_file(path: Path, nbytes: int) -> None:
    """Write ``nbytes`` (not zeros: nothing may skip them) into a new file at ``path`` and fsync it."""
    chunk = os.urandom(CHUNK_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, memoryview(chunk)[: min(CHUNK_BYTES, nbytes - done)])
        os.fsync(fd)
    finally:
        os.close(fd)


def plan_ranges(db: Path, plan_id: str) -> Ranges:
    """The expert byte ranges a saved MergePipe plan reads (its planned blocks, less blocks reused)."""
    with Catalog.open(db) as catalog:
        return expert_ranges(catalog, Plan.from_json(catalog.plans.get(plan_id)))


def measure(base: Path, experts: Sequence[Path], expert_ranges: Ranges | None, output_bytes: int,
            scratch: Path) -> Floor:
    """The floor of a merge of ``experts`` into ``base``: ``expert_ranges`` read (None: every expert file
    read whole), ``output_bytes`` written."""
    inputs = [base, *experts]
    if expert_ranges is None:
        files = [f for e in experts for f in weight_files(e)]
        expert_bytes = sum(f.stat().st_size for f in files)
        experts_s = min(cat_seconds(files, inputs) for _ in range(TRIALS))
    else:
        expert_bytes = sum(end - begin for _, begin, end in expert_ranges)
        experts_s = min(ranges_seconds(expert_ranges, inputs) for _ in range(TRIALS))
    return Floor(
        base_seconds=min(cat_seconds(weight_files(base), inputs) for _ in range(TRIALS)),
        expert_seconds=experts_s,
        expert_bytes=expert_bytes,
        write_seconds=min(write_seconds(output_bytes, scratch) for _ in range(TRIALS)),
        output_bytes=output_bytes,
    )
