"""`mergepipe-yaml CONFIG OUT [mergekit-yaml's options]`: each option as a mergekit user passes it.

Options that ask for what MergePipe does not do are refused by name in one line before anything is
written (not even the default catalog); a device this machine lacks likewise, pointing to --device;
options that do not apply are accepted with a `note:` line; the others do what mergekit's do
(--no-copy-tokenizer, --out-shard-size in mergekit's own form, --random-seed). Each test runs in a
fresh HOME: the catalog is the per-user default one, made by the test. Expected values come from the
files written (safetensors headers, the base's tokenizer file), not from MergePipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from mergepipe.cli.mergekit_yaml import shard_bytes
from tests.fixtures.checkpoints import load_tensors, make_base, make_expert, tiny_config
from tests.fixtures.cli import mergepipe_yaml, run_main

#: A shard size in mergekit's form (``parse_kmb``: M is a million): five million bytes.
FIVE_M = 5_000_000


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh HOME with no data directory or catalog chosen: the default catalog goes under it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("MERGEPIPE_DB", raising=False)
    return tmp_path / "home"


def write_config(path: Path, family: dict[str, Path], method: str = "ties", **parameters) -> Path:
    """A mergekit config of ``family``'s base and experts e1, e2 (weights 1 and 0.5, density 0.5)."""
    config = {"merge_method": method, "base_model": str(family["base"]), "dtype": "float32",
              "parameters": {"density": 0.5, **parameters},
              "models": [{"model": str(family["e1"]), "parameters": {"weight": 1.0}},
                         {"model": str(family["e2"]), "parameters": {"weight": 0.5}}]}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def config(tiny_family, tmp_path) -> Path:
    return write_config(tmp_path / "ties.yml", tiny_family)


def default_catalog(home: Path) -> Path:
    return home / ".local" / "share" / "mergepipe" / "catalog.db"


