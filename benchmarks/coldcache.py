"""Cold page cache, page-cache residency, and per-run measurement of a command.

``drop_cache(paths)`` evicts files from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (clean pages only: call ``os.sync()``
first if they were just written).

``resident_bytes(paths)`` counts the pages of files that are in the page cache
now (``mincore``). After a ``drop_cache`` and one run, that is what the run
read from disk (readahead included), per file: the suite uses it to attribute
physical reads to the base and to the experts.

``run_measured(cmd)`` runs one command through the small ``benchmarks.measure``
wrapper (see there why a wrapper) and returns its wall time, peak RSS and
physical I/O.

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
import subprocess
import sys
import tempfile
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
MEASURE_SCRIPT = Path(__file__).with_name("measure.py")


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


def run_measured(
    cmd: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_seconds: float | None = None,
) -> RunResult:
    """Run ``cmd`` in its own child process; measure exactly that child (and its children)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        # run by path: works from any cwd, imports nothing but the standard library
        wrapper = [sys.executable, str(MEASURE_SCRIPT), "--result", str(result_path)]
        if timeout_seconds is not None:
            wrapper += ["--timeout", str(timeout_seconds)]
        proc = subprocess.run([*wrapper, "--", *map(str, cmd)], env=env, cwd=cwd,
                              capture_output=True, text=True, errors="replace")
        if not result_path.exists():
            raise RuntimeError(f"measurement wrapper failed for {cmd}: {proc.stderr[-500:]}")
        data = json.loads(result_path.read_text())
    return RunResult(
        cmd=[str(c) for c in cmd],
        returncode=data["returncode"],
        wall_seconds=data["wall_seconds"],
        user_seconds=data["user_seconds"],
        sys_seconds=data["sys_seconds"],
        peak_rss_bytes=data["peak_rss_bytes"],
        peak_anon_rss_bytes=data["peak_anon_rss_bytes"],
        read_bytes=data["read_bytes"],
        write_bytes=data["write_bytes"],
        rchar=data["rchar"],
        stdout=proc.stdout,
        stderr=proc.stderr,
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
