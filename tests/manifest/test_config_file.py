"""mergepipe_config.yml: every snapshot states its merge as a mergekit-style config that reruns to the same bytes."""

from __future__ import annotations

import pytest
import torch
import yaml

from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, wide_runner
from tests.planner.support import build_catalog, clone_catalog

BLOCK = 2048


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("cfg") / "t.db", BLOCK, dict(tiny_family), base="base",
                         experts=["e1", "e2", "e3"])


# (operator flags, what the config must say); density/gamma/t given as gradients or rules where they may vary
CASES = {
    "ties": (["--operator", "ties", "--experts", "e1", "e2", "--density", "0.5", "--budget", "70%"],
             {"parameters": {"density": 0.5}}),
    "dare_ties": (["--operator", "dare_ties", "--experts", "e1", "e2", "--density", "0.6", "--seed", "5"],
                  {"parameters": {"density": 0.6, "rescale": "inverse"}}),
    "della_linear": (["--operator", "della_linear", "--experts", "e1", "e2", "--density", "0.6", "--epsilon", "0.1",
                      "--rescale", "l1"], {"parameters": {"density": 0.6, "epsilon": 0.1, "rescale": True}}),
    "linear": (["--operator", "linear", "--experts", "e1", "e2", "e3", "--weights", "1", "2", "3"], {}),
    "avg": (["--operator", "avg", "--experts", "e1", "e2"], {"merge_method": "linear"}),
    "slerp": (["--operator", "slerp", "--experts", "e2", "--t", "0.3"], {"parameters": {"t": 0.3}}),
    "model_stock": (["--operator", "model_stock", "--experts", "e1", "e2", "e3", "--out-dtype", "f32"],
                    {"out_dtype": "float32"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_config_file_reruns_to_the_same_tensors(template, tmp_path, monkeypatch, name):
    flags, expected = CASES[name]
    runner = wide_runner(monkeypatch)
    first = tmp_path / "first"
    invoke(runner, ["merge", "--db", clone_catalog(template, tmp_path / "a.db"), "--base", "base", *flags,
                    "--out", first, "--model-id", "m", "--no-progress"])
    assert verify_snapshot(first).ok
    text = (first / "mergepipe_config.yml").read_text()
    config = yaml.safe_load(text)
    for key, value in expected.items():
        if isinstance(value, dict):
            assert {k: config[key][k] for k in value} == value
        else:
            assert config[key] == value
    if name == "slerp":  # mergekit lists both ends of the interpolation
        assert [m["model"] for m in config["models"]] == ["base@1", "e2@1"]
    if name == "linear":
        assert [m["parameters"]["weight"] for m in config["models"]] == [1.0, 2.0, 3.0]

    again = tmp_path / "again"
    invoke(runner, ["merge", "--db", clone_catalog(template, tmp_path / "b.db"), "--config",
                    first / "mergepipe_config.yml", "--out", again, "--no-progress"])
    mine, theirs = load_tensors(again), load_tensors(first)
    assert set(mine) == set(theirs) and all(torch.equal(mine[t], theirs[t]) for t in mine)


def test_an_edited_config_file_fails_verify(template, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", clone_catalog(template, tmp_path / "a.db"), "--base", "base", "--experts", "e1",
                    "--operator", "task_arithmetic", "--out", out, "--model-id", "m", "--no-progress"])
    target = out / "mergepipe_config.yml"
    target.chmod(0o644)
    target.write_text(target.read_text().replace("task_arithmetic", "ties"))
    report = verify_snapshot(out)
    assert not report.ok
    assert any(p.startswith("mergepipe_config.yml: differs") for p in report.problems)
