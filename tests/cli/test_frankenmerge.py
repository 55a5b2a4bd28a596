"""mergekit's ``passthrough`` over ``slices:`` (a frankenmerge: layers stacked from several models, or a model
stacked on itself) through the command line as a user types it: ``mergepipe merge --config`` and
``mergepipe-yaml``.

Every output is compared byte for byte with mergekit 0.1.5's own output of the same file (float32, and a
bfloat16 output rounding a float32 source), and with a plain reading of the sources written here: the
embeddings of the first slice's model, each slice's layers renumbered in order, the final norm and
lm_head of the last slice's model. The output loads in transformers with its config rewritten (layer
count, ``layer_types``); the snapshot verifies, its manifest holds the copy map, lineage names every
source, explain shows where each tensor came from, and its ``mergepipe_config.yml`` makes it again. A
budget below the bytes the map reads, and anything a passthrough cannot be, are refused in one line
before any byte is read (nothing hashed, nothing left registered).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mergepipe.catalog import Catalog
from mergepipe.cli import cli
from tests.fixtures.checkpoints import load_tensors, make_expert
from tests.fixtures.cli import invoke, mergepipe_yaml, refused, wide_runner

#: mergekit-yaml's options, as a user passes them to both commands.
COMMON = ["--random-seed", "0", "--no-copy-tokenizer", "--lazy-unpickle", "--quiet"]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _model(path: Path, arch: str, layers: int, seed: int, dtype: torch.dtype, hidden: int = 64) -> Path:
    """A randomly initialised tiny Llama or Qwen3 of ``layers`` layers, saved by transformers."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    shape = {"vocab_size": 250, "hidden_size": hidden, "intermediate_size": 120, "num_hidden_layers": layers,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    config = LlamaConfig(**shape) if arch == "llama" else Qwen3Config(**shape, head_dim=16)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return path


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> dict[str, Path]:
    """6-layer Llamas: ``a`` (bf16), ``b`` (``a`` fine-tuned), ``f32`` (float32); a 4-layer Qwen3 ``q`` (its
    config lists ``layer_types``); ``narrow``, a Llama of another width."""
    root = tmp_path_factory.mktemp("deep")
    a = _model(root / "a", "llama", 6, 0, torch.bfloat16)
    return {"a": a, "b": make_expert(a, root / "b", seed=5), "f32": _model(root / "f32", "llama", 6, 1, torch.float32),
            "q": _model(root / "q", "qwen3", 4, 2, torch.bfloat16),
            "narrow": _model(root / "narrow", "llama", 6, 3, torch.bfloat16, hidden=32)}


def _slices(*parts: tuple[Path, int, int]) -> list[dict]:
    return [{"sources": [{"model": str(path), "layer_range": [first, end]}]} for path, first, end in parts]


def configs(deep: dict[str, Path]) -> dict[str, dict]:
    """The frankenmerges compared with mergekit: two models stacked; a model stacked on itself under another
    base (config and tokenizer from it); float32 and bf16 sources rounded to a bf16 output."""
    return {
        "stack": {"merge_method": "passthrough", "dtype": "float32",
                  "slices": _slices((deep["a"], 0, 4), (deep["b"], 2, 6))},
        "self": {"merge_method": "passthrough", "base_model": str(deep["b"]), "dtype": "float32",
                 "slices": _slices((deep["a"], 1, 3), (deep["a"], 0, 6))},
        "rounded": {"merge_method": "passthrough", "base_model": str(deep["a"]), "dtype": "float32",
                    "out_dtype": "bfloat16", "slices": _slices((deep["f32"], 0, 2), (deep["a"], 3, 6))},
        # mergekit's plain copy of one model (here cast to float32), `models:` rather than slices
        "copy": {"merge_method": "passthrough", "dtype": "float32", "models": [{"model": str(deep["a"])}]},
    }


#: Per config: (model, first, end) of each slice (names of ``deep``), and the output dtype.
LAYOUTS = {"stack": ([("a", 0, 4), ("b", 2, 6)], torch.float32),
           "self": ([("a", 1, 3), ("a", 0, 6)], torch.float32),
           "copy": ([("a", 0, 6)], torch.float32),
           "rounded": ([("f32", 0, 2), ("a", 3, 6)], torch.bfloat16)}


