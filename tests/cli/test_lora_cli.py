"""`register --kind lora` (and an adapter found by its adapter_config.json) through the command line: what
it records, analyze and merge with a full expert, and one-line refusals that register nothing (through
``main``, which prints MergePipeErrors without a traceback). Adapters are made by peft itself."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.lora import make_lora_adapter

peft = pytest.importorskip("peft")
LoraConfig = peft.LoraConfig

# id -> LoraConfig kwargs of adapters refused by this version or by the reader, and the refusal's words
REFUSED = {
    # its saved copy of the embedding is changed below: a retrained embedding, not only LoRA on it
    "embedding": (dict(r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj"]), "differs from the base's"),
    "dora": (dict(r=2, lora_alpha=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
}


@pytest.fixture(scope="module")
def adapters(tiny_family, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-cli")
    base = tiny_family["base"]
    out = {"good": make_lora_adapter(base, root / "good", LoraConfig(r=4, lora_alpha=8,
                                                                       target_modules=["q_proj", "o_proj"]), "bf16")}
    for name, (kwargs, _) in REFUSED.items():
        out[name] = make_lora_adapter(base, root / name, LoraConfig(**kwargs), "bf16")
    weights = out["embedding"] / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    copy = "base_model.model.model.embed_tokens.base_layer.weight"
    tensors[copy] = tensors[copy] * 1.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


@pytest.fixture
def db(tmp_path, tiny_family, monkeypatch) -> tuple:
    runner = wide_runner(monkeypatch)
    path = tmp_path / "c.db"
    invoke(runner, ["init-db", "--db", path, "--block-bytes", "1KiB"])
    for model_id in ("base", "e1"):
        invoke(runner, ["register", "--db", path, "--model-id", model_id, "--uri", tiny_family[model_id]])
    return runner, path


def _models(runner, path: Path) -> dict:
    return {m["id"]: m for m in json.loads(invoke(runner, ["models", "--db", path, "--json"]))}


@pytest.mark.parametrize("kind", [["--kind", "lora"], []])
def test_register_analyze_and_merge_with_a_full_expert(db, adapters, tmp_path, kind):
    runner, path = db
    text = invoke(runner, ["register", "--db", path, "--model-id", "math-lora", "--uri", adapters["good"],
                           "--base", "base", *kind])
    assert "registered 'math-lora'" in text and "a LoRA adapter against 'base'" in text
    model = _models(runner, path)["math-lora"]
    assert (model["kind"], model["delta_base"]) == ("lora", "base")
    again = invoke(runner, ["register", "--db", path, "--model-id", "math-lora", "--uri", adapters["good"],
                            "--base", "base", *kind])
    assert "nothing to do" in again
    invoke(runner, ["analyze", "--db", path, "--no-progress"])  # hashes only: adapters too
    invoke(runner, ["analyze", "--db", path, "--base", "base", "--no-progress"])
    invoke(runner, ["merge", "--db", path, "--base", "base", "--experts", "e1", "math-lora", "--operator", "ties",
                    "--density", "0.5", "--out", tmp_path / "merged", "--model-id", "m", "--no-progress"])
    manifest = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert manifest["extra"]["expert_kinds"] == {"math-lora": "lora"}
    lora = manifest["extra"]["lora"]["math-lora"]
    assert (lora["rank"], lora["scale"], lora["targets"]) == (4, 2.0, 4)
    config = (adapters["good"] / "adapter_config.json").read_bytes()
    assert lora["config_sha256"] == hashlib.sha256(config).hexdigest()
    assert lora["factor_bytes_read"] == manifest["cost"]["realized"]["expert_bytes_by_model"]["math-lora"] > 0
    explained = invoke(runner, ["explain", "--db", path, "m", "--json"])
    assert "math-lora" in explained  # the planner's per-expert block sizes explain an adapter's reads too


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_adapters_are_refused_in_one_line(db, adapters, capsys, case):
    runner, path = db
    before = _models(runner, path)
    code, _, err = run_main(["register", "--db", path, "--model-id", "x", "--uri", adapters[case], "--kind", "lora",
                             "--base", "base"], capsys)
    assert code != 0 and err.count("\n") == 1 and REFUSED[case][1] in err and "Traceback" not in err
    assert _models(runner, path) == before


@pytest.mark.parametrize("args, message", [
    ([], "is a LoRA adapter (adapter_config.json): register it with --base BASE"),
    (["--kind", "lora"], "give --base BASE"),
])
def test_an_adapter_needs_its_base(db, adapters, capsys, args, message):
    runner, path = db
    before = _models(runner, path)
    code, _, err = run_main(["register", "--db", path, "--model-id", "x", "--uri", adapters["good"], *args], capsys)
    assert code != 0 and err.count("\n") == 1 and message in err
    assert _models(runner, path) == before


def test_a_config_changed_after_registration_is_refused(db, adapters, tmp_path, capsys):
    runner, path = db
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in adapters["good"].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    invoke(runner, ["register", "--db", path, "--model-id", "l", "--uri", copy, "--base", "base"])
    config = json.loads((copy / "adapter_config.json").read_text())
    config["lora_alpha"] = 16  # doubles every ΔW: the factors' bytes and hashes are unchanged
    (copy / "adapter_config.json").write_text(json.dumps(config))
    os.utime(copy / "adapter_config.json", ns=(1, 1))
    code, _, err = run_main(["analyze", "--db", path, "--base", "base", "l", "--no-progress"], capsys)
    assert code != 0 and err.count("\n") == 1 and "changed on disk since registration" in err


def test_a_pickled_adapter_is_refused_by_the_reader(db, adapters, tmp_path, capsys):
    runner, path = db
    copy = tmp_path / "bin"
    copy.mkdir()
    (copy / "adapter_config.json").write_bytes((adapters["good"] / "adapter_config.json").read_bytes())
    (copy / "adapter_model.bin").write_bytes(b"not read")
    before = _models(runner, path)
    code, _, err = run_main(["register", "--db", path, "--model-id", "p", "--uri", copy, "--base", "base"], capsys)
    assert code != 0 and err.count("\n") == 1 and "is a pickled adapter" in err and "Traceback" not in err
    assert _models(runner, path) == before
