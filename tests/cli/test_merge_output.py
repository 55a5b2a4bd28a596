"""What `plan`, `merge` and `mergepipe-yaml` print, as a user runs them.

Their summary tables fit 100 columns (on a terminal of 80 or 120 columns, or piped), with the plan's
notes under the table, not in a row of it; ``--no-progress`` hides progress bars and nothing else
(the plan table, its error bound, deviation estimate and policy note stay); ``--quiet`` hides the
tables and notes too, leaving the one-line result.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from click.testing import CliRunner

from mergepipe.cli import cli, main
from mergepipe.cli.mergekit_yaml import main as yaml_main
from tests.fixtures.cli import run_main
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 2048
MERGE = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5", "--budget", "40%"]
#: The note a budgeted plan without delta stores carries (``planner.py``), as the user reads it.
POLICY_NOTE = ("policy energy (the default without delta stores); delta stores would keep more quality at this "
               "budget: `mergepipe analyze --base base --store-deltas DIR e1 e2`")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
BOX = set("┌│├└")


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("output") / "c.db", BLOCK_BYTES,
                         {m: tiny_family[m] for m in ("base", "e1", "e2")}, base="base", experts=["e1", "e2"])


@pytest.fixture
def db(template, tmp_path):
    return clone_catalog(template, tmp_path / "c.db")


def drawn(text: str) -> list[str]:
    """The lines a table draws (borders and rows)."""
    return [line for line in text.splitlines() if BOX & set(line)]


@pytest.mark.parametrize("columns", [None, 80, 120], ids=["piped", "terminal-80", "terminal-120"])
def test_plan_and_merge_tables_fit_100_columns_with_notes_under_them(db, tmp_path, columns):
    env = {} if columns is None else {"TTY_COMPATIBLE": "1", "COLUMNS": str(columns)}  # rich: a terminal this wide
    limit = min(columns or 100, 100)
    runner = CliRunner()
    planned = runner.invoke(cli, [str(a) for a in ["plan", "--db", db, *MERGE]], env=env, catch_exceptions=False)
    merged = runner.invoke(cli, [str(a) for a in ["merge", "--db", db, *MERGE, "--out", tmp_path / "out",
                                                  "--model-id", "m", "--no-progress"]],
                           env=env, catch_exceptions=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    for result in (planned, merged):
        assert result.exit_code == 0, result.output
        text = ANSI.sub("", result.output)
        lines = drawn(text)
        assert lines and max(len(line) for line in lines) <= limit, "\n".join(lines)
        assert not [line for line in lines if "note" in line]  # no note row: the notes are under the table
        assert POLICY_NOTE in " ".join(text.split())  # whole, wrapped at spaces at most
        if columns is None:  # piped: the note on one line, as every line is there
            assert any(line.startswith(f"note: {POLICY_NOTE}") for line in text.splitlines())
    if limit == 100:  # a hash beside the widest label fits whole
        assert any(manifest["manifest_hash"] in line for line in drawn(ANSI.sub("", merged.output)))


def _yaml_config(path, family) -> str:
    config = {"merge_method": "ties", "base_model": str(family["base"]), "dtype": "float32",
              "parameters": {"density": 0.5},
              "models": [{"model": str(family[e]), "parameters": {"weight": 1.0}} for e in ("e1", "e2")],
              "mergepipe": {"budget": "40%"}}
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _run(command: str, flag: str, template, tmp_path, tiny_family, capsys) -> tuple[str, str, dict]:
    """(stdout, stderr, manifest) of one merge through ``command``, as a user types it, with ``flag`` (in a
    catalog of its own: a merge run before would be re-materialised)."""
    out, db = tmp_path / f"out-{flag.strip('-')}", clone_catalog(template, tmp_path / f"{flag.strip('-')}.db")
    if command == "merge":
        argv, entry = ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m", flag], main
    else:
        argv, entry = [_yaml_config(tmp_path / "m.yml", tiny_family), out, "--db", db, "--model-id", "m", flag], \
            yaml_main
    code, stdout, stderr = run_main(argv, capsys, entry)
    assert code == 0, stderr
    return stdout, stderr, json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("command", ["merge", "mergepipe-yaml"])
def test_no_progress_keeps_the_plan_and_quiet_leaves_the_one_line_result(template, tmp_path, tiny_family, capsys,
                                                                         command):
    stdout, stderr, manifest = _run(command, "--no-progress", template, tmp_path, tiny_family, capsys)
    rows = " ".join(stderr.replace("│", " ").split())  # the plan table's rows, each wrapped cell read whole
    bound = manifest["error_bound"]["estimated"]
    assert f"plan {manifest['plan_digest'][:12]}" in stderr
    assert f"error bound {bound:.6g} (bound" in rows
    assert "deviation estimate " in rows
    assert "note: policy energy (the default without delta stores)" in stderr
    assert f"snapshot {manifest['snapshot_id']} published at " in stdout and manifest["manifest_hash"] in stdout

    stdout, stderr, manifest = _run(command, "--quiet", template, tmp_path, tiny_family, capsys)
    assert stderr == ""  # no table, no note, no progress bar
    assert stdout.splitlines() == [f"snapshot {manifest['snapshot_id']} published at {tmp_path / 'out-quiet'}"]
