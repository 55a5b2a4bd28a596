"""A full disk is one line saying so, never a traceback, and nothing half-written.

Where the test may mount a small tmpfs (root on Linux), the disk is really
full; elsewhere the same code paths are driven by injected ``ENOSPC``
errors (the output) and by SQLite's own page limit (the catalog).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.catalog import database as dialect_module
from mergepipe.errors import CatalogError
from tests.fixtures.cli import run_main
from tests.planner.support import build_catalog

BLOCK_BYTES = 4096


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)``: a mounted tmpfs of ``size``, or a skip where mounting is not allowed."""
    mounts = []

    def mount(size: str) -> Path:
        if shutil.which("mount") is None or os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture
def db(tiny_family, tmp_path) -> Path:
    return build_catalog(tmp_path / "c.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])


def merge(db: Path, out: Path, capsys) -> tuple[int | None, str]:
    code, _, err = run_main(["merge", "--db", db, "--base", "base", "--experts", "e1", "e2",
                             "--operator", "ties", "--density", "0.5", "--out", out, "--model-id", "m",
                             "--quiet"], capsys)
    return code, err


def assert_one_line_and_nothing_published(code, err, db: Path, parent: Path) -> None:
    assert code not in (0, None)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert "No space left on device" in err and "nothing was published" in err
    assert [p.name for p in parent.iterdir() if p.name.startswith((".out", "out"))] == []
    with Catalog.open(db) as catalog:
        assert [s.status for s in catalog.snapshots.list()] == ["aborted"]
        assert not catalog.models.exists("m")


def test_output_disk_really_full(db, small_disk, capsys):
    disk = small_disk("128k")  # the merged tiny model needs about twice that
    code, err = merge(db, disk / "out", capsys)
    assert_one_line_and_nothing_published(code, err, db, disk)


@pytest.mark.parametrize("where", ["preallocate", "write"])
def test_output_disk_full_injected(db, tmp_path, capsys, monkeypatch, where):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "preallocate":
        monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(full))
    else:  # a filesystem without fallocate: the space runs out at a write
        monkeypatch.setattr(os, "posix_fallocate",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "not supported")))
        real_pwrite = os.pwrite
        calls = []

        def pwrite(fd, data, offset):
            calls.append(1)
            if len(calls) > 3:
                raise full
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite)
    code, err = merge(db, tmp_path / "out", capsys)
    assert_one_line_and_nothing_published(code, err, db, tmp_path)


def test_catalog_disk_full_is_a_catalog_error_that_says_so(db, monkeypatch):
    """SQLite's page limit gives the same SQLITE_FULL a full disk gives."""
    real_connect = dialect_module.SQLiteDialect.connect

    def connect(self, path):
        conn = real_connect(self, path)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    monkeypatch.setattr(dialect_module.SQLiteDialect, "connect", connect)
    with Catalog.open(db) as catalog:
        with pytest.raises(CatalogError) as info:
            with catalog.transaction():
                catalog.plans.save("p" * 64, "x" * 200_000)
    message = str(info.value)
    assert "\n" not in message and "the disk is full" in message and "not a MergePipe catalog" not in message


def test_a_catalog_on_a_full_disk_is_not_called_a_non_catalog(tiny_family, small_disk, capsys):
    """A healthy catalog on a filesystem that then fills up: the error names
    the problem and never invites the user to throw the catalog away."""
    disk = small_disk("512k")
    db = disk / "cat.db"
    Catalog.create(db).close()
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    code, _, err = run_main(["register", "--db", db, "--model-id", "x", "--uri", tiny_family["base"]], capsys)
    assert code not in (0, None) and err.count("\n") == 1 and "Traceback" not in err, err
    assert ("disk is full" in err or "free space" in err) and "not a MergePipe catalog" not in err, err
    code, _, err = run_main(["models", "--db", db], capsys)  # a read may still succeed, or fail saying why
    assert code in (0, None) or ("not a MergePipe catalog" not in err and err.count("\n") == 1), err
    filler.unlink()
    with Catalog.open(db) as catalog:  # intact once there is room again
        assert catalog.schema_version >= 1


def test_creating_a_catalog_on_a_full_disk_fails_cleanly(small_disk):
    disk = small_disk("64k")
    with pytest.raises(CatalogError, match="the disk is full"):
        Catalog.create(disk / "cat.db")
    assert list(disk.iterdir()) == []  # no half-created catalog, no leftovers


def test_an_io_error_reading_meta_is_not_called_a_non_catalog(db, monkeypatch):
    import sqlite3

    from mergepipe.catalog.database import Database

    def broken(self, sql, params=()):
        raise self.dialect.translate(sqlite3.OperationalError("disk I/O error"), self.path)

    monkeypatch.setattr(Database, "query", broken)
    with pytest.raises(CatalogError) as info:
        Catalog.open(db)
    assert "disk I/O error" in str(info.value) and "not a MergePipe catalog" not in str(info.value)
