"""mergekit's ``slices:`` through `merge --config`: one slice whose sources all cover every layer is the
merge ``models:`` states (mergekit itself turns ``models:`` into exactly that slice), so it gives the same
plan; a slice's ``parameters`` win over the global ones, as in mergekit. Slices that stack or cut layers
(a frankenmerge) are refused in one line, a layer count other than the base's once the base is known,
and nothing is registered. ``test_mergekit_outputs.py`` runs mergekit itself on these configs."""

from __future__ import annotations

import json

import pytest
import yaml

from mergepipe.catalog import Catalog
from mergepipe.cli import cli
from tests.fixtures.cli import invoke, refused, wide_runner

#: mergekit's gradient-SLERP example, on the 2-layer test models.
GRADIENT_T = [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
              {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
              {"value": 0.5}]


def gradient_slerp(family, layers: int = 2) -> dict:
    """mergekit's examples/gradient-slerp.yml with the test models' paths and layer count."""
    return {
        "slices": [{"sources": [{"model": str(family["base"]), "layer_range": [0, layers]},
                                {"model": str(family["e1"]), "layer_range": [0, layers]}]}],
        "merge_method": "slerp",
        "base_model": str(family["base"]),
        "parameters": {"t": GRADIENT_T},
        "dtype": "bfloat16",
    }


def sliced_task_arithmetic(family) -> dict:
    """Task arithmetic with per-source parameters (a gradient among them) and a slice's parameters over
    the global ones."""
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(family["base"]),
        "slices": [{
            "sources": [{"model": str(family["base"]), "layer_range": [0, 2]},
                        {"model": str(family["e1"]), "layer_range": [0, 2], "parameters": {"weight": [0.2, 1.0]}},
                        {"model": str(family["e2"]), "layer_range": [0, 2], "parameters": {"weight": 0.5}}],
            "parameters": {"lambda": 0.8},
        }],
        "parameters": {"lambda": 0.5, "normalize": False},
        "dtype": "float32",
        "out_dtype": "bfloat16",
    }


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _write(path, config: dict):
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _plan(runner, db, config) -> dict:
    result = runner.invoke(cli, ["plan", "--db", str(db), "--config", str(config), "--analyze-missing", "--json",
                                 "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_gradient_slerp_over_slices_is_the_models_merge(tiny_family, tmp_path, runner):
    sliced = _write(tmp_path / "sliced.yml", gradient_slerp(tiny_family))
    models = {k: v for k, v in gradient_slerp(tiny_family).items() if k != "slices"}
    models["models"] = [{"model": str(tiny_family["base"])}, {"model": str(tiny_family["e1"])}]
    listed = _write(tmp_path / "models.yml", models)
    db = tmp_path / "c.db"
    plan = _plan(runner, db, sliced)
    assert plan["digest"] == _plan(runner, db, listed)["digest"]
    assert plan["merge"]["operator"] == "slerp" and plan["merge"]["params"] == {"t": GRADIENT_T}
    assert [e["expert_id"] for e in plan["merge"]["experts"]] == ["e1"]
    invoke(runner, ["merge", "--db", db, "--config", sliced, "--out", tmp_path / "out", "--model-id", "m",
                    "--no-progress"])


def test_a_slice_s_parameters_win_over_the_global_ones(tiny_family, tmp_path, runner):
    sliced = _write(tmp_path / "sliced.yml", sliced_task_arithmetic(tiny_family))
    listed = _write(tmp_path / "models.yml", {
        "merge_method": "task_arithmetic",
        "base_model": str(tiny_family["base"]),
        "models": [{"model": str(tiny_family["e1"]), "parameters": {"weight": [0.2, 1.0]}},
                   {"model": str(tiny_family["e2"]), "parameters": {"weight": 0.5}}],
        "parameters": {"lambda": 0.8, "normalize": False},
        "out_dtype": "bfloat16",
    })
    db = tmp_path / "c.db"
    plan = _plan(runner, db, sliced)
    assert plan["merge"]["params"] == {"lambda": 0.8, "normalize": False}
    assert plan["digest"] == _plan(runner, db, listed)["digest"]




FRANKENMERGE = "slices that stack or cut layers (a frankenmerge) are not supported yet"


def _sources(family, *ranges):
    return [{"model": str(family[name]), "layer_range": list(r)} for name, r in zip(("base", "e1"), ranges)]


@pytest.mark.parametrize("change, needles", [
    # mergekit's frankenmerge: two slices stacking layers of two models
    (lambda f: {"slices": [{"sources": _sources(f, (0, 2), (0, 2))}, {"sources": _sources(f, (0, 1), (0, 1))}]},
     ("2 slices", FRANKENMERGE)),
    (lambda f: {"slices": [{"sources": _sources(f, (1, 2), (1, 2))}]}, ("[1, 2]", FRANKENMERGE)),
    (lambda f: {"slices": [{"sources": _sources(f, (0, 2), (0, 1))}]}, ("[0, 2], [0, 1]", FRANKENMERGE)),
    (lambda f: {"slices": [{"sources": _sources(f, (0, 2), (0, 2)), "residual_weight": 0.5}]}, ("residual_weight",)),
    (lambda f: {"slices": [{"sources": [{"model": str(f["e1"]), "layer_range": [0, 2]}]}]},
     ("not among the slice's sources",)),
    (lambda f: {"slices": [{"sources": _sources(f, (0, 2), (0, 2)), "layers": 2}]}, ("unknown key(s) in a slice",)),
    (lambda f: {"models": [{"model": str(f["e1"])}]}, ("either `models:` or `slices:`",)),
])
def test_frankenmerges_are_refused_by_name_before_anything_is_registered(tiny_family, tmp_path, capsys, change,
                                                                           needles):
    config = gradient_slerp(tiny_family)
    config.update(change(tiny_family))
    db = tmp_path / "c.db"
    refused(["merge", "--db", db, "--config", _write(tmp_path / "m.yml", config), "--out", tmp_path / "out",
              "--model-id", "m", "--no-progress"], capsys, *needles)
    assert not (tmp_path / "out").exists()
    if db.exists():
        with Catalog.open(db) as catalog:
            assert catalog.models.list() == []


@pytest.mark.parametrize("layers", [1, 3])
def test_a_range_that_is_not_the_base_s_layers_is_refused_once_the_base_is_known(tiny_family, tmp_path, capsys,
                                                                                  layers):
    """[0, N] is the whole model only when the base has N layers (2 here, from its config.json): known once
    the base is resolved, before any expert is analysed; what was registered on the fly is taken back."""
    db = tmp_path / "c.db"
    config = _write(tmp_path / "m.yml", gradient_slerp(tiny_family, layers))
    line = refused(["plan", "--db", db, "--config", config, "--analyze-missing", "--no-progress"], capsys,
                    FRANKENMERGE)
    assert f"[0, {layers}] of the base 'base', which has 2" in line and "layer_range [0, 2]" in line
    with Catalog.open(db) as catalog:
        assert catalog.models.list() == []
