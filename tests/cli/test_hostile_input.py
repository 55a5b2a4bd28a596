"""Hostile or broken input through the command line, as a user types it: every refusal is one ``error:`` line
(``main`` prints MergePipeErrors without a traceback), exits non-zero, and leaves nothing registered or written.

Adapter configs (``adapter_config.json``, a third party's file): an invalid regular expression in each
pattern field, and a pattern that backtracks without end in Python's re (``(.*.*)*X``), which RE2 matches in
linear time. YAML configs (``merge --config`` and ``integrate``'s recipe): nesting past Python's recursion
limit, bytes that are not UTF-8, an integer of more digits than Python converts. And an ``integrate`` recipe's
remote checkpoints stay remote (they were once resolved as paths next to the recipe); a malformed http(s) URL (an
unclosed bracket, an invisible character in the host, a port that is no number) is one line without its secrets.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mergepipe.app.integration import load_recipe
from mergepipe.storage.location import RemotePath
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.lora import make_lora_adapter
from tests.fixtures.remote import RangeServer

peft = pytest.importorskip("peft")

#: A pattern that Python's re backtracks on for hours against any module path without an X.
STALLING = "(.*.*)*X"
#: Seconds within which a refusal must come, where the old matching did not finish in hours.
TIME_LIMIT = 60


@pytest.fixture(scope="module")
def adapter(tiny_family, tmp_path_factory) -> Path:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    return make_lora_adapter(tiny_family["base"], tmp_path_factory.mktemp("hostile") / "adapter", config, "bf16")


@pytest.fixture
def db(tmp_path, tiny_family, monkeypatch) -> tuple:
    runner = wide_runner(monkeypatch)
    path = tmp_path / "c.db"
    invoke(runner, ["init-db", "--db", path, "--block-bytes", "1KiB"])
    invoke(runner, ["register", "--db", path, "--model-id", "base", "--uri", tiny_family["base"]])
    return runner, path


def _models(runner, path: Path) -> list[str]:
    return sorted(m["id"] for m in json.loads(invoke(runner, ["models", "--db", path, "--json"])))


def _edited(adapter: Path, where: Path, **changes) -> Path:
    """A copy of ``adapter`` at ``where``/adapter with ``changes`` made to its config."""
    copy = where / "adapter"
    shutil.copytree(adapter, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    config.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(config))
    return copy


def _one_line(code, err: str) -> None:
    assert code not in (0, None) and err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err


# ---- adapter configs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("target_modules", "(q|o)_proj)"),
    ("exclude_modules", "layers.[0"),
    ("modules_to_save", ["lm_head("]),
    ("rank_pattern", {"*q_proj": 2}),
    ("alpha_pattern", {"o_proj(?P<": 3}),
    ("layers_pattern", "layers)"),
])
def test_an_invalid_pattern_is_refused_by_its_field(db, adapter, tmp_path, capsys, field, value):
    runner, path = db
    edited = _edited(adapter, tmp_path, **{field: value})
    code, _, err = run_main(["register", "--db", path, "--model-id", "x", "--uri", edited, "--base", "base"], capsys)
    _one_line(code, err)
    assert f"{field} " in err and "is not a valid regular expression" in err
    assert _models(runner, path) == ["base"]


@pytest.mark.parametrize("field, value", [
    ("target_modules", r"(?<=self_attn\.)(q|o)_proj"),  # a lookbehind
    ("rank_pattern", {r"(q)_\1": 2}),  # a backreference
    ("alpha_pattern", {"o_proj{,2}": 3}),  # {,n}: RE2 would read it as text
])
def test_a_pattern_re2_cannot_run_as_peft_does_is_refused_by_name(db, adapter, tmp_path, capsys, field, value):
    runner, path = db
    edited = _edited(adapter, tmp_path, **{field: value})
    code, _, err = run_main(["register", "--db", path, "--model-id", "x", "--uri", edited, "--base", "base"], capsys)
    _one_line(code, err)
    assert f"{field} " in err and "cannot be matched in linear time" in err
    assert _models(runner, path) == ["base"]


def test_a_stalling_pattern_is_decided_at_once(db, adapter, tmp_path):
    """``(.*.*)*X`` selects no module: the factors of q_proj are refused as ones peft would ignore, in a
    process of its own that must finish within TIME_LIMIT (Python's re did not finish in hours)."""
    runner, path = db
    edited = _edited(adapter, tmp_path, target_modules=STALLING)
    done = subprocess.run([sys.executable, "-m", "mergepipe", "register", "--db", str(path), "--model-id", "x",
                           "--uri", str(edited), "--base", "base"],
                          capture_output=True, text=True, timeout=TIME_LIMIT, check=False)
    _one_line(done.returncode, done.stderr)
    assert "does not select it" in done.stderr and repr(STALLING) in done.stderr
    assert _models(runner, path) == ["base"]


def test_lookaheads_that_open_target_modules_select_as_peft_does(db, adapter, tmp_path, capsys):
    """LLaMA-Factory's form of target_modules: each lookahead is tried at the start of the path."""
    runner, path = db
    leaves_out_o = _edited(adapter, tmp_path / "o", target_modules=r"^(?!.*o_proj).*(?:q_proj|v_proj).*")
    code, _, err = run_main(["register", "--db", path, "--model-id", "x", "--uri", leaves_out_o, "--base", "base"],
                            capsys)
    _one_line(code, err)
    assert "module 'model.layers.0.self_attn.o_proj' has LoRA factors" in err
    selects_both = _edited(adapter, tmp_path / "both", target_modules=r"^(?!.*vision_tower).*(?:q_proj|o_proj)")
    invoke(runner, ["register", "--db", path, "--model-id", "x", "--uri", selects_both, "--base", "base"])
    assert _models(runner, path) == ["base", "x"]


# ---- YAML configs ---------------------------------------------------------------------------------------------

DEEP = "[" * 10_000 + "]" * 10_000
DIGITS = "9" * 5000

#: case -> (mergekit config for `merge --config`, recipe for `integrate`), as bytes on disk
YAML_CASES = {
    "deep nesting": (f"merge_method: ties\nmodels: {DEEP}\n".encode(), f"base: base\nexperts: {DEEP}\n".encode()),
    "not UTF-8": (b"merge_method: ties\nmodels:\n  - model: caf\xe9\n", b"base: caf\xe9\n"),
    "5000 digits": (f"merge_method: ties\nparameters:\n  density: {DIGITS}\n".encode(), f"seed: {DIGITS}\n".encode()),
}
WORDS = {"deep nesting": "nested too deeply", "not UTF-8": "not UTF-8", "5000 digits": "5000 digits"}


@pytest.mark.parametrize("case", ["deep nesting", "not UTF-8", "5000 digits"])
def test_merge_config_refuses_hostile_yaml_in_one_line(tmp_path, capsys, case):
    config = tmp_path / "merge.yml"
    config.write_bytes(YAML_CASES[case][0])
    code, _, err = run_main(["merge", "--db", tmp_path / "c.db", "--config", config, "--out", tmp_path / "out",
                             "--model-id", "m", "--no-progress"], capsys)
    _one_line(code, err)
    assert str(config) in err and WORDS[case] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merge.yml"]


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_integrate_refuses_a_hostile_recipe_in_one_line(tmp_path, capsys, case):
    recipe = tmp_path / "recipe.yml"
    recipe.write_bytes(YAML_CASES[case][1])
    code, _, err = run_main(["integrate", "--db", tmp_path / "c.db", recipe, "--no-progress"], capsys)
    _one_line(code, err)
    assert code == 2 and str(recipe) in err and WORDS[case] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yml"]


# ---- remote checkpoints in a recipe ---------------------------------------------------------------------------


def _recipe(tmp_path: Path, base, experts: dict, root="deploy") -> Path:
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump({"base": str(base), "experts": {k: str(v) for k, v in experts.items()},
                                    "operator": "ties", "params": {"density": 0.5},
                                    "output": {"root": root, "model_id": "merged"}}))
    return path


