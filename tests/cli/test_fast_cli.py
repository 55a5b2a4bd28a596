"""A fast CLI: help, the views and `plan` never import torch; the help list is the commands' own help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mergepipe.catalog import Catalog
from mergepipe.cli import COMMANDS, cli
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from tests.planner.support import build_catalog, subprocess_env

PROBE = """
import json, sys
from mergepipe.cli import cli
cli.main(args=json.loads(sys.argv[1]), prog_name="mergepipe", standalone_mode=False)
print("TORCH-LOADED", "torch" in sys.modules)
"""


def test_the_help_list_is_each_commands_own_first_help_line():
    for name, (_, text) in COMMANDS.items():
        assert cli.commands[name].get_short_help_str(limit=1000) == text, name


@pytest.fixture(scope="module")
def merged(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    db = build_catalog(root / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")},
                       base="base", experts=["e1", "e2"])
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan("base", ["e1", "e2"], "task_arithmetic")
        Engine(catalog).execute(plan, out=root / "m", model_id="m")
    return db, root / "m"


@pytest.mark.parametrize("view", ["--help", "models", "show", "snapshots", "lineage", "explain", "verify", "plan"])
def test_help_and_the_views_do_not_import_torch(merged, view):
    db, out = merged
    args = {"--help": ["--help"], "models": ["models", "--db", db], "show": ["show", "--db", db, "m"],
            "snapshots": ["snapshots", "--db", db], "lineage": ["lineage", "--db", db, "m"],
            "explain": ["explain", "--db", db, "m"], "verify": ["verify", out],
            "plan": ["plan", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties",
                     "--density", "0.5", "--budget", "40%"]}[view]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps([str(a) for a in args])],
                          capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "TORCH-LOADED False" in proc.stdout, f"`mergepipe {view}` imported torch"


ANALYSED_PROBE = """
import sys
from mergepipe.catalog import Catalog
from mergepipe.cli.merge_cmds import _analyze_missing
with Catalog.open(sys.argv[1]) as catalog:
    _analyze_missing(catalog, "base", ["e1", "e2"], True)
print("TORCH-LOADED", "torch" in sys.modules)
"""


def test_a_merge_with_nothing_to_analyse_plans_before_it_loads_torch(merged):
    """So that a plan refused by its budget (or a --strict warning) never costs the torch import."""
    db, _ = merged
    proc = subprocess.run([sys.executable, "-c", ANALYSED_PROBE, str(db)], capture_output=True, text=True,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "TORCH-LOADED False" in proc.stdout
