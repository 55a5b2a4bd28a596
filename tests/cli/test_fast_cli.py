"""A fast CLI: help, the views and `plan` never import torch, nor does `mergepipe-yaml` until a merge runs (its
--help, a refused option, a config it refuses); the help list is the commands' own help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mergepipe.catalog import Catalog
from mergepipe.cli import COMMANDS, cli
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
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
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic"))
        Engine(catalog).execute(plan, out=root / "m", model_id="m")
    return db, root / "m"


@pytest.mark.parametrize("view", ["--help", "merge --help", "execute --help", "models", "show", "snapshots", "lineage",
                                  "explain", "verify", "plan"])
def test_help_and_the_views_do_not_import_torch(merged, view):
    db, out = merged
    args = {"--help": ["--help"], "merge --help": ["merge", "--help"], "execute --help": ["execute", "--help"],
            "models": ["models", "--db", db], "show": ["show", "--db", db, "m"],
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
from mergepipe.app.planning import plan
from mergepipe.spec.request import MergeRequest
plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}), sys.argv[1],
     analyze_missing=True)
print("TORCH-LOADED", "torch" in sys.modules)
"""


def test_planning_with_nothing_to_analyse_does_not_load_torch(merged):
    """Analysing missing experts loads torch; finding that none is missing does not."""
    db, _ = merged
    proc = subprocess.run([sys.executable, "-c", ANALYSED_PROBE, str(db)], capture_output=True, text=True,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "TORCH-LOADED False" in proc.stdout


YAML_PROBE = """
import json, sys
from mergepipe.cli.mergekit_yaml import main
try:
    main(json.loads(sys.argv[1]))
except SystemExit as exc:
    print("EXIT", exc.code)
print("TORCH-LOADED", "torch" in sys.modules)
"""


@pytest.mark.parametrize("case", ["--help", "refused option", "refused device", "unknown method", "bad budget"])
def test_mergepipe_yaml_does_not_import_torch_before_a_merge_runs(tiny_family, tmp_path, case):
    """What a newcomer types first (--help, then options and configs it refuses) answers without torch, and
    leaves no catalog behind."""
    config = tmp_path / "merge.yml"
    method = "tis" if case == "unknown method" else "ties"
    config.write_text(f"merge_method: {method}\nbase_model: {tiny_family['base']}\nmodels:\n"
                      f"  - model: {tiny_family['e1']}\n    parameters: {{weight: 1.0, density: 0.5}}\n")
    merge = [str(config), str(tmp_path / "out"), "--db", str(tmp_path / "c.db")]
    args = {"--help": ["--help"], "refused option": [*merge, "--unsafe-truncate-embeddings"],
            "refused device": [*merge, "--device", "tpu"], "unknown method": merge,
            "bad budget": [*merge, "--budget", "12q"]}[case]
    proc = subprocess.run([sys.executable, "-c", YAML_PROBE, json.dumps(args)], capture_output=True, text=True,
                          env=subprocess_env())
    assert "TORCH-LOADED False" in proc.stdout, f"`mergepipe-yaml {' '.join(args)}` imported torch"
    if case == "--help":
        assert "Usage: mergepipe-yaml" in proc.stdout and "EXIT" not in proc.stdout
    else:
        assert "EXIT 0" not in proc.stdout and proc.stderr.startswith("error: "), proc.stderr
        assert not (tmp_path / "c.db").exists() and not (tmp_path / "out").exists()
