"""LoRA adapters in a merge as a mergekit user writes them: ``model: BASE+ADAPTER`` in a config, an adapter
folder under ``models:`` or in ``--experts``. Each is registered on the fly as a LoRA expert of the
merge's base (``kind=lora``) and merges like peft's ``merge_and_unload``; an adapter over another model
than the base, or as the base, is refused in one line and nothing is registered. Adapters are made by peft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from mergepipe.catalog import Catalog
from tests.fixtures.checkpoints import load_tensors, make_base, make_expert
from tests.fixtures.cli import invoke, refused, wide_runner
from tests.fixtures.lora import assert_merged_like_peft, make_lora_adapter

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """An f32 base (so that task arithmetic compares with peft's fp32 merge), a full expert and an adapter."""
    root = tmp_path_factory.mktemp("mergekit-adapters")
    base = make_base(root / "base", dtype="f32", seed=5)
    return {
        "base": base,
        "e1": make_expert(base, root / "e1", seed=7),
        "adapter": make_lora_adapter(base, root / "math-lora",
                                     peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]), seed=3),
    }


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _config(path: Path, base: str, entries: list, **extra) -> Path:
    path.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": base, "models": entries,
                                    "parameters": {"lambda": 1.0}, "mergepipe": {"model_id": "m"}, **extra}))
    return path


def _catalog(db: Path) -> dict[str, tuple[str, str | None, str]]:
    with Catalog.open(db) as catalog:
        return {m.id: (m.kind, m.delta_base, m.uri) for m in catalog.models.list()}


@pytest.mark.parametrize("form", ["plus", "long form", "folder"])
def test_an_adapter_of_the_base_in_a_config_merges_like_peft(models, tmp_path, runner, form):
    base, adapter = str(models["base"]), str(models["adapter"])
    model = {"plus": f"{base}+{adapter}", "long form": {"model": base, "lora": adapter}, "folder": adapter}[form]
    config = _config(tmp_path / "merge.yml", base, [{"model": model, "parameters": {"weight": 1.0}}])
    db, out = tmp_path / "c.db", tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--config", config, "--out", out, "--no-progress"])

    assert _catalog(db) == {"base": ("checkpoint", None, str(models["base"].resolve())),
                            "math-lora": ("lora", "base", str(models["adapter"].resolve())), "m": _catalog(db)["m"]}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["extra"]["expert_kinds"] == {"math-lora": "lora"}
    assert_merged_like_peft(load_tensors(out), models["base"], models["adapter"])

    # the same config again: the same names, so the same plan (the snapshot again, not a new version)
    again = invoke(runner, ["merge", "--db", db, "--config", config, "--out", tmp_path / "again", "--no-progress"])
    assert "re-materialised" in again
    assert set(_catalog(db)) == {"base", "math-lora", "m"}


def test_an_adapter_folder_in_experts_registers_against_the_base(models, tmp_path, runner):
    db, out = tmp_path / "c.db", tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--base", models["base"], "--experts", models["e1"], models["adapter"],
                    "--operator", "task_arithmetic", "--out", out, "--model-id", "m", "--no-progress"])
    kinds = {k: v[:2] for k, v in _catalog(db).items()}
    assert kinds == {"base": ("checkpoint", None), "e1": ("checkpoint", None), "math-lora": ("lora", "base"),
                     "m": ("snapshot", None)}

    # the same merge with the adapter registered by hand under the same id: the same plan and bytes
    hand = tmp_path / "hand.db"
    invoke(runner, ["register", "--db", hand, "--model-id", "base", "--uri", models["base"]])
    invoke(runner, ["register", "--db", hand, "--model-id", "e1", "--uri", models["e1"]])
    invoke(runner, ["register", "--db", hand, "--model-id", "math-lora", "--uri", models["adapter"], "--kind",
                    "lora", "--base", "base"])
    invoke(runner, ["merge", "--db", hand, "--base", "base", "--experts", "e1", "math-lora", "--operator",
                    "task_arithmetic", "--out", tmp_path / "hand", "--model-id", "m", "--no-progress"])
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (out, tmp_path / "hand")]
    assert manifests[0]["plan_digest"] == manifests[1]["plan_digest"]
    assert manifests[0]["snapshot_id"] == manifests[1]["snapshot_id"]




def test_an_adapter_over_another_model_is_refused_and_nothing_registered(models, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(models["e1"], other)
    config = _config(tmp_path / "merge.yml", str(models["base"]),
                     [{"model": models["e1"].as_posix()}, {"model": f"{other}+{models['adapter']}"}])
    db = tmp_path / "c.db"
    refused(["merge", "--db", db, "--config", config, "--out", tmp_path / "out", "--no-progress"], capsys,
             "LoRA adapter over", "not the base", "merge it into")
    assert _catalog(db) == {} and not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["plus", "folder"])
def test_an_adapter_is_never_the_base(models, tmp_path, capsys, how):
    base = f"{models['base']}+{models['adapter']}" if how == "plus" else str(models["adapter"])
    config = _config(tmp_path / "merge.yml", base, [{"model": str(models["e1"])}])
    db = tmp_path / "c.db"
    refused(["plan", "--db", db, "--config", config], capsys, "cannot be the base")
    assert _catalog(db) == {}
