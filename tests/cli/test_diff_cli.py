"""`mergepipe diff`: inputs that changed, and tensors by relative change with the experts behind them."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog


def test_diff_names_the_changed_expert_and_measures_each_tensor(tiny_family, tmp_path, monkeypatch, capsys):
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    retrained = make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=5, touch=lambda n: ".layers.1." in n)
    runner = wide_runner(monkeypatch)
    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "task_arithmetic"]
    invoke(runner, ["merge", *args, "--out", tmp_path / "v1", "--model-id", "m", "--no-progress"])
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    invoke(runner, ["merge", *args, "--seed", "4", "--out", tmp_path / "v2", "--model-id", "m", "--no-progress"])

    result = json.loads(invoke(runner, ["diff", "--db", db, "m@1", "m@2", "--json"]))
    assert result["inputs"] == ["expert changed: e1 -> e1@2", "seed: 0 -> 4"]
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("v1", "v2"))
    for t in result["tensors"]:  # an independent measure of each tensor's change
        x, y = a[t["tensor"]].double(), b[t["tensor"]].double()
        assert abs(t["relative_change"] - float((y - x).norm() / x.norm())) < 1e-12
        assert t["experts"] == (["e1"] if ".layers.1." in t["tensor"] else [])
        assert (t["relative_change"] > 0) == (".layers.1." in t["tensor"])
    changes = [t["relative_change"] for t in result["tensors"]]
    assert changes == sorted(changes, reverse=True)
    text = invoke(runner, ["diff", "--db", db, "m@1", "m", "--top", "3"])
    assert "expert changed: e1 -> e1@2" in text and "layers.1" in text
    code, _, err = run_main(["diff", "--db", str(db), "m", "e2"], capsys)
    assert code != 0 and err.count("\n") == 1 and "not a merged model" in err
    assert torch.is_tensor(a[result["tensors"][0]["tensor"]])