def test_a_recipe_keeps_remote_checkpoints_remote(tmp_path):
    (tmp_path / "experts" / "code").mkdir(parents=True)  # a local folder wins over the Hub id of that spelling
    path = _recipe(tmp_path, "https://models.example/base?public=1",
                   {"math": "s3://bucket/experts/math", "code": "experts/code", "chat": "file:///srv/chat"})
    recipe = load_recipe(path)
    assert recipe.locations == {"base": RemotePath("https://models.example/base?public=1"),
                                "math": RemotePath("s3://bucket/experts/math"), "code": tmp_path / "experts" / "code",
                                "chat": Path("/srv/chat")}
    assert recipe.out_root == tmp_path / "deploy"


@pytest.mark.parametrize("base, experts, root, words", [
    ("base", {"math": "gs://bucket/math"}, "deploy", "experts.math: unsupported location 'gs://bucket/math'"),
    ("base", {"math": "math"}, "s3://bucket/deploy", "output.root s3://bucket/deploy is remote"),
])
def test_a_recipe_refuses_locations_it_cannot_use_in_one_line(tmp_path, capsys, base, experts, root, words):
    path = _recipe(tmp_path, base, experts, root)
    code, _, err = run_main(["integrate", "--db", tmp_path / "c.db", path, "--no-progress"], capsys)
    _one_line(code, err)
    assert words in err and str(path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yml"]


@pytest.mark.parametrize("uri", ["http://ana:s3cret@[::1/models/e1", "https://ana:s3cret@mo\u200bdels.example/e1",
                                 "https://models.example:8o8o/e1?sig=s3cret"])
def test_a_malformed_url_is_one_line_without_its_secrets(db, capsys, uri):
    runner, path = db
    code, _, err = run_main(["register", "--db", path, "--model-id", "e1", "--uri", uri], capsys)
    _one_line(code, err)
    assert "s3cret" not in err and ("not a valid URL" in err or "U+200B" in err)
    assert _models(runner, path) == ["base"]


def test_integrate_reads_a_remote_expert_where_it_is(tiny_family, tmp_path, monkeypatch):
    """An http:// expert is registered as that URI (not as a folder next to the recipe) and merged."""
    runner = wide_runner(monkeypatch)
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF_SECONDS", "0.01")
    with RangeServer(tiny_family["base"].parent) as server:
        path = _recipe(tmp_path, tiny_family["base"], {"e1": f"{server.url}/e1", "e2": tiny_family["e2"]})
        text = invoke(runner, ["integrate", "--db", tmp_path / "c.db", path, "--no-progress"])
        assert "published merged" in text
        models = {m["id"]: m for m in json.loads(invoke(runner, ["models", "--db", tmp_path / "c.db", "--json"]))}
    assert models["e1"]["uri"] == f"{server.url}/e1" and models["e2"]["uri"] == str(tiny_family["e2"])
    assert server.log.gets(".safetensors")
