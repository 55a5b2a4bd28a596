"""Run one command in a child process and measure exactly that child.

Usage: ``python -m benchmarks.measure --result PATH [--timeout S] -- CMD ...``
(normally through ``benchmarks.coldcache.run_measured``). Writes a JSON object
to PATH; the command's stdout and stderr pass through.

Why a separate small process: Linux carries a parent's peak RSS into a child
across fork+exec (``/bin/true`` started from a 800 MB Python process reports
~800 MB ``ru_maxrss``), so the process that starts the measured command must
itself be small. This module therefore imports only the standard library.

- peak RSS: ``os.wait4`` returns the rusage of exactly this child (and its
  reaped descendants); ``getrusage(RUSAGE_CHILDREN)`` would be a max over all
  children so far. ru_maxrss counts mmap'd file pages too (safetensors maps
  whole files), so the anonymous RSS of the process tree is also sampled every
  ``RSS_SAMPLE_SECONDS`` from ``/proc/*/status``;
- I/O: ``/proc/<pid>/io`` read while the child is a zombie (``os.waitid`` with
  ``WNOWAIT`` waits without reaping), then ``wait4`` reaps it. The kernel adds
  reaped descendants' I/O to their parent, so worker processes are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

RSS_SAMPLE_SECONDS = 0.05  # short enough to catch a per-tensor peak, cheap to poll


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


def _read_proc_io(pid: int) -> dict[str, int]:
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except OSError:  # no /proc/<pid>/io here: report nothing rather than guess
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in lines)}


def measure(cmd: list[str], timeout_seconds: float | None = None) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    sampler = _AnonRssSampler(proc.pid)
    sampler.start()
    timer = None
    if timeout_seconds is not None:
        timer = threading.Timer(timeout_seconds, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        wall = time.perf_counter() - started
        peak_anon = sampler.stop()
        io = _read_proc_io(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if timer is not None:
            timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from waiting again
    return {
        "returncode": proc.returncode,
        "timed_out": timeout_seconds is not None and wall >= timeout_seconds,
        "wall_seconds": wall,
        "user_seconds": usage.ru_utime,
        "sys_seconds": usage.ru_stime,
        "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        "peak_anon_rss_bytes": peak_anon,
        "proc_io": bool(io),
        "read_bytes": io.get("read_bytes", 0),
        "write_bytes": io.get("write_bytes", 0) - io.get("cancelled_write_bytes", 0),
        "rchar": io.get("rchar", 0),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m benchmarks.measure --result PATH [--timeout S] -- CMD ...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.measure")
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args(argv[:split])
    result = measure(argv[split + 1 :], args.timeout)
    args.result.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
