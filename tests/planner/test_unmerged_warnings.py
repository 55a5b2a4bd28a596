"""A tensor that is never merged (an integer dtype) but differs in an expert is
not dropped silently: the plan and the manifest warn, and the output keeps
the base's value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.golden.fixture import make_family

SHARD = "model-00002-of-00002.safetensors"


def with_other_positions(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose I64 ``model.position_ids`` differs."""
    shutil.copytree(src, dst)
    with safe_open(str(dst / SHARD), "pt") as handle:
        tensors = {n: handle.get_tensor(n) for n in handle.keys()}
        metadata = handle.metadata()
    tensors["model.position_ids"] = tensors["model.position_ids"] + 1
    (dst / SHARD).unlink()
    save_file(tensors, str(dst / SHARD), metadata=metadata)
    return dst


def test_an_integer_tensor_that_differs_is_reported_and_kept_from_the_base(tmp_path):
    family = make_family(tmp_path / "family")
    odd = with_other_positions(family["e1"], tmp_path / "odd")
    with Catalog.create(tmp_path / "c.db", 512) as catalog:
        for name, path in {"base": family["base"], "e2": family["e2"], "odd": odd}.items():
            register_model(catalog, name, path)
        analyze(catalog, ["e2", "odd"], base_id="base", progress=False)
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e2", "odd"], operator="task_arithmetic"))
        quiet = Planner(catalog).plan(MergeRequest(base="base", experts=["e2"], operator="task_arithmetic"))
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    warning = ("warning: I64 tensor 'model.position_ids' differs in odd; I64 tensors are not merged: "
               "the output keeps the base's value")
    assert warning in plan.notes
    assert not any(n.startswith("warning") for n in quiet.notes)
    assert manifest.extra["warnings"] == [warning]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["extra"]["warnings"] == [warning]
    with safe_open(str(tmp_path / "out" / SHARD), "pt") as out, safe_open(str(family["base"] / SHARD), "pt") as base:
        assert torch.equal(out.get_tensor("model.position_ids"), base.get_tensor("model.position_ids"))
