"""Measuring the disk and start-up rates of the cost model, as a merge meets them.

Each measurement does what the engine does with real bytes, on a file
written for it in a scratch directory (on the disk the merges use):

* ``write``: one file written block by block with positional writes, each
  block hashed (blake3, like every output block) and the file's hash fed
  as it is written (``storage/hashing.py``); ``flush``: its ``fsync``;
* ``sequential_read``: the file read cold (evicted from the page cache
  first) block after block through the engine's read-ahead, every block
  hashed on the reading threads, as the base is read and checked;
* ``random_read``: single blocks at shuffled offsets, cold, without kernel
  readahead, as planned expert blocks are read;
* ``publish_seconds``: a staging directory made, fsynced and renamed into
  place with its parent fsynced, as a snapshot is published;
* ``startup_seconds``: a fresh Python process importing what ``mergepipe
  merge`` imports, start to exit;
* ``served_startup_seconds``: what a command `mergepipe serve` runs spends
  before its first read: a fresh interpreter importing the client, and a
  fork of a process with a merge's imports loaded (this one), to its exit.

Each is bounded in time (a slow disk gets a smaller file), so calibration
stays within its 30 seconds. ``calibrate.py`` runs them, and times them
side by side with compute for the model's ``overlap``.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from mergepipe.errors import ConfigError, EngineError
from mergepipe.storage.hashing import FileHash, block_digest
from mergepipe.storage.readahead import ByteRange, ReadAhead, WorkItem
from mergepipe.storage.source import LocalFileSource
from mergepipe.txn.fsync import fsync_dir, fsync_tree

#: The most a calibration file holds: large enough to get past the disk's cache, small enough for ~2 s.
MAX_FILE_BYTES = 512 * 1024 * 1024
#: The least, whatever the time: a rate from fewer bytes is mostly noise.
MIN_FILE_BYTES = 32 * 1024 * 1024
#: Seconds each disk measurement may take (writing stops early on a slow disk).
STEP_SECONDS = 2.5
#: Reads in flight, as the engine's read-ahead has them (``engine.DEFAULT_IO_THREADS``).
READ_THREADS = 2
#: Fresh processes timed for the start-up (their mean is kept).
STARTUP_RUNS = 2
#: What a merge imports before it reads a byte (the command's module: the catalog and the planner; then, to
#: execute, ``merge_run``: torch and the engine) and, as a merge does then, the objects frozen out of the
#: collector (which makes the exit a third as long); then the process's age, measured as the engine
#: measures a merge's start-up (``engine/stream.py``: ``process_seconds``), or -1 where it cannot be read.
STARTUP_PROBE = """
import gc
import mergepipe.cli.merge_cmds
import mergepipe.cli.merge_run
from mergepipe.engine.stream import process_seconds
gc.freeze()
age = process_seconds()
print(-1 if age is None else age)
"""
#: What the `mergepipe` command imports and computes before it hands a command to a server.
CLIENT_PROBE = "import mergepipe.launch, mergepipe.served as served; served.code_fingerprint()"
#: The least exit share stored (rates are positive).
MIN_EXIT_SHARE = 0.001


def scratch_directory(parent: Path) -> Path:
    """A new directory under ``parent`` for the calibration files (ConfigError naming a missing parent)."""
    if not parent.is_dir():
        raise ConfigError(f"--dir {parent} is not a directory; give an existing directory on the disk merges use")
    path = parent / f".mergepipe-calibrate-{os.getpid()}-{time.time_ns()}"
    path.mkdir()
    return path


def write_file(path: Path, block_bytes: int, limit_bytes: int | None = None, seconds: float | None = None,
               flush: bool = True) -> tuple[int, float, float]:
    """Write blocks (each hashed, the file's hash fed, as the engine writes its output) until
    ``limit_bytes`` (``MAX_FILE_BYTES``) or, past ``MIN_FILE_BYTES``, ``seconds`` (``STEP_SECONDS``), then
    fsync it if ``flush``; ``(bytes, seconds writing, seconds fsyncing)``."""
    block = np.random.default_rng(0).integers(0, 256, size=block_bytes, dtype=np.uint8).tobytes()
    limit = max(block_bytes, (limit_bytes or MAX_FILE_BYTES) // block_bytes * block_bytes)
    seconds = STEP_SECONDS if seconds is None else seconds
    file_hash = FileHash(path, limit)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        written = 0
        while written < limit and (written < MIN_FILE_BYTES or time.perf_counter() - started < seconds):
            os.pwrite(fd, block, written)
            block_digest(block)
            file_hash.add(written, block)
            written += len(block)
        writing = time.perf_counter() - started
        started = time.perf_counter()
        if flush:
            os.fsync(fd)
        flushing = time.perf_counter() - started
    finally:
        os.close(fd)
    return written, max(writing, 1e-6), max(flushing, 1e-6)


def scattered_blocks(size: int, block_bytes: int) -> list[int]:
    """Offsets of a quarter of a file's blocks (at least 16), shuffled: reads that never follow each other."""
    count = max(1, size // block_bytes)
    chosen = random.Random(0).sample(range(count), min(count, max(16, count // 4)))
    return [i * block_bytes for i in chosen]


def read_file(path: Path, block_bytes: int, offsets: list[int] | None = None, scattered: bool = False) -> float:
    """Seconds to read the blocks at ``offsets`` (every block, in order, when None) cold through the
    engine's read-ahead, each block hashed on the reading threads; ``scattered``: without kernel readahead,
    as expert files are read."""
    evict(path)
    if offsets is None:
        offsets = list(range(0, path.stat().st_size - block_bytes + 1, block_bytes))
    items = [WorkItem(None, [ByteRange(path, o, o + block_bytes, "calibrate")]) for o in offsets]
    with LocalFileSource() as source:
        if scattered:
            source.advise_random(path)
        readahead = ReadAhead(source, READ_THREADS, 16 * block_bytes,
                              on_read=lambda item, views: [block_digest(v) for v in views])
        started = time.perf_counter()
        for fetched in readahead.run(items):
            fetched.release()
        return max(time.perf_counter() - started, 1e-6)


def evict(path: Path) -> None:
    """Drop ``path`` from the page cache (it was fsynced: its pages are clean)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_publish(directory: Path) -> float:
    """Seconds to stage a small directory, fsync it, rename it into place and fsync the parent."""
    staging, final = directory / "staging", directory / "published"
    started = time.perf_counter()
    staging.mkdir()
    (staging / "manifest.json").write_bytes(b"{}" * 2048)
    fsync_tree(staging)
    os.rename(staging, final)
    fsync_dir(directory)
    seconds = time.perf_counter() - started
    shutil.rmtree(final)
    return seconds


def _probe(code: str, imports: str) -> subprocess.CompletedProcess:
    """A fresh interpreter running ``code`` (which imports ``imports``); EngineError when it fails."""
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"cannot time the start-up: {sys.executable} importing {imports} failed ({last}); "
                          "check the installation")
    return probe


def measure_startup(runs: int | None = None) -> tuple[float, float]:
    """``(start-up seconds, exit share)``: the mean seconds of a fresh Python process importing what a merge
    imports, from its start to the end of the imports, and the seconds from there to its exit over those
    (all of it is start-up where the process's age cannot be read)."""
    times, ages = [], []
    for _ in range(runs or STARTUP_RUNS):
        started = time.perf_counter()
        probe = _probe(STARTUP_PROBE, "mergepipe")
        times.append(time.perf_counter() - started)
        ages.append(float(probe.stdout.strip() or -1))
    wall = statistics.fmean(times)
    age = statistics.fmean(ages) if min(ages) > 0 else wall
    startup = min(age, wall)
    return startup, max((wall - startup) / startup, MIN_EXIT_SHARE)


def measure_served_startup(runs: int | None = None) -> float | None:
    """The mean seconds a served command takes to start (module docstring), or None where processes
    cannot fork."""
    if not hasattr(os, "fork"):
        return None
    times = []
    for _ in range(runs or STARTUP_RUNS):
        started = time.perf_counter()
        _probe(CLIENT_PROBE, "mergepipe.launch")
        with warnings.catch_warnings():  # a progress display's thread: harmless, the child only exits
            warnings.simplefilter("ignore", DeprecationWarning)
            child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        times.append(time.perf_counter() - started)
    return statistics.fmean(times)
