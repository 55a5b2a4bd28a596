"""The CLI as a whole: its help, and a catalog locked by another process."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.cli import cli
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import subprocess_env

#: A busy timeout short enough for tests (the default waits 30 s).
SHORT_TIMEOUT = 0.2


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def test_top_level_help_lists_every_command_with_its_help(runner):
    output = invoke(runner, ["--help"])
    listing = output.split("Commands:", 1)[1]
    assert cli.commands
    for name, command in cli.commands.items():
        assert (command.help or "").strip(), f"`{name}` has no help text"
        match = re.search(rf"^\s+{re.escape(name)}\s+(\S.*)$", listing, re.MULTILINE)
        assert match, f"`{name}` is not listed in `mergepipe --help`:\n{output}"
        first_words = command.help.strip().split()[0]
        assert match.group(1).startswith(first_words), (name, match.group(1))


# ----------------------------------------------------------------------------- locked catalog


@contextmanager
def write_lock_held(db: Path) -> Iterator[None]:
    """Another connection holding the catalog's write lock (as a long merge would)."""
    conn = sqlite3.connect(str(db), isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path) -> Path:
    path = tmp_path / "catalog.db"
    Catalog.create(path, 2048).close()
    return path


def _register_argv(db: Path, tiny_family) -> list[str]:
    return ["register", "--db", str(db), "--model-id", "base", "--uri", str(tiny_family["base"])]


def _assert_locked_error(code, err, db):
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert "locked" in lines[0] and str(db) in lines[0]
    # translated at the catalog boundary: it says who holds the lock and what to do, not just sqlite's words
    assert "write lock" in lines[0] and "retry" in lines[0]


def _nothing_registered(db: Path) -> bool:
    with Catalog.open(db) as catalog:
        return catalog.models.list() == []


def test_a_locked_catalog_is_one_error_line(db, tiny_family, capsys, monkeypatch):
    from mergepipe.catalog import database as dialect

    monkeypatch.setattr(dialect, "BUSY_TIMEOUT_SECONDS", SHORT_TIMEOUT)  # read at connect time
    with write_lock_held(db):
        code, _, err = run_main(_register_argv(db, tiny_family), capsys)
    _assert_locked_error(code, err, db)
    assert _nothing_registered(db)
    # once the lock is released the same command works
    code, _, err = run_main(_register_argv(db, tiny_family), capsys)
    assert code == 0, err
    assert not _nothing_registered(db)


def test_a_locked_catalog_in_a_separate_process_prints_no_traceback(db, tiny_family):
    """The lock holder and the CLI are different processes; the child shortens
    the busy timeout before running the real entry point."""
    script = (
        "import sys\n"
        "import mergepipe.catalog.database as dialect\n"
        f"dialect.BUSY_TIMEOUT_SECONDS = {SHORT_TIMEOUT}\n"
        "from mergepipe.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    with write_lock_held(db):
        proc = subprocess.run([sys.executable, "-c", script, *_register_argv(db, tiny_family)],
                              capture_output=True, text=True, env=subprocess_env(), timeout=120)
    _assert_locked_error(proc.returncode, proc.stderr, db)
    assert proc.stdout == ""
    assert _nothing_registered(db)
