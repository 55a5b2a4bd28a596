"""Output piped to a file or another program is never wrapped: ids, paths and hashes stay whole.

Nothing knows the width of a pipe's reader (a CI log, `tee`, `grep`), so a command whose stdout or
stderr is not a terminal prints every line whole, whatever ``COLUMNS`` says; a word cut across two
lines (``versio n``, ``checkp oint``) could be neither read nor grepped. The real `mergepipe` console
entry runs here in a subprocess with both streams pipes, with ``COLUMNS=40`` and without it, on
commands whose output holds words longer than 40 characters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.fixtures.cli import invoke
from tests.planner.support import clone_catalog, subprocess_env

BASE = "a-base-model-whose-id-is-longer-than-forty-characters"
EXPERT = "an-expert-fine-tuned-on-mathematics-with-a-long-model-id"
MERGED = "the-merged-model-whose-id-is-longer-than-forty-characters"
#: The output folder's name: a path component longer than 40 characters.
FOLDER = "an-output-folder-whose-name-is-longer-than-forty-characters"
#: Words that must never be cut are checked from this many first characters: a line holding those holds the word.
PREFIX_CHARS = 16


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("piped") / "cat.db"
    runner = CliRunner()
    invoke(runner, ["register", "--db", db, "--model-id", BASE, "--uri", tiny_family["base"]])
    invoke(runner, ["register", "--db", db, "--model-id", EXPERT, "--uri", tiny_family["e1"]])
    return db


def mergepipe(args, columns: str | None) -> list[str]:
    """The lines the installed `mergepipe` command prints to its stdout and stderr, both pipes."""
    entry = Path(sys.executable).with_name("mergepipe")
    assert entry.is_file(), f"{entry}: the console entry is installed with the package (pip install -e .)"
    env = subprocess_env()  # COLUMNS removed
    if columns is not None:
        env["COLUMNS"] = columns
    done = subprocess.run([str(entry), *map(str, args)], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    return (done.stdout + done.stderr).splitlines()


def assert_whole(lines: list[str], unbroken: list[str], shown: list[str]) -> None:
    """Every word of ``unbroken`` appears, and wherever its beginning appears the whole word does (a word cut
    at the line's end would leave its beginning alone); every word of ``shown`` appears whole on a line."""
    for word in unbroken:
        assert len(word) > 40
        starts = [line for line in lines if word[:PREFIX_CHARS] in line]
        assert starts and all(word in line for line in starts), (word, starts)
    for word in shown:
        assert any(word in line for line in lines), (word, lines)


@pytest.mark.parametrize("columns", ["40", None], ids=["COLUMNS=40", "no COLUMNS"])
def test_piped_output_is_never_wrapped(template, tmp_path, columns):
    db, out = clone_catalog(template, tmp_path / "cat.db"), tmp_path / FOLDER
    merged = mergepipe(["merge", "--db", db, "--base", BASE, "--experts", EXPERT, "--operator", "task_arithmetic",
                        "--out", out, "--model-id", MERGED, "--no-progress"], columns)
    manifest = json.loads((out / "manifest.json").read_text())
    assert_whole(merged, [MERGED, FOLDER], [str(out), manifest["manifest_hash"], manifest["snapshot_id"]])

    snapshots = mergepipe(["snapshots", "--db", db], columns)
    assert_whole(snapshots, [MERGED, FOLDER], [str(out), manifest["snapshot_id"]])

    show = mergepipe(["show", "--db", db, MERGED], columns)
    assert_whole(show, [MERGED, BASE, EXPERT, FOLDER], [str(out)])
    assert max(map(len, merged + snapshots + show)) > 80  # the lines are as long as what they hold
