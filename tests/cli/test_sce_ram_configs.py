"""mergekit configs of ``sce``, ``ram`` and ``ramplus_tl`` as a user runs them with `mergepipe merge --config`
and `mergepipe plan --config`: a wrong parameter is one `error:` line before anything is registered or
read, a ``weight`` (which mergekit ignores for these methods) is dropped with a note, and a partial
budget says in the plan what it means for the method. Agreement with mergekit itself is
tests/cli/test_mergepipe_yaml.py's."""

from __future__ import annotations

import json

import pytest
import yaml

from mergepipe.catalog import Catalog
from tests.fixtures.cli import run_main


def _config(family, method: str, parameters: dict | None = None, mergepipe: dict | None = None,
            **model_parameters) -> dict:
    models = [{"model": str(family["e1"]), **({"parameters": model_parameters} if model_parameters else {})},
              {"model": str(family["e2"])}]
    config = {"merge_method": method, "base_model": str(family["base"]), "dtype": "float32", "models": models}
    return {**config, **({"parameters": parameters} if parameters else {}),
            **({"mergepipe": mergepipe} if mergepipe else {})}


def _write(path, config: dict):
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.parametrize("method, parameters, per_model, needles", [
    ("sce", {"select_topk": 1.5}, {}, ("sce", "select_topk must be in [0, 1], got 1.5")),
    ("sce", {"select_topk": [0.5, -0.1]}, {}, ("select_topk must be in [0, 1], got -0.1",)),
    ("sce", {"density": 0.5}, {}, ("sce does not take parameter 'density'", "select_topk")),
    ("ram", {"epsilon": -1e-5}, {}, ("ram", "epsilon must be in [0, inf], got -1e-05")),
    ("ram", None, {"epsilon": 0.01}, ("'epsilon' is a global parameter of ram",)),
    ("ramplus_tl", {"r": -0.1}, {}, ("ramplus_tl", "r must be in [0, inf], got -0.1")),
    ("ramplus_tl", {"alpha": "high"}, {}, ("alpha must be a finite number, got 'high'",)),
    ("ramplus_tl", {"epsilon": 0.01, "lambda": 2.0}, {}, ("ramplus_tl does not take parameter 'lambda'",
                                                           "r, alpha, epsilon")),
])
def test_an_invalid_parameter_is_one_line_before_anything_is_registered(tiny_family, tmp_path, capsys, method,
                                                                         parameters, per_model, needles):
    config = _write(tmp_path / "merge.yml", _config(tiny_family, method, parameters, **per_model))
    db, out = tmp_path / "c.db", tmp_path / "out"
    code, _, err = run_main(["merge", "--db", db, "--config", config, "--out", out, "--model-id", "m",
                             "--no-progress"], capsys)
    lines = err.strip().splitlines()
    assert code not in (0, None) and lines[-1].startswith("error: "), err
    assert not any(line.startswith("error: ") for line in lines[:-1]) and "Traceback" not in err
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    assert not out.exists()
    if db.exists():
        with Catalog.open(db) as catalog:
            assert catalog.models.list() == []


@pytest.mark.parametrize("method", ["sce", "ram", "ramplus_tl"])
def test_a_weight_mergekit_ignores_is_dropped_with_a_note(tiny_family, tmp_path, capsys, method):
    config = _write(tmp_path / "merge.yml", _config(tiny_family, method, weight=0.3))
    code, _, err = run_main(["plan", "--db", tmp_path / "c.db", "--config", config, "--no-progress"], capsys)
    assert code == 0, err
    assert f"weight ignored: {method} takes no weight" in err


@pytest.mark.parametrize("method, note", [
    ("sce", "sce merges whole tensors, each from every expert or not at all"),
    ("ramplus_tl", "ramplus_tl merges whole tensors, each from every expert or not at all"),
])
def test_a_partial_budget_plans_whole_tensors_and_says_so(tiny_family, tmp_path, capsys, method, note):
    config = _write(tmp_path / "merge.yml", _config(tiny_family, method, mergepipe={"budget": "30%"}))
    db = tmp_path / "c.db"
    code, out, err = run_main(["plan", "--db", db, "--config", config, "--no-progress", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert note in " ".join(plan["notes"])
    assert len(plan["tensor_level"]) == 21  # every tensor of the tiny Llama: whole or not at all
    assert 0 < len(plan["reads"]) < 21
    for tensor, experts in plan["reads"].items():  # a tensor is read from both experts or from none
        assert sorted(experts) == ["e1", "e2"], tensor
    code, out, err = run_main(["plan", "--db", db, "--config", config, "--budget", "100%", "--no-progress",
                               "--json"], capsys)
    assert code == 0, err
    assert note not in " ".join(json.loads(out)["notes"])
