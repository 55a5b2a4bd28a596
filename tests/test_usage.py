"""process_usage: this process's CPU, peak RSS and storage-layer I/O, checked in a fresh interpreter against
what that interpreter did (a known allocation, CPU time by time.process_time, an fsync'd write)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.planner.support import PYTHON, subprocess_env

CHILD = """
import json, os, sys, time
from mergepipe.runtime import process_usage

held = bytearray(300 * 2**20)
held[::4096] = b"x" * len(held[::4096])  # touch every page: resident
deadline = time.process_time() + 0.3
while time.process_time() < deadline:
    pass
with open(sys.argv[1], "wb") as f:
    f.write(os.urandom(8 * 2**20))
    f.flush()
    os.fsync(f.fileno())
cpu = time.process_time()
print(json.dumps({"usage": process_usage(), "cpu": cpu}))
"""


def _filesystem(path: Path) -> str:
    """The type of the filesystem mounted deepest above ``path`` (from /proc/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def test_usage_counts_what_the_process_did(tmp_path):
    target = tmp_path / "written.bin"
    proc = subprocess.run([PYTHON, "-c", CHILD, str(target)], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    usage = out["usage"]
    assert out["cpu"] >= 0.3 and abs(usage["cpu_seconds"] - out["cpu"]) < 0.05
    assert usage["peak_rss_bytes"] >= 300 * 2**20
    if usage["write_bytes"] is not None and _filesystem(tmp_path) not in ("tmpfs", "ramfs", ""):
        assert usage["write_bytes"] >= 8 * 2**20
    assert set(usage) == {"cpu_seconds", "peak_rss_bytes", "read_bytes", "write_bytes"}
