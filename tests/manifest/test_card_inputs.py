"""The model card names its inputs as people know them: the Hub's front matter for a merge (``base_model``
listing the base and each expert by Hub id or folder name, never by a catalog-only id;
``base_model_relation: merge``; ``library_name``; ``tags``) and each expert's weight as the merge stated it,
a gradient or filter rules included. The card is still the manifest's: ``verify`` writes it again."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.cli import invoke, wide_runner


def _front_matter(card: str) -> dict:
    match = re.match(r"---\n(.*?)\n---\n", card, re.S)
    assert match, card[:200]
    return yaml.safe_load(match.group(1))


def _table_weights(card: str) -> dict[str, str]:
    """expert id -> the weight cell of the card's Inputs table."""
    rows = re.findall(r"^\| expert \| `([^`]+)` \| (.*?) \| `[0-9a-f]+` \|$", card, re.M)
    return dict(rows)


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def test_the_card_shows_weights_as_written_and_the_base_by_its_folder(tiny_family, tmp_path, runner):
    base = tmp_path / "Llama-tiny-base"
    shutil.copytree(tiny_family["base"], base)
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", base])  # an id only the catalog knows
    config = tmp_path / "merge.yml"
    rules = [{"filter": "mlp", "value": 0.5}, {"value": 1.0}]
    config.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic",
        "base_model": "base",
        "models": [{"model": str(tiny_family["e1"]), "parameters": {"weight": [0, 0.3, 0.7, 1]}},
                   {"model": str(tiny_family["e2"]), "parameters": {"weight": rules}},
                   {"model": str(tiny_family["e3"]), "parameters": {"weight": 0.25}}],
        "mergepipe": {"model_id": "m"},
    }))
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--config", config, "--out", out, "--no-progress"])
    card = (out / "README.md").read_text()

    assert _front_matter(card) == {"base_model": ["Llama-tiny-base", "e1", "e2", "e3"], "base_model_relation": "merge",
                                   "library_name": "transformers", "tags": ["merge", "mergepipe"]}
    assert "\ntags: [merge, mergepipe]\n" in card
    weights = _table_weights(card)
    assert weights == {"e1": "[0, 0.3, 0.7, 1]", "e2": "[{filter: mlp, value: 0.5}, {value: 1.0}]", "e3": "0.25"}
    assert yaml.safe_load(weights["e2"]) == rules  # the cell is the setting itself
    assert verify_snapshot(out).ok


def test_the_base_s_hub_id_comes_from_its_config(tiny_family, tmp_path, runner):
    base = tmp_path / "downloaded"
    shutil.copytree(tiny_family["base"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "_name_or_path": "meta-llama/Llama-3.2-1B"}))
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", tmp_path / "c.db", "--base", base, "--experts", tiny_family["e1"],
                    "--operator", "task_arithmetic", "--out", out, "--model-id", "m", "--no-progress"])
    card = (out / "README.md").read_text()
    assert _front_matter(card)["base_model"] == ["meta-llama/Llama-3.2-1B", "e1"]
    assert json.loads((out / "manifest.json").read_text())["extra"]["base_name"] == "meta-llama/Llama-3.2-1B"
    assert _table_weights(card) == {"e1": "1"}  # no weight stated: 1, as ever
    assert verify_snapshot(out).ok


def test_a_base_in_the_hub_cache_is_named_by_its_repository(tiny_family, tmp_path, runner):
    base = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / ("0123abcd" * 5)
    shutil.copytree(tiny_family["base"], base)
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", tmp_path / "c.db", "--base", base, "--experts", tiny_family["e1"],
                    "--operator", "task_arithmetic", "--out", out, "--model-id", "m", "--no-progress"])
    assert _front_matter((out / "README.md").read_text())["base_model"] == ["Qwen/Qwen3-0.6B", "e1"]


def test_experts_are_named_by_their_folders_or_hub_ids_never_by_catalog_only_ids(tiny_family, tmp_path, runner):
    """An expert registered under an id of the catalog's own is named in the card by where it is: its folder,
    or the repository of a folder in the Hub's cache; the manifest records those names (and only those that
    differ from the ids: a merge of experts in folders named as their ids keeps its manifest as it was)."""
    cached = tmp_path / "hub" / "models--acme--Math-7B" / "snapshots" / ("89abcdef" * 5)
    shutil.copytree(tiny_family["e1"], cached)
    db = tmp_path / "c.db"
    for model_id, uri in (("base", tiny_family["base"]), ("math", cached), ("code", tiny_family["e2"]),
                          ("e3", tiny_family["e3"])):
        invoke(runner, ["register", "--db", db, "--model-id", model_id, "--uri", uri])
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "math", "code", "e3",
                    "--operator", "task_arithmetic", "--out", out, "--model-id", "m", "--no-progress"])
    card = (out / "README.md").read_text()
    assert _front_matter(card)["base_model"] == ["base", "acme/Math-7B", "e2", "e3"]
    assert _front_matter(card)["base_model_relation"] == "merge"
    extra = json.loads((out / "manifest.json").read_text())["extra"]
    assert extra["expert_names"] == {"code": "e2", "math": "acme/Math-7B"}
    assert _table_weights(card) == {"math": "1", "code": "1", "e3": "1"}  # the table keeps the catalog's ids
    assert verify_snapshot(out).ok

    same_names = tmp_path / "same"
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e3", "--operator", "task_arithmetic",
                    "--out", same_names, "--model-id", "m2", "--no-progress"])
    assert "expert_names" not in json.loads((same_names / "manifest.json").read_text())["extra"]
    assert _front_matter((same_names / "README.md").read_text())["base_model"] == ["base", "e3"]
