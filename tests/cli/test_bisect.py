"""`mergepipe bisect`: a planted regression traced to the retrained expert and the layers it damaged.

The fixture is a 6-layer Llama with a real (character) tokenizer, four
experts, and a retrained version of each; the retrain of ``b`` (and, for two
culprits, of ``d``) adds large noise to some layers. What the search must
name is known from how the fixture was made, not from MergePipe.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import pytest
import torch

from mergepipe.cli import cli
from examples.demo_models import write_tokenizer
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, refused, wide_runner

LAYERS = 6
EXPERTS = ("a", "b", "c", "d")
SMALL = 0.004


TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "Two plus two is four; three times three is nine.", "A merge of experts keeps what each one learned."]


def _base(folder: Path) -> Path:
    """A 6-layer Llama trained a little on the held-out texts, so that damaging it raises its loss."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    write_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=120, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = [torch.tensor([tokenizer(text)["input_ids"]]) for text in TEXTS]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        ids = batch[step % len(batch)]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def _retrain(base: Path, out: Path, seed: int, damaged: tuple[int, ...] = ()) -> Path:
    """A retrained version: small changes everywhere, and noise 50x larger in the ``damaged`` layers."""
    scales = {layer: (50.0 if layer in damaged else 1.0) for layer in range(LAYERS)}
    return make_expert(base, out, seed=seed, scale=SMALL, layer_scale=scales)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bisect")
    base = _base(root / "base")
    made = {"base": base}
    for i, name in enumerate(EXPERTS):
        made[name] = _retrain(base, root / name, seed=10 + i)
        made[name + "2"] = _retrain(base, root / f"{name}2", seed=20 + i, damaged=(3, 4) if name == "b" else ())
    made["d2-damaged"] = _retrain(base, root / "d2-damaged", seed=30, damaged=(1,))
    data = root / "held-out.txt"
    data.write_text("\n\n".join(TEXTS) + "\n")
    made["data"] = data
    return made


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _two_versions(runner, db: Path, models: dict[str, Path], second: dict[str, str]) -> None:
    """merged@1 from a..d, then merged@2 from the second versions (``second``: expert -> folder key) and
    density 0.6 instead of 0.5."""
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", models["base"]])
    for name in EXPERTS:
        invoke(runner, ["register", "--db", db, "--model-id", name, "--uri", models[name]])
    merge = ["merge", "--db", db, "--base", "base", "--experts", *EXPERTS, "--operator", "ties", "--no-progress",
             "--model-id", "merged"]
    invoke(runner, [*merge, "--density", "0.5", "--out", db.parent / "v1"])
    for name in EXPERTS:
        invoke(runner, ["register", "--db", db, "--model-id", name, "--uri", models[second[name]], "--new-version"])
    invoke(runner, [*merge, "--density", "0.6", "--out", db.parent / "v2"])


def _bisect(runner, db: Path, data: Path, *extra) -> dict:
    args = ["bisect", "--db", db, "merged@1", "merged@2", "--data", data, "--max-tokens", 64, "--json", "--no-progress",
            *extra]
    result = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bisect_names_the_damaged_expert_and_its_layers_within_the_bound(models, tmp_path, runner):
    db = tmp_path / "c.db"
    _two_versions(runner, db, models, {name: name + "2" for name in EXPERTS})
    result = _bisect(runner, db, models["data"], "--html", tmp_path / "bisect.html")

    n = len(result["changes"])
    assert n == 5  # four expert versions and the density
    assert result["bad"]["loss"] > result["good"]["loss"]
    assert [[c for c in group] for group in result["culprits"]] == [[next(c for c in result["changes"]
                                                                          if c.startswith("b"))]]
    change_probes = [p for p in result["probes"] if p["stage"] == "changes"]
    assert len(change_probes) <= math.ceil(math.log2(n)) + 3
    layers = {int(part) for group in result["tensors"] for name in group["tensors"]
              for part in [name.split(".")[2]] if name.startswith("model.layers.")}
    assert layers == {3, 4}
    assert all(name.startswith(("model.layers.3.", "model.layers.4.")) for g in result["tensors"]
               for name in g["tensors"])
    page = (tmp_path / "bisect.html").read_text()
    assert "Culprits" in page and html.escape(result["culprits"][0][0]) in page

    again = _bisect(runner, db, models["data"])  # every probe stored: nothing computed
    assert again["evaluations_computed"] == 0
    assert again["culprits"] == result["culprits"] and again["tensors"] == result["tensors"]


def test_bisect_finds_two_culprits(models, tmp_path, runner):
    db = tmp_path / "c.db"
    second = {name: name + "2" for name in EXPERTS} | {"d": "d2-damaged"}
    _two_versions(runner, db, models, second)
    # each damage alone costs about 0.1 to 0.15 of loss here, both together 0.26: half the gap would hide one
    result = _bisect(runner, db, models["data"], "--no-tensors", "--tolerance", 0.05)
    culprits = sorted(c for group in result["culprits"] for c in group)
    assert [c[0] for c in culprits] == ["b", "d"]
    n = len(result["changes"])
    assert len(result["probes"]) <= 2 * math.ceil(math.log2(n)) + 3
    assert result["tensors"] == []


def test_bisect_refuses_what_is_not_a_regression(models, tmp_path, runner, capsys):
    db = tmp_path / "c.db"
    _two_versions(runner, db, models, {name: name + "2" for name in EXPERTS})
    refused(["bisect", "--db", db, "merged@2", "merged@1", "--data", models["data"], "--max-tokens", 64],
            capsys, "no regression to bisect")
    refused(["bisect", "--db", db, "merged@1", "merged@1", "--data", models["data"]], capsys, "same merge")


def test_bisect_of_merges_without_tokenizer_files_takes_tokenizer(models, tmp_path, runner, capsys):
    """The same models without tokenizer files: bisect refuses in one line naming --tokenizer, and with it
    names the damaged expert."""
    bare = {"data": models["data"]}
    for name, folder in models.items():
        if name != "data":
            bare[name] = tmp_path / "bare" / name
            bare[name].mkdir(parents=True)
            for side in ("model.safetensors", "config.json"):
                (bare[name] / side).write_bytes((folder / side).read_bytes())
    db = tmp_path / "c.db"
    _two_versions(runner, db, bare, {name: name + "2" for name in EXPERTS})
    refused(["bisect", "--db", db, "merged@1", "merged@2", "--data", models["data"]], capsys, "no tokenizer files",
            "--tokenizer PATH_OR_HUB_ID")
    result = _bisect(runner, db, models["data"], "--no-tensors", "--tokenizer", models["base"])
    assert result["culprits"] == [[next(c for c in result["changes"] if c.startswith("b"))]]
