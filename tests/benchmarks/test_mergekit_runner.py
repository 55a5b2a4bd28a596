"""The mergekit YAML the every-method benchmark groups write (benchmarks/mergekit_runner.py): each one is a
config mergekit 0.1.5 itself accepts, with the method, models and parameters intended, and MergePipe reads the
same file as the same merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import mergekit_runner
from mergepipe.spec.mergekit import from_mergekit

mergekit_config = pytest.importorskip("mergekit.config")


def _models(tmp_path: Path) -> tuple[Path, list[Path]]:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    return base, [tmp_path / f"e{i}" for i in range(4)]


@pytest.mark.parametrize("name", list(mergekit_runner.METHODS))
def test_each_method_is_a_config_mergekit_and_mergepipe_read_alike(tmp_path, name):
    base, experts = _models(tmp_path)
    method = mergekit_runner.METHODS[name]
    cfg = mergekit_runner.config(base, experts[: method.experts], name)
    parsed = mergekit_config.MergeConfiguration.model_validate(cfg)  # mergekit's own validation
    assert parsed.merge_method == name and parsed.dtype == "float32" and parsed.out_dtype == "bfloat16"
    request = from_mergekit(cfg, "bench.yml")
    if name == "passthrough":  # layers [0, 3) of the base, then [3, 6) of the expert
        assert [(s.model, s.first, s.end) for s in request["slices"]] == [
            (str(base.resolve()), 0, 3), (str(experts[0].resolve()), 3, 6)]
        return
    assert request["operator"] == name and request["base"] == str(base.resolve())
    assert request["experts"] == tuple(str(e.resolve()) for e in experts[: method.experts])
    assert dict(parsed.parameters or {}) == dict(method.parameters)
    weights = [m.parameters.get("weight") if m.parameters else None for m in parsed.models]
    assert weights == (list(method.weights) or [None] * method.experts)


def test_a_method_refuses_another_number_of_experts(tmp_path):
    base, experts = _models(tmp_path)
    with pytest.raises(SystemExit, match="nuslerp merges 2 expert"):
        mergekit_runner.config(base, experts[:3], "nuslerp")
