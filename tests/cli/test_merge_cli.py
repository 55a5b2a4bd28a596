"""The merge commands (plan, merge, execute, the short form) through the CLI.

Happy paths run through click's CliRunner; expected failures through
``mergepipe.cli.main``, which must turn them into one ``error: ...`` line on
stderr and a non-zero exit, with nothing published. One failure also runs
the real entry point (``python -m mergepipe``) to see that no traceback
reaches the user.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import click
import pytest
import yaml

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.cli import cli, main
from mergepipe.spec.plan import Plan
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import (
    build_catalog,
    clone_catalog,
    load_tensors,
    subprocess_env,
)

BLOCK_BYTES = 2048


@pytest.fixture(scope="module")
def cli_template(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("clicat") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2", "e3"])


@pytest.fixture
def db(cli_template, tmp_path):
    return clone_catalog(cli_template, tmp_path / "catalog.db")


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _snapshot_of(db, model_id):
    with Catalog.open(db) as catalog:
        return next(s for s in catalog.snapshots.list() if s.model_id == model_id)


# ----------------------------------------------------------------------------- happy paths


def test_every_command_has_help_text(runner):
    assert cli.help
    for name, command in cli.commands.items():
        assert (command.help or "").strip(), f"`{name}` has no help text"
        output = invoke(runner, [name, "--help"])
        assert "Usage:" in output and "--help" in output
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                assert (param.help or "").strip(), f"option {param.name} of `{name}` has no help"
    expected = {"init-db", "register", "analyze", "plan", "merge", "execute", "verify", "explain", "lineage",
                "models", "snapshots", "gc", "recover"}
    assert expected <= set(cli.commands)


def test_the_seed_short_form_merges_with_defaults(db, runner, tmp_path):
    out = tmp_path / "merged"
    output = invoke(runner, ["--db", db, "--base", "base", "--experts", "e1", "e2", "--out", out, "--model-id", "m"])
    record = _snapshot_of(db, "m")
    assert record.status == "committed"
    assert record.id in output and record.manifest_hash in output
    assert verify_snapshot(out).ok
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["operator"]["name"] == "ties"  # the default operator
    assert manifest["cost"]["realized"]["expert_bytes"] == manifest["cost"]["estimated"]["expert_bytes"]
    with Catalog.open(db) as catalog:
        plan = Plan.from_json(catalog.plans.get(record.plan_id))
    assert plan.cost.expert_bytes == plan.cost.full_expert_bytes  # default budget 100%


def test_paths_instead_of_ids_on_a_fresh_catalog(tiny_family, runner, tmp_path):
    db = tmp_path / "new" / "catalog.db"
    db.parent.mkdir()
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", db, "--base", tiny_family["base"], "--experts", tiny_family["e1"],
                    tiny_family["e3"], "--out", out, "--model-id", "m", "--operator", "task_arithmetic",
                    "--weights", "0.5", "-0.25", "--lambda", "0.8", "--budget", "30%", "--no-progress"])
    with Catalog.open(db) as catalog:
        assert {m.id for m in catalog.models.list()} == {"base", "e1", "e3", "m"}
        assert catalog.models.parents("m") == [("base", "base"), ("e1", "expert"), ("e3", "expert")]
        plan = Plan.from_json(catalog.plans.get(_snapshot_of(db, "m").plan_id))
    assert plan.operator == "task_arithmetic"
    assert [e.params["weight"] for e in plan.merge.experts] == [0.5, -0.25]
    assert plan.merge.params["lambda"] == 0.8
    assert plan.cost.expert_bytes <= plan.budget_bytes < plan.cost.full_expert_bytes
    assert verify_snapshot(out).ok


def test_plan_save_then_execute(db, runner, tmp_path):
    output = invoke(runner, ["plan", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties",
                             "--density", "0.5", "--budget", "40%", "--save", "--no-progress"])
    plan_id = re.search(r"plan id: ([0-9a-f]{64})", output).group(1)
    for word in ("expert bytes planned", "reduction", "error bound", "e1", "e2"):
        assert word in output
    with Catalog.open(db) as catalog:
        plan = Plan.from_json(catalog.plans.get(plan_id))
    # --json prints the whole plan, the same one
    as_json = json.loads(invoke(runner, ["plan", "--db", db, "--base", "base", "--experts", "e1", "e2",
                                         "--density", "0.5", "--budget", "40%", "--json", "--no-progress"]))
    assert as_json["digest"] == plan_id
    assert Plan.from_json(as_json) == plan
    # nothing was read or published by planning
    with Catalog.open(db) as catalog:
        assert catalog.snapshots.list() == []
    out = tmp_path / "executed"
    output = invoke(runner, ["execute", "--db", db, "--plan", plan_id[:10], "--out", out, "--model-id", "x",
                             "--no-progress"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan_digest"] == plan_id
    assert manifest["manifest_hash"] in output
    assert manifest["cost"]["realized"]["expert_bytes"] <= plan.cost.expert_bytes


def test_config_yaml_sets_global_and_per_expert_parameters(db, runner, tmp_path):
    config = tmp_path / "merge.yaml"
    config.write_text(yaml.safe_dump({"params": {"density": 0.5, "lambda": 0.9},
                                      "expert_params": {"e2": {"density": 0.3, "weight": 0.5}}}))
    summary = tmp_path / "summary.json"
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--config", config,
                    "--out", tmp_path / "out", "--model-id", "cfg", "--no-progress", "--json-summary", summary])
    with Catalog.open(db) as catalog:
        plan = Plan.from_json(catalog.plans.get(_snapshot_of(db, "cfg").plan_id))
    assert dict(plan.merge.params) == {"density": 0.5, "lambda": 0.9}
    assert plan.merge.expert_ids == ("e1", "e2")
    assert dict(plan.merge.experts[1].params) == {"density": 0.3, "weight": 0.5}
    data = json.loads(summary.read_text())
    assert data["realized"]["expert_bytes"] == data["planned"]["expert_bytes"]


def test_merge_out_dtype_and_policy_flags(db, runner, tmp_path):
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "linear",
                    "--policy", "uniform", "--budget", "50%", "--out-dtype", "f32", "--out", out, "--model-id", "f",
                    "--no-progress"])
    tensors = load_tensors(out)
    assert {str(t.dtype) for t in tensors.values()} == {"torch.float32"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["extra"]["policy"] == "uniform"


# ----------------------------------------------------------------------------- errors


def _assert_one_line_error(code, err, *needles):
    assert code not in (0, None), err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _assert_nothing_published(db, parent, out):
    assert not out.exists()
    assert [p for p in parent.iterdir() if "staging" in p.name] == []
    if db.exists():
        with Catalog.open(db) as catalog:
            assert catalog.snapshots.list() == []


def _merge_argv(db, base, experts, out, *extra):
    return ["merge", "--db", db, "--base", base, "--experts", *experts, "--out", out, "--model-id", "m",
            "--quiet", *extra]


@pytest.fixture
def mismatched(tiny_family, tmp_path):
    """An expert whose up_proj of layer 1 has one row less."""
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_tensors(tiny_family["e1"])
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tiny_family["e1"] / "config.json", bad / "config.json")
    return bad


@pytest.fixture
def truncated(tiny_family, tmp_path):
    """A copy of e2 whose weight file lost its last kilobyte."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_family["e2"], broken)
    path = broken / "model.safetensors"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1024)
    return broken


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("unknown-model", ["nope", "register"]),
        ("output-exists", ["already exists"]),
        ("layout-mismatch", ["up_proj"]),
        ("unparsable-budget", ["12 parsecs"]),
        ("negative-budget", ["negative"]),
        ("negative-budget-bytes", ["negative"]),
        ("corrupt-expert-path", ["model.safetensors"]),
        ("corrupt-registered-expert", ["broken"]),
        ("base-as-expert", ["base"]),
        ("slerp-two-experts", ["slerp"]),
        ("unknown-operator", ["frankenmerge"]),
        ("full-policy-small-budget", ["full"]),
    ],
)
def test_errors_are_one_line_and_publish_nothing(case, needles, db, tmp_path, capsys, mismatched, truncated,
                                                 tiny_family):
    parent = tmp_path / "outputs"
    parent.mkdir()
    out = parent / "out"
    base, experts, extra = "base", ["e1", "e2"], []
    if case == "unknown-model":
        experts = ["e1", "nope"]
    elif case == "output-exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "layout-mismatch":
        experts = ["e1", str(mismatched)]
    elif case == "unparsable-budget":
        extra = ["--budget", "12 parsecs"]
    elif case == "negative-budget":
        extra = ["--budget", "-5%"]
    elif case == "negative-budget-bytes":
        extra = ["--budget", "-100"]
    elif case == "corrupt-expert-path":
        experts = ["e1", str(truncated)]
    elif case == "corrupt-registered-expert":
        # registered (and analysed) while intact, truncated afterwards
        broken = tmp_path / "registered"
        shutil.copytree(tiny_family["e2"], broken)
        with Catalog.open(db) as catalog:
            register_model(catalog, "broken", broken)
            analyze(catalog, ["broken"], base_id="base", progress=False)
        path = broken / "model.safetensors"
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size - 1024)
        experts = ["e1", "broken"]
    elif case == "base-as-expert":
        experts = ["base", "e1"]
    elif case == "slerp-two-experts":
        extra = ["--operator", "slerp"]
    elif case == "unknown-operator":
        extra = ["--operator", "frankenmerge"]
    elif case == "full-policy-small-budget":
        extra = ["--policy", "full", "--budget", "10%"]
    code, _, err = run_main(_merge_argv(db, base, experts, out, *extra), capsys)
    _assert_one_line_error(code, err, *needles)
    if case == "output-exists":
        assert (out / "keep.txt").read_text() == "mine"
        assert [p.name for p in parent.iterdir()] == ["out"]
    else:
        _assert_nothing_published(db, parent, out)


