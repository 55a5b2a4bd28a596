"""`merge --config` with a mergekit YAML as it is: the same tensors as the equivalent flags,
paths registered on the fly without collisions, refusals before any I/O."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
import yaml

from mergepipe.catalog import Catalog
from mergepipe.cli import cli
from mergepipe.spec.mergekit import CHATML
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, refused, run_main, wide_runner


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _json(runner, args) -> dict:
    """stdout of a command that must succeed, as JSON (notes go to stderr)."""
    result = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _write(path, config: dict):
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _ties_config(family, **extra) -> dict:
    return {
        "merge_method": "ties",
        "base_model": str(family["base"]),
        "models": [
            {"model": str(family["e1"]), "parameters": {"weight": 1.0, "density": [0.3, 0.7]}},
            {"model": str(family["e2"]), "parameters": {"weight": 0.5, "density": 0.5}},
        ],
        "parameters": {"normalize": True, "lambda": 0.9, "int8_mask": True},
        "dtype": "bfloat16",
        **extra,
    }


def test_a_mergekit_yaml_gives_the_tensors_of_the_equivalent_flags(tiny_family, tmp_path, runner):
    config = _write(tmp_path / "merge.yml", _ties_config(tiny_family, mergepipe={"model_id": "m", "seed": 3}))
    yaml_out = tmp_path / "yaml-out"
    invoke(runner, ["merge", "--db", tmp_path / "a.db", "--config", config, "--out", yaml_out, "--no-progress"])

    params = _write(tmp_path / "params.yml", {"params": {"normalize": True, "lambda": 0.9},
                                              "expert_params": {"e1": {"density": [0.3, 0.7]},
                                                                "e2": {"density": 0.5}}})
    flags_out = tmp_path / "flags-out"
    invoke(runner, ["merge", "--db", tmp_path / "b.db", "--base", tiny_family["base"], "--experts",
                    tiny_family["e1"], tiny_family["e2"], "--operator", "ties", "--weights", "1.0", "--weights",
                    "0.5", "--config", params, "--seed", "3", "--out-dtype", "bf16", "--out", flags_out,
                    "--model-id", "m", "--no-progress"])

    mine, theirs = load_tensors(yaml_out), load_tensors(flags_out)
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[t], theirs[t]) for t in mine)
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (yaml_out, flags_out)]
    assert manifests[0]["plan_digest"] == manifests[1]["plan_digest"]  # the same plan, so the same identity


def test_the_mergepipe_section_sets_budget_policy_and_id_and_flags_win(tiny_family, tmp_path, runner):
    config = _write(tmp_path / "merge.yml", _ties_config(
        tiny_family, mergepipe={"budget": "30%", "policy": "uniform", "model_id": "from-config",
                                "block_bytes": 4096}))
    db = tmp_path / "c.db"
    plan = _json(runner, ["plan", "--db", db, "--config", config, "--analyze-missing", "--json", "--no-progress"])
    assert plan["policy"] == "uniform" and plan["block_bytes"] == 4096
    assert plan["budget"]["text"] == "30%"
    overridden = _json(runner, ["plan", "--db", db, "--config", config, "--budget", "100%", "--policy", "energy",
                                "--json"])
    assert overridden["policy"] == "energy" and overridden["budget"]["text"] == "100%"
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--config", config, "--out", out, "--no-progress"])
    assert json.loads((out / "manifest.json").read_text())["model_id"] == "from-config"


def test_notes_about_the_translation_go_to_stderr_once(tiny_family, tmp_path, capsys):
    config = _write(tmp_path / "merge.yml", _ties_config(tiny_family))
    code, _, err = run_main(["plan", "--db", tmp_path / "d.db", "--config", config, "--analyze-missing",
                             "--no-progress"], capsys)
    assert code == 0, err
    assert err.count("computes in float32") == 1
    assert err.count("int8_mask ignored") == 1


def test_two_model_folders_never_collide_and_keep_their_names(tiny_family, tmp_path, runner):
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    shutil.copytree(tiny_family["e1"], a)
    shutil.copytree(tiny_family["e2"], b)
    config = _write(tmp_path / "merge.yml", {
        "merge_method": "task_arithmetic", "base_model": str(tiny_family["base"]),
        "models": [{"model": str(a)}, {"model": str(b)}], "mergepipe": {"model_id": "ta"}})
    db = tmp_path / "e.db"
    invoke(runner, ["plan", "--db", db, "--config", config, "--analyze-missing", "--no-progress"])
    second = "model-" + hashlib.sha256(str(b.resolve()).encode()).hexdigest()[:8]
    with Catalog.open(db) as catalog:
        ids = {m.id: m.uri for m in catalog.models.list()}
    assert ids == {"base": str(tiny_family["base"].resolve()), "model": str(a.resolve()), second: str(b.resolve())}
    invoke(runner, ["plan", "--db", db, "--config", config, "--no-progress"])  # the same names again
    with Catalog.open(db) as catalog:
        assert {m.id for m in catalog.models.list()} == set(ids)




@pytest.mark.parametrize("change, needles", [
    ({"merge_method": "passthrough"}, ("passthrough with `models:` copies one model", "without parameters")),
    ({"slices": [{"sources": []}]}, ("slices",)),
    ({"tokenizer_source": "union"}, ("union",)),
    ({"models": [{"model": "/nowhere/e1+/nowhere/lora"}]}, ("LoRA",)),
])
def test_unsupported_configs_are_refused_by_name_before_any_io(tiny_family, tmp_path, capsys, change, needles):
    config = _write(tmp_path / "merge.yml", {**_ties_config(tiny_family), **change})
    db = tmp_path / "f.db"
    refused(["merge", "--db", db, "--config", config, "--out", tmp_path / "out", "--model-id", "m",
              "--no-progress"], capsys, *needles)
    assert not (tmp_path / "out").exists()
    if db.exists():  # a reference is resolved against the catalog: nothing may be registered
        with Catalog.open(db) as catalog:
            assert catalog.models.list() == []


def test_flags_that_the_mergekit_config_already_sets_arerefused(tiny_family, tmp_path, capsys):
    config = _write(tmp_path / "merge.yml", _ties_config(tiny_family))
    refused(["plan", "--db", tmp_path / "g.db", "--config", config, "--operator", "dare_ties"], capsys,
             "mergekit config", "--operator")
    assert not (tmp_path / "g.db").exists()


def test_the_own_form_still_needs_base_and_experts(tmp_path, capsys):
    params = _write(tmp_path / "params.yml", {"params": {"density": 0.5}})
    refused(["plan", "--db", tmp_path / "h.db", "--config", params], capsys, "--base and --experts")


def test_without_a_model_id_the_out_folder_names_the_merged_model(tiny_family, tmp_path, capsys):
    """Neither --model-id nor the config's `mergepipe: model_id`: the --out folder's name, said on stderr."""
    config = _write(tmp_path / "merge.yml", _ties_config(tiny_family))
    code, _, err = run_main(["merge", "--db", tmp_path / "i.db", "--config", config, "--out", tmp_path / "out",
                             "--no-progress"], capsys)
    assert code == 0, err
    assert "model id: out (the output folder's name; --model-id to choose another)" in err.splitlines()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["model_id"] == "out"


def test_shard_size_and_chat_template_from_the_config_and_rerun_from_the_output(tiny_family, tmp_path, runner):
    config = _write(tmp_path / "merge.yml", _ties_config(
        tiny_family, chat_template="chatml", mergepipe={"out_shard_size": "40KB", "model_id": "m"}))
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", tmp_path / "a.db", "--config", config, "--out", out, "--no-progress"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert all((out / s).stat().st_size <= 40_000 + 8 + 4096 for s in shards)  # tensor bytes <= 40 kB, + header
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    written = yaml.safe_load((out / "mergepipe_config.yml").read_text())
    assert written["chat_template"] == CHATML and written["mergepipe"]["out_shard_size"] == "40KB"

    again = tmp_path / "again"  # a fresh catalog with the same ids, from the output's own config file
    invoke(runner, ["init-db", "--db", tmp_path / "b.db"])
    invoke(runner, ["register", "--db", tmp_path / "b.db", "--model-id", "base", "--uri", tiny_family["base"]])
    for name in ("e1", "e2"):
        invoke(runner, ["register", "--db", tmp_path / "b.db", "--model-id", name, "--uri", tiny_family[name]])
    invoke(runner, ["merge", "--db", tmp_path / "b.db", "--config", out / "mergepipe_config.yml", "--out", again,
                    "--no-progress"])
    for name in [*shards, "model.safetensors.index.json", "tokenizer_config.json"]:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


@pytest.mark.parametrize("size", ["5B", "5", "0.5GB0"])
def test_an_ambiguous_shard_size_isrefused(tiny_family, tmp_path, capsys, size):
    needle = "give a unit" if size != "0.5GB0" else "cannot parse"
    refused(["plan", "--db", tmp_path / "s.db", "--base", tiny_family["base"], "--experts", tiny_family["e1"],
              "--out-shard-size", size], capsys, needle)