def reference(deep: dict[str, Path], slices: list[tuple[str, int, int]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The frankenmerge read plainly: embeddings from the first slice's model, the slices' layers renumbered
    in order, the rest (final norm, lm_head) from the last slice's model; cast to ``dtype``."""
    loaded = {name: load_tensors(deep[name]) for name, _, _ in slices}
    out = {"model.embed_tokens.weight": loaded[slices[0][0]]["model.embed_tokens.weight"]}
    n = 0
    for name, first, end in slices:
        for layer in range(first, end):
            for tensor, value in loaded[name].items():
                match = _LAYER.match(tensor)
                if match and int(match[1]) == layer:
                    out[f"model.layers.{n}.{match[2]}"] = value
            n += 1
    last = loaded[slices[-1][0]]
    out.update({t: v for t, v in last.items() if not _LAYER.match(t) and t != "model.embed_tokens.weight"})
    return {t: v.to(dtype) for t, v in out.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _layer(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match[1]) if match else None


def same_bytes(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert set(mine) == set(theirs), set(mine) ^ set(theirs)
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype and mine[name].shape == value.shape, name
        assert torch.equal(mine[name].contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), name


@pytest.fixture(scope="module")
def written(deep, tmp_path_factory) -> dict[str, Path]:
    """name -> the config file of each frankenmerge of ``configs``."""
    root = tmp_path_factory.mktemp("franken-configs")
    paths = {}
    for name, config in configs(deep).items():
        paths[name] = root / f"{name}.yml"
        paths[name].write_text(yaml.safe_dump(config, sort_keys=False))
    return paths


@pytest.fixture(scope="module")
def mergekit_outputs(written, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed (pip install mergekit==0.1.5)")
    from tests.fixtures.mergekit import run_mergekit

    return run_mergekit(written, tmp_path_factory.mktemp("franken-mergekit"))


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def _merge(runner, db: Path, config: Path, out: Path, *flags) -> str:
    return invoke(runner, ["merge", "--db", db, "--config", config, "--out", out, "--no-progress", *flags])


@pytest.mark.mergekit
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stacked_layers_equal_mergekit_and_a_plain_reading_byte_for_byte(deep, written, mergekit_outputs, runner,
                                                                         tmp_path, name):
    out = tmp_path / "out"
    _merge(runner, tmp_path / "c.db", written[name], out)
    mine = load_tensors(out)
    same_bytes(mine, mergekit_outputs[name])
    same_bytes(mine, reference(deep, *LAYOUTS[name]))
    config = json.loads((out / "config.json").read_text())
    donor = json.loads((deep["b" if name == "self" else "a"] / "config.json").read_text())
    assert config == {**donor, "num_hidden_layers": sum(e - f for _, f, e in LAYOUTS[name][0]),
                      "dtype": "bfloat16" if name == "rounded" else "float32"}
    assert (out / "tokenizer_config.json").read_bytes() == (deep["b" if name == "self" else "a"]
                                                           / "tokenizer_config.json").read_bytes()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh HOME: the default catalog is made there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("MERGEPIPE_DB", raising=False)
    return tmp_path / "home"


def test_mergepipe_yaml_copies_the_one_model_of_a_passthrough_with_models(deep, written, home, tmp_path, capsys):
    """`passthrough` with `models:` (mergekit's copy of one model): every tensor of the model as it is, cast to
    the config's dtype, and its config; no note about whose config it is (there is one model)."""
    code, _, err = mergepipe_yaml([written["copy"], tmp_path / "copy", *COMMON], capsys)
    assert code == 0, err
    assert "note: passthrough" not in err
    copied = load_tensors(tmp_path / "copy")
    same_bytes(copied, {k: v.float() for k, v in load_tensors(deep["a"]).items()})
    assert json.loads((tmp_path / "copy" / "config.json").read_text()) == {
        **json.loads((deep["a"] / "config.json").read_text()), "dtype": "float32"}


@pytest.mark.mergekit
def test_mergepipe_yaml_as_a_mergekit_user_types_it(deep, written, mergekit_outputs, home, tmp_path, capsys):
    from mergepipe.cli.mergekit_yaml import main

    out = tmp_path / "stack"
    try:
        main([str(written["stack"]), str(out), *COMMON])
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr().err
    same_bytes(load_tensors(out), mergekit_outputs["stack"])
    assert not (out / "tokenizer_config.json").exists()  # --no-copy-tokenizer, as mergekit
    assert json.loads((out / "manifest.json").read_text())["model_id"] == "stack"


def test_the_output_loads_in_transformers_with_its_layers_and_layer_types(deep, runner, tmp_path):
    """A Qwen3 stacked on itself: 3 + 3 layers of a 4-layer model; transformers validates that
    ``layer_types`` has one entry per layer (mergekit 0.1.5 leaves the base's and fails to save the config)."""
    from transformers import AutoModelForCausalLM

    config = tmp_path / "q.yml"
    config.write_text(yaml.safe_dump({"merge_method": "passthrough", "dtype": "bfloat16",
                                      "slices": _slices((deep["q"], 0, 3), (deep["q"], 1, 4))}))
    out = tmp_path / "q6"
    _merge(runner, tmp_path / "c.db", config, out)
    written = json.loads((out / "config.json").read_text())
    assert written["num_hidden_layers"] == 6 and written["layer_types"] == ["full_attention"] * 6
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == len(model.model.layers) == 6
    loaded = {k: v for k, v in model.state_dict().items() if k in load_tensors(out)}
    expected = reference({"q": deep["q"]}, [("q", 0, 3), ("q", 1, 4)], torch.bfloat16)
    same_bytes(loaded, {k: v for k, v in expected.items() if k in loaded})
    assert set(expected) == set(load_tensors(out))


def test_the_snapshot_verifies_and_records_its_map_lineage_and_explanation(deep, written, runner, tmp_path):
    db, out = tmp_path / "c.db", tmp_path / "out"
    _merge(runner, db, written["stack"], out, "--model-id", "franken")
    assert "OK" in invoke(runner, ["verify", out])
    manifest = json.loads((out / "manifest.json").read_text())
    copy_map = manifest["extra"]["passthrough"]
    assert copy_map["slices"] == [{"model": "a", "layer_range": [0, 4]}, {"model": "b", "layer_range": [2, 6]}]
    rows = {output: (model, tensor) for output, model, tensor in copy_map["tensors"]}
    assert set(rows) == set(load_tensors(out))
    assert rows["model.layers.4.mlp.up_proj.weight"] == ("b", "model.layers.2.mlp.up_proj.weight")
    assert rows["model.embed_tokens.weight"] == ("a", "model.embed_tokens.weight")
    assert rows["lm_head.weight"] == ("b", "lm_head.weight")
    a, b = load_tensors(deep["a"]), load_tensors(deep["b"])
    from_a = _nbytes(a["model.embed_tokens.weight"]) + sum(_nbytes(v) for n, v in a.items() if _layer(n) in range(4))
    from_b = (sum(_nbytes(v) for n, v in b.items() if _layer(n) in range(2, 6)) + _nbytes(b["model.norm.weight"])
              + _nbytes(b["lm_head.weight"]))
    read = manifest["cost"]["realized"]
    assert (read["base_bytes"], read["expert_bytes_by_model"]) == (from_a, {"b": from_b})
    lineage = json.loads(invoke(runner, ["lineage", "--db", db, "franken", "--format", "json"]))
    assert {p["id"] for p in lineage["parents"]} == {"a", "b"}
    explained = json.loads(invoke(runner, ["explain", "--db", db, "franken", "--json"]))
    row = next(t for t in explained["tensors"] if t["tensor"] == "model.layers.4.mlp.up_proj.weight")
    assert row["store"] == {"a": "-", "b": "layer 2"} and row["read"]["b"] == row["blocks"]
    again = invoke(runner, ["merge", "--db", db, "--config", out / "mergepipe_config.yml", "--out", tmp_path / "again",
                            "--no-progress"])
    assert manifest["snapshot_id"] in again
    assert json.loads((tmp_path / "again" / "manifest.json").read_text()) == manifest




def _nothing_left(db: Path, out: Path) -> None:
    """No output, and nothing registered (what a refused command registered on the fly is taken back)."""
    assert not out.exists()
    if db.exists():
        with Catalog.open(db) as catalog:
            assert catalog.models.list() == []


@pytest.mark.parametrize("budget, needles", [
    ("99%", ("budget 99%", "no partial result", "--budget 100%")),
    ("100KiB", ("budget 100KiB", "no partial result")),
    ("20s", ("time budget",)),
])
def test_a_budget_below_the_bytes_the_map_reads_is_refused_before_any_read(written, tmp_path, capsys, budget,
                                                                           needles):
    db, out = tmp_path / "c.db", tmp_path / "out"
    refused(["merge", "--db", db, "--config", written["stack"], "--out", out, "--budget", budget,
              "--model-id", "m", "--no-progress"], capsys, *needles)
    _nothing_left(db, out)


def test_a_budget_that_covers_the_map_is_enough(deep, written, runner, tmp_path):
    needed = sum(t.numel() * t.element_size() for t in reference(deep, *LAYOUTS["stack"]).values()) // 2  # bf16
    _merge(runner, tmp_path / "c.db", written["stack"], tmp_path / "out", "--budget", f"{needed}B")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["budget_bytes"] == needed


def _config(deep, **change) -> dict:
    return {"merge_method": "passthrough", "dtype": "float32",
            "slices": _slices((deep["a"], 0, 4), (deep["b"], 2, 6)), **change}


@pytest.mark.parametrize("change, needles", [
    pytest.param(lambda d: {"slices": [{"sources": [{"model": str(d["a"]), "layer_range": [0, 2]},
                                                    {"model": str(d["b"]), "layer_range": [0, 2]}]}]},
                 ("slice 1 has 2 sources", "one per slice"), id="two sources"),
    pytest.param(lambda d: {"slices": [{"sources": [{"model": str(d["a"]), "layer_range": [0, 2],
                                                     "parameters": {"scale": 0.5}}]}]},
                 ("parameters", "not supported yet"), id="a source's scale"),
    pytest.param(lambda d: {"parameters": {"scale": 0.5}}, ("scale", "not supported yet"), id="global scale"),
    pytest.param(lambda d: {"slices": _slices((d["a"], 0, 4), (d["b"], 4, 8))},
                 ("layer_range [4, 8]", "it has 6 layers"), id="past the last layer"),
    pytest.param(lambda d: {"slices": _slices((d["a"], 0, 4), (d["narrow"], 4, 6))},
                 ("layer 4 of 'narrow' does not fit the base 'a'", "shape"), id="another width"),
    pytest.param(lambda d: {"slices": _slices((d["a"], 0, 4), (d["q"], 2, 4))}, ("does not fit the base 'a'",),
                 id="another architecture"),
    pytest.param(lambda d: {"slices": _slices((d["a"], 2, 1))}, ("layer_range",), id="empty range"),
    pytest.param(lambda d: {"slices": None, "models": [{"model": str(d["a"])}, {"model": str(d["b"])}]},
                 ("passthrough with `models:` copies one model as it is",), id="models form of two"),
    pytest.param(lambda d: {"slices": None, "models": [{"model": str(d["a"]), "parameters": {"scale": 0.5}}]},
                 ("give one model without parameters",), id="models form with a scale"),
    pytest.param(lambda d: {"slices": _slices((Path(f"{d['a']}+{d['b']}"), 0, 2))},
                 ("merge an adapter into its model first",), id="adapter"),
    pytest.param(lambda d: {"merge_method": "slerp", "base_model": str(d["a"]), "parameters": {"t": 0.5},
                            "slices": [{"sources": [{"model": str(d["a"]), "layer_range": [0, 4]},
                                                    {"model": str(d["b"]), "layer_range": [2, 6]}]}]},
                 ("frankenmerge", "not supported yet"), id="slerp of differing ranges"),
])
def test_what_a_passthrough_cannot_be_is_refused_in_one_line(deep, tmp_path, capsys, change, needles):
    config = {k: v for k, v in {**_config(deep), **change(deep)}.items() if v is not None}
    path = tmp_path / "m.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    db, out = tmp_path / "c.db", tmp_path / "out"
    refused(["merge", "--db", db, "--config", path, "--out", out, "--model-id", "m", "--no-progress"], capsys,
             *needles)
    _nothing_left(db, out)


def test_a_source_changed_on_disk_after_it_was_hashed_is_refused_and_nothing_published(deep, tmp_path, runner,
                                                                                       capsys):
    """Every block copied is checked against its recorded hash: a byte flipped behind the catalog's back, with
    the file's size and mtime restored, aborts the copy."""
    source = tmp_path / "b"
    shutil.copytree(deep["b"], source)
    config = tmp_path / "m.yml"
    config.write_text(yaml.safe_dump(_config(deep, base_model=str(deep["a"]),
                                             slices=_slices((deep["a"], 0, 4), (source, 2, 6)))))
    db = tmp_path / "c.db"
    invoke(runner, ["plan", "--db", db, "--config", config, "--no-progress"])  # registers and hashes b
    weights = source / "model.safetensors"
    stat = weights.stat()
    with weights.open("r+b") as handle:
        handle.seek(stat.st_size - 10)
        byte = handle.read(1)
        handle.seek(stat.st_size - 10)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    refused(["merge", "--db", db, "--config", config, "--out", tmp_path / "out", "--model-id", "m",
              "--quiet"], capsys, "changed on disk since it was analysed", "nothing was published")
    assert not (tmp_path / "out").exists()


def test_a_saved_plan_executes_to_the_same_bytes(deep, written, runner, tmp_path):
    """The plan, stored with its copy map, is read back strictly (its digest checked) and executed."""
    db = tmp_path / "c.db"
    result = runner.invoke(cli, ["plan", "--db", str(db), "--config", str(written["stack"]), "--save", "--json",
                                 "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["copies"]["slices"] == [{"model": "a", "layer_range": [0, 4]}, {"model": "b", "layer_range": [2, 6]}]
    assert plan["reads"] == {} and plan["merge"]["operator"] == "passthrough"
    invoke(runner, ["execute", "--db", db, "--plan", plan["digest"][:12], "--out", tmp_path / "out", "--model-id",
                    "franken", "--no-progress"])
    same_bytes(load_tensors(tmp_path / "out"), reference(deep, *LAYOUTS["stack"]))
