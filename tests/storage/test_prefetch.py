"""Read-ahead while a command starts up (storage/prefetch.py): the kernel reads the ranges given, in
order, no more than the limit, and a range that cannot be advised is skipped without an error."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from benchmarks.coldcache import drop_cache, resident_bytes
from mergepipe.storage import prefetch as prefetch_module
from mergepipe.storage.prefetch import default_limit, prefetch

MIB = 1024 * 1024


@pytest.fixture
def cold_files(tmp_path) -> list[Path]:
    files = []
    for name in "abc":
        path = tmp_path / name
        path.write_bytes(os.urandom(2 * MIB))
        files.append(path)
    os.sync()
    drop_cache(files)
    if resident_bytes(files):
        pytest.skip("this filesystem keeps files in memory (tmpfs?): nothing to read ahead")
    return files


def _finish(thread: threading.Thread | None) -> None:
    assert thread is not None and thread.daemon
    thread.join(timeout=30)
    assert not thread.is_alive()


def _resident(path: Path, expected: int) -> int:
    """Bytes of ``path`` in the page cache once ``expected`` of them are (or 10 s have passed): the
    advice only submits the reads, which complete after it returns."""
    deadline = time.monotonic() + 10
    while resident_bytes([path]) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return resident_bytes([path])


def test_the_ranges_are_read_in_order_up_to_the_limit(cold_files, monkeypatch):
    monkeypatch.setattr(prefetch_module, "ADVICE_BYTES", MIB // 2)  # several calls per range
    a, b, c = cold_files
    _finish(prefetch([(a, 0, 2 * MIB), (b, 0, 2 * MIB), (c, 0, 2 * MIB)], 3 * MIB))
    assert _resident(a, 2 * MIB) == 2 * MIB
    assert _resident(b, MIB) == MIB
    assert resident_bytes([c]) == 0


def test_only_the_given_bytes_are_read(cold_files):
    a, _, _ = cold_files
    _finish(prefetch([(a, MIB // 2, MIB)], 100 * MIB))
    assert _resident(a, MIB // 2) == MIB // 2


def test_what_cannot_be_advised_is_skipped_and_the_rest_still_read(cold_files, tmp_path, monkeypatch):
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    a, b, _ = cold_files
    _finish(prefetch([(tmp_path / "missing", 0, MIB), (a, 0, MIB), (tmp_path, 0, MIB), (b, 0, MIB)], 100 * MIB))
    assert errors == []
    assert _resident(a, MIB) == MIB and _resident(b, MIB) == MIB


def test_nothing_to_do_starts_no_thread(cold_files):
    a, _, _ = cold_files
    assert prefetch([], 100 * MIB) is None
    assert prefetch([(a, 0, MIB)], 0) is None


def test_the_default_limit_is_a_quarter_of_the_memory_available():
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        assert default_limit() == 0
        return
    kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))
    assert default_limit() == pytest.approx(kib * 1024 / 4, rel=0.05)  # memory moves a little between the reads
