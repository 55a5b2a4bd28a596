"""Cold page cache and per-run measurement of a child process.

``drop_cache(paths)`` evicts files from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (clean pages only: call ``os.sync()``
first if they were just written). ``run_measured(cmd)`` runs one command in its
own child process and returns its wall time, peak RSS and physical I/O:

- peak RSS from ``os.wait4``, which returns the rusage of exactly that child
  (``getrusage(RUSAGE_CHILDREN)`` would be a max over every child so far);
- peak anonymous RSS of the process tree, sampled from ``/proc/*/status`` every
  ``RSS_SAMPLE_SECONDS``: ru_maxrss also counts file pages mapped with mmap
  (safetensors' ``safe_open`` maps whole files), which the kernel can drop;
  the anonymous peak is the memory a run really needs;
- read/write bytes from ``/proc/<pid>/io``, read while the child is a zombie:
  ``os.waitid(..., WNOWAIT)`` waits for the exit without reaping it, then the
  file is read, then ``wait4`` reaps. The kernel adds reaped grandchildren's
  I/O to their parent, so a command that spawns workers is counted whole.

``resident_bytes(paths)`` counts the pages of files that are in the page cache
(``mincore``). After a ``drop_cache`` and one run, that is what the run read
from disk (readahead included), per file: the benchmarks use it to attribute
physical reads to the base and to each expert.

Ad hoc: ``python -m benchmarks.coldcache --drop DIR ... -- CMD ...`` prints
one JSON line with the measurements.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE_BYTES = mmap.PAGESIZE
RSS_SAMPLE_SECONDS = 0.05  # short enough to catch a per-tensor peak, cheap to poll


def iter_files(paths: Iterable[Path]) -> Iterator[Path]:
    """Every regular file under the given files and directories."""
    for path in map(Path, paths):
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            yield path


def drop_cache(paths: Iterable[Path]) -> int:
    """Evict every file under ``paths`` from the page cache; returns bytes advised."""
    advised = 0
    for path in iter_files(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return advised


def _file_resident_bytes(path: Path) -> int:
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap failed for {path}")
        try:
            pages = (size + PAGE_BYTES - 1) // PAGE_BYTES
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed for {path}")
            resident = sum(1 for b in bytes(vec) if b & 1)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * PAGE_BYTES)


def resident_bytes(paths: Iterable[Path]) -> int:
    """Bytes of the files under ``paths`` that are in the page cache now."""
    return sum(_file_resident_bytes(p) for p in iter_files(paths))


@dataclass(frozen=True)
class RunResult:
    cmd: list[str]
    returncode: int
    wall_seconds: float
    user_seconds: float
    sys_seconds: float
    peak_rss_bytes: int  # ru_maxrss: anonymous + file-backed mapped pages
    peak_anon_rss_bytes: int  # sampled RssAnon (a lower bound on the true peak)
    read_bytes: int  # physical reads (storage layer), /proc/<pid>/io
    write_bytes: int  # bytes of page cache dirtied for writing
    rchar: int  # bytes requested through read syscalls (cache hits included)
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def to_json(self, with_output: bool = False) -> dict:
        data = asdict(self)
        if not with_output:
            data.pop("stdout")
            data.pop("stderr")
        return data


def _read_proc_io(pid: int) -> dict[str, int]:
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except OSError:  # no /proc here: report zeros rather than guess
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in lines)}


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, from /proc/<pid>/task/<tid>/children."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(c) for c in task.read_text().split())
            except OSError:
                continue
    return pids


def _anon_rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _AnonRssSampler(threading.Thread):
    """Poll the summed RssAnon of a process tree until stopped; keep the maximum."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_bytes = pid, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            total = sum(_anon_rss_bytes(p) for p in _process_tree(self.pid))
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop_event.wait(RSS_SAMPLE_SECONDS)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return self.peak_bytes


def run_measured(
    cmd: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_seconds: float | None = None,
) -> RunResult:
    """Run ``cmd`` in a child process; measure exactly that child (and its children)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd,
                                start_new_session=True)
        sampler = _AnonRssSampler(proc.pid)
        sampler.start()
        timer = None
        if timeout_seconds is not None:
            timer = threading.Timer(timeout_seconds, os.killpg, (proc.pid, signal.SIGKILL))
            timer.start()
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
            wall = time.perf_counter() - started
            peak_anon = sampler.stop()
            io = _read_proc_io(proc.pid)
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer is not None:
                timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from waiting again
        out.seek(0)
        err.seek(0)
        return RunResult(
            cmd=[str(c) for c in cmd],
            returncode=proc.returncode,
            wall_seconds=wall,
            user_seconds=usage.ru_utime,
            sys_seconds=usage.ru_stime,
            peak_rss_bytes=usage.ru_maxrss * 1024,  # Linux reports KiB
            peak_anon_rss_bytes=peak_anon,
            read_bytes=io.get("read_bytes", 0),
            write_bytes=io.get("write_bytes", 0) - io.get("cancelled_write_bytes", 0),
            rchar=io.get("rchar", 0),
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m benchmarks.coldcache [--drop PATH ...] -- CMD ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coldcache")
    parser.add_argument("--drop", nargs="*", type=Path, default=[],
                        help="files or directories to evict from the page cache first")
    args = parser.parse_args(argv[:split])
    os.sync()
    drop_cache(args.drop)
    result = run_measured(argv[split + 1 :])
    data = result.to_json()
    data["dropped_resident_after"] = resident_bytes(args.drop)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    print(json.dumps(data))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