def one_error_line(code, out: str, err: str, notes: int = 0) -> str:
    """The one `error:` line of a refused command (no traceback, nothing on stdout), after ``notes`` lines of
    `note:` on what an option was taken to mean."""
    assert code not in (0, None), err
    lines = err.strip().splitlines()
    assert [line.startswith("note: ") for line in lines[:notes]] == [True] * notes, err
    lines = lines[notes:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert out == ""
    return lines[0]


def assert_nothing_written(home: Path, *paths: Path) -> None:
    assert not home.exists()  # not even the default catalog's folder
    for path in paths:
        assert not path.exists(), path


# --------------------------------------------------------------------------- the device


@pytest.mark.parametrize("flags", [["--cuda"], ["--device", "cuda"], ["--gpu-rich"]])
def test_cuda_without_a_gpu_is_one_line_before_anything_is_read(config, home, tmp_path, monkeypatch, capsys,
                                                                 flags):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    code, out, err = mergepipe_yaml([config, tmp_path / "out", *flags], capsys)
    line = one_error_line(code, out, err, notes=int(flags == ["--gpu-rich"]))  # what --gpu-rich is taken to mean
    assert "no CUDA device is available" in line and "--device cpu" in line and "--db" not in line
    # refused before the catalog was opened, any checkpoint read or the plan made
    assert_nothing_written(home, tmp_path / "out")


def test_the_installed_console_script_runs_and_refuses_cuda_in_one_line(config, tmp_path):
    """`mergepipe-yaml` as installed ([project.scripts]), in a process where CUDA is hidden."""
    script = Path(sys.executable).parent / "mergepipe-yaml"
    assert script.is_file(), "the mergepipe-yaml entry point is not installed (pip install -e .)"
    env = {**os.environ, "HOME": str(tmp_path / "home"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("XDG_DATA_HOME", None)
    env.pop("MERGEPIPE_DB", None)
    helped = subprocess.run([str(script), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: mergepipe-yaml [OPTIONS] CONFIG OUT")
    proc = subprocess.run([str(script), str(config), str(tmp_path / "out"), "--cuda"], env=env,
                          capture_output=True, text=True, timeout=120)
    line = one_error_line(proc.returncode, proc.stdout, proc.stderr)
    assert "--device cpu" in line and "--db" not in line
    assert_nothing_written(tmp_path / "home", tmp_path / "out")


def test_merge_points_cuda_to_device(tiny_family, tmp_path, monkeypatch, capsys):
    """mergekit's --cuda given to `mergepipe merge` names --device cuda (click would suggest --db); --device
    cuda without a GPU points to --device cpu; both before the catalog is created."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    db = tmp_path / "catalog.db"
    args = ["merge", "--db", db, "--base", tiny_family["base"], "--experts", tiny_family["e1"], "--out",
            tmp_path / "out"]
    line = one_error_line(*run_main([*args, "--cuda"], capsys))
    assert line.startswith("error: no such option --cuda: MergePipe's is --device cuda") and "--db" not in line
    line = one_error_line(*run_main([*args, "--device", "cuda"], capsys))
    assert line == "error: --device cuda was asked for but no CUDA device is available; use --device cpu"
    assert not db.exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- refused and ignored options


@pytest.mark.parametrize("flags, named", [
    (["--unsafe-truncate-embeddings"], "--unsafe-truncate-embeddings"),
    (["--no-write-model-card"], "--no-write-model-card"),
    (["--no-safe-serialization"], "--no-safe-serialization"),
    (["--lora-merge-dtype", "bfloat16"], "--lora-merge-dtype"),
])
@pytest.mark.parametrize("db", [False, True], ids=["default-catalog", "db"])
def test_options_mergepipe_does_not_do_are_refused_by_name(config, home, tmp_path, capsys, flags, named, db):
    given_db = ["--db", tmp_path / "catalog.db"] if db else []
    code, out, err = mergepipe_yaml([config, tmp_path / "out", *given_db, *flags], capsys)
    line = one_error_line(code, out, err)
    assert line.startswith(f"error: {named}") and "drop the flag" in line
    assert_nothing_written(home, tmp_path / "out", tmp_path / "catalog.db")


def test_allow_crimes_is_a_note_and_what_it_would_allow_is_still_refused(config, tiny_family, home, tmp_path,
                                                                         capsys):
    """--allow-crimes, in most copied mergekit command lines, changes nothing where the architectures match: the
    merge runs, as without it; an expert of another architecture is refused all the same, naming it."""
    code, _, err = mergepipe_yaml([config, tmp_path / "with", "--quiet", "--allow-crimes"], capsys)
    assert code == 0, err
    assert ("note: --allow-crimes ignored: it lets mergekit merge models of other architectures than the base's; "
            "where they match it changes nothing, and a model whose tensor names or shapes differ from the base's is "
            "still refused, by name") in err.splitlines()
    code, _, err = mergepipe_yaml([config, tmp_path / "without", "--quiet", "--db", tmp_path / "other.db"], capsys)
    assert code == 0, err
    with_flag, without = load_tensors(tmp_path / "with"), load_tensors(tmp_path / "without")
    assert with_flag.keys() == without.keys() and all(torch.equal(with_flag[k], without[k]) for k in without)

    qwen = make_base(tmp_path / "qwen", arch="qwen3", dtype="bf16")
    crime = write_config(tmp_path / "crime.yml", {**tiny_family, "e2": qwen})
    code, out, err = mergepipe_yaml([crime, tmp_path / "crime", "--quiet", "--allow-crimes"], capsys)
    said = [x for x in err.splitlines() if not x.startswith(("catalog: ", "model id: "))]  # what it was told
    line = one_error_line(code, out, "\n".join(said), notes=1)
    assert line.startswith("error: expert 'qwen' does not match the layout of base 'base'") and "extra tensor" in line
    assert not (tmp_path / "crime").exists()


def test_no_copy_tokenizer_leaves_only_the_tokenizer_out_and_lazy_unpickle_is_a_note(config, tiny_family, home,
                                                                                     tmp_path, capsys):
    copied, bare = tmp_path / "copied" / "ties", tmp_path / "bare" / "ties"
    code, _, err = mergepipe_yaml([config, copied, "--quiet", "--db", tmp_path / "a.db"], capsys)
    assert code == 0, err
    code, _, err = mergepipe_yaml([config, bare, "--quiet", "--db", tmp_path / "b.db", "--no-copy-tokenizer",
                                   "--lazy-unpickle"], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes == ["note: --lazy-unpickle ignored: MergePipe reads safetensors only (never pickles), each block "
                     "as needed"]
    tokenizer = (tiny_family["base"] / "tokenizer_config.json").read_bytes()
    assert (copied / "tokenizer_config.json").read_bytes() == tokenizer
    assert not (bare / "tokenizer_config.json").exists()
    # the manifests list the same files with the same bytes, but for the tokenizer's
    listed = [{f["name"]: f for f in json.loads((d / "manifest.json").read_text())["files"]} for d in (copied, bare)]
    assert set(listed[0]) - set(listed[1]) == {"tokenizer_config.json"} and set(listed[1]) <= set(listed[0])
    assert all(listed[0][name] == entry for name, entry in listed[1].items())
    assert {p.name for p in copied.iterdir()} - {p.name for p in bare.iterdir()} == {"tokenizer_config.json"}


# --------------------------------------------------------------------------- output shards


@pytest.fixture(scope="module")
def wide_family(tmp_path_factory) -> dict[str, Path]:
    """A Llama base whose float32 merge is about 6.2 MB (a 12,000-token vocabulary), so that 5M shards it;
    two experts."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("wide")
    config = tiny_config("llama")
    config.vocab_size = 12_000
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root / "base")
    return {"base": root / "base", "e1": make_expert(root / "base", root / "e1", seed=1),
            "e2": make_expert(root / "base", root / "e2", seed=2, scale=0.03)}


def tensor_bytes(shard: Path) -> dict[str, tuple[int, int]]:
    """Each tensor of a safetensors file: (data offset, byte size), from its header."""
    header_size = int.from_bytes(shard.read_bytes()[:8], "little")
    header = json.loads(shard.read_bytes()[8:8 + header_size])
    return {name: (v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for name, v in header.items() if name != "__metadata__"}


def test_out_shard_size_in_mergekits_form_shards_the_output(wide_family, home, tmp_path, capsys):
    assert shard_bytes("5M") == FIVE_M  # mergekit's parse_kmb: M is a million
    config = write_config(tmp_path / "ties.yml", wide_family)
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    code, _, err = mergepipe_yaml([config, whole, "--quiet", "--db", tmp_path / "a.db"], capsys)
    assert code == 0, err
    code, _, err = mergepipe_yaml([config, sharded, "--quiet", "--db", tmp_path / "b.db", "--out-shard-size", "5M"],
                                  capsys)
    assert code == 0, err
    assert [p.name for p in whole.glob("*.safetensors")] == ["model.safetensors"]
    shards = sorted(sharded.glob("*.safetensors"))
    assert [p.name for p in shards] == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    contents = [tensor_bytes(p) for p in shards]
    assert index["weight_map"] == {name: p.name for p, c in zip(shards, contents) for name in c}
    sizes = [sum(size for _, size in c.values()) for c in contents]
    assert all(size <= FIVE_M for size in sizes)
    assert sum(sizes) == sum(size for _, size in tensor_bytes(whole / "model.safetensors").values()) > FIVE_M
    # packed greedily: the second shard's first tensor did not fit in the first
    first_of_second = min(contents[1].values())[1]
    assert sizes[0] + first_of_second > FIVE_M
    # the same tensors, sharded
    mine, reference = load_tensors(sharded), load_tensors(whole)
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)
    with safe_open(str(shards[0]), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


# --------------------------------------------------------------------------- random seeds


def test_random_seed_reaches_dare(tiny_family, home, tmp_path, capsys):
    """Two seeds give two DARE masks; the same seed in another catalog (computed again, not re-materialised)
    gives the same bytes."""
    config = write_config(tmp_path / "dare.yml", tiny_family, method="dare_ties")
    runs = {"seed1": (1, "a.db"), "seed2": (2, "a.db"), "seed1-again": (1, "b.db")}
    for name, (seed, db) in runs.items():
        code, _, err = mergepipe_yaml([config, tmp_path / name, "--quiet", "--db", tmp_path / db,
                                       "--random-seed", seed], capsys)
        assert code == 0, err
        assert json.loads((tmp_path / name / "manifest.json").read_text())["seed"] == seed
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in runs}
    assert weights["seed1"] == weights["seed1-again"]
    assert weights["seed1"] != weights["seed2"]
    one, two = load_tensors(tmp_path / "seed1"), load_tensors(tmp_path / "seed2")
    base = load_tensors(tiny_family["base"])
    differing = [k for k in one if not torch.equal(one[k], two[k])]
    changed = [k for k in base if not torch.equal(one[k], base[k].float())]
    assert differing and set(differing) <= set(changed)  # the masks differ where the experts change the base