@pytest.mark.parametrize("fresh_catalog", [True, False])
def test_a_failed_short_form_merge_takes_back_what_it_registered(db, tiny_family, mismatched, tmp_path, capsys,
                                                                fresh_catalog):
    """Directories registered on the fly for a merge that then fails (a layout
    mismatch found by analysis) are not left behind in the catalog."""
    target = tmp_path / "fresh.db" if fresh_catalog else db
    with Catalog.create(target) as catalog:
        before = [m.id for m in catalog.models.list()]
    argv = ["--db", target, "--base", tiny_family["base"] if fresh_catalog else "base", "--experts",
            tiny_family["e1"], mismatched, "--out", tmp_path / "out", "--model-id", "m", "--no-progress"]
    code, _, err = run_main(argv, capsys)
    _assert_one_line_error(code, err, "does not match the layout")
    with Catalog.open(target) as catalog:
        assert [m.id for m in catalog.models.list()] == before
        assert catalog.stats.analyses() == [] if fresh_catalog else True


def test_damage_found_mid_merge_aborts_and_publishes_nothing(db, tiny_family, tmp_path, capsys):
    """NaNs written into an analysed expert, size and mtime kept: only the
    engine's reads can notice (the block no longer hashes to its record).
    The publish must abort, not finalise."""
    import os

    from tests.planner.support import raw_layout

    sneaky = tmp_path / "sneaky"
    shutil.copytree(tiny_family["e1"], sneaky)
    with Catalog.open(db) as catalog:
        register_model(catalog, "sneaky", sneaky)
    main(["analyze", "--db", str(db), "--base", "base", "sneaky", "--no-progress"])
    capsys.readouterr()
    tensor = raw_layout(sneaky)["model.layers.1.mlp.down_proj.weight"]
    path = tensor.file
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[tensor.begin:tensor.begin + 64] = b"\xc0\x7f" * 32  # bf16 NaN
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    parent = tmp_path / "outputs"
    parent.mkdir()
    code, _, err = run_main(_merge_argv(db, "base", ["sneaky", "e2"], parent / "out", "--operator",
                                        "task_arithmetic"), capsys)
    _assert_one_line_error(code, err, "model 'sneaky' changed on disk", "model.layers.1.mlp.down_proj.weight",
                           str(path))
    assert list(parent.iterdir()) == []
    with Catalog.open(db) as catalog:
        assert [s.status for s in catalog.snapshots.list()] == ["aborted"]
        assert not catalog.models.exists("m")


def test_execute_errors(db, tmp_path, capsys):
    code, _, err = run_main(["execute", "--db", db, "--plan", "feedbeef", "--out", tmp_path / "o", "--model-id", "x"],
                            capsys)
    _assert_one_line_error(code, err, "feedbeef")
    code, _, err = run_main(["plan", "--db", tmp_path / "missing-dir" / "c.db", "--base", "base", "--experts", "e1"],
                            capsys)
    _assert_one_line_error(code, err)


def test_the_real_entry_point_prints_no_traceback(db, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mergepipe", *map(str, _merge_argv(db, "base", ["e1", "nope"], out))],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: unknown model 'nope'")
    assert not out.exists()


@pytest.mark.parametrize("model_id", ["", "bad id"])
def test_invalid_model_ids_are_refused_up_front(db, tmp_path, capsys, model_id):
    parent = tmp_path / "outputs"
    parent.mkdir()
    out = parent / "out"
    argv = ["merge", "--db", db, "--base", "base", "--experts", "e1", "--out", out, "--model-id", model_id,
            "--no-progress"]
    code, _, err = run_main(argv, capsys)
    _assert_one_line_error(code, err, "model id")
    _assert_nothing_published(db, parent, out)
