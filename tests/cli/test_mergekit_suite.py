"""mergekit-style configurations for what mergekit's own merge tests exercise, run through `mergekit-yaml`
(``dtype: float32``) and `mergepipe merge --config`, compared element-wise.

The suite covers ``linear`` without a ``base_model`` (its first model averaged with its own weight: a
number, a gradient, filter rules, the global weight), with ``normalize: false``, with the base listed
among the models or not, ``slices:`` over every layer, ``int8_mask``, ``rescale`` on DARE and DELLA
(random: each output is checked against the formula on its own mask, and the two keep about as much),
LLaVA-style checkpoints (a language model inside a multimodal one), and mergekit's list of methods
(every one MergePipe lacks is "not supported yet", never unknown). A config with an invalid parameter is
refused in one line before anything is read or registered.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mergepipe.catalog import Catalog
from mergepipe.spec.mergekit import METHODS, OTHER_METHODS
from mergepipe.storage.source import ReadCounter
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import run_main

pytestmark = pytest.mark.mergekit
pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed (pip install mergekit==0.1.5)")

#: mergekit-yaml's options, as a user passes them.
OPTIONS = ["--random-seed", "0", "--no-copy-tokenizer", "--quiet"]
#: mergekit-yaml's own command (click), run on each (config, out) one after another: one start-up.
RUNNER = """
import json, sys
from mergekit.scripts.run_yaml import main

options, jobs = json.loads(sys.argv[1])
for config, out in jobs:
    main.main(args=[config, out, *options], standalone_mode=False)
"""


def _deterministic(family: dict[str, Path]) -> dict[str, dict]:
    """Configs whose outputs must agree element-wise to float32 rounding."""
    base, e1, e2 = (str(family[k]) for k in ("base", "e1", "e2"))
    f32 = {"dtype": "float32"}
    return {
        # no base_model: the first model is averaged with its weight
        "linear_first_numbers": {"merge_method": "linear", **f32, "models": [
            {"model": base, "parameters": {"weight": 0.4}}, {"model": e1, "parameters": {"weight": 1.0}},
            {"model": e2, "parameters": {"weight": 0.7}}]},
        "linear_first_gradient": {"merge_method": "linear", **f32, "models": [
            {"model": base, "parameters": {"weight": [0.2, 0.9]}},
            {"model": e1, "parameters": {"weight": [1.0, 0.3, 0.6]}}, {"model": e2, "parameters": {"weight": 0.5}}]},
        # the first model's rules match only some tensors: the global weight is its weight elsewhere
        "linear_first_filters": {"merge_method": "linear", **f32, "parameters": {"weight": 0.8}, "models": [
            {"model": base, "parameters": {"weight": [{"filter": "mlp", "value": 0.1},
                                                      {"filter": "self_attn", "value": [0.5, 1.5]}]}},
            {"model": e1, "parameters": {"weight": [{"filter": "embed", "value": 0.3}, {"value": 1.0}]}},
            {"model": e2}]},
        "linear_first_unnormalized": {"merge_method": "linear", **f32, "parameters": {"normalize": False}, "models": [
            {"model": base, "parameters": {"weight": 0.6}}, {"model": e1, "parameters": {"weight": 0.7}},
            {"model": e2, "parameters": {"weight": [0.1, 0.4]}}]},
        "linear_first_unnormalized_filters": {"merge_method": "linear", **f32, "parameters": {"normalize": False},
                                              "models": [
            {"model": base, "parameters": {"weight": [{"filter": "mlp", "value": [0.1, 0.5]}, {"value": 0.3}]}},
            {"model": e1, "parameters": {"weight": 0.5}}, {"model": e2, "parameters": {"weight": 0.2}}]},
        # the base listed among the models is one of them
        "linear_listed_base": {"merge_method": "linear", "base_model": base, **f32, "models": [
            {"model": e1, "parameters": {"weight": 1.0}},
            {"model": base, "parameters": {"weight": [0.5, 0.1]}},
            {"model": e2, "parameters": {"weight": [{"filter": "mlp", "value": 0.2}, {"value": 0.6}]}}]},
        # a base_model not listed: mergekit adds it to the models, with the global weight
        "linear_unlisted_base_unnormalized": {"merge_method": "linear", "base_model": base, **f32,
                                              "parameters": {"normalize": False, "weight": [0.3, 0.1]}, "models": [
            {"model": e1, "parameters": {"weight": [0.4, 0.8]}}, {"model": e2, "parameters": {"weight": 0.6}}]},
        "linear_unlisted_base": {"merge_method": "linear", "base_model": base, **f32,
                                 "parameters": {"weight": [{"filter": "mlp", "value": 0.5}, {"value": 0.2}]},
                                 "models": [{"model": e1}, {"model": e2, "parameters": {"weight": 1.5}}]},
        "linear_slices_first": {"merge_method": "linear", **f32, "slices": [{"sources": [
            {"model": base, "layer_range": [0, 2], "parameters": {"weight": [0.3, 0.6]}},
            {"model": e1, "layer_range": [0, 2], "parameters": {"weight": 1.0}}]}]},
        "task_arithmetic_listed_base": {"merge_method": "task_arithmetic", "base_model": base, **f32,
                                        "parameters": {"lambda": 0.9, "int8_mask": True}, "models": [
            {"model": base}, {"model": e1, "parameters": {"weight": [0.2, 1.0]}},
            {"model": e2, "parameters": {"weight": [{"filter": "embed", "value": 0.1}, {"value": 0.5}]}}]},
        # density 1: no trim, so no tie at a threshold; sign election and the disjoint mean
        "ties_int8_mask": {"merge_method": "ties", "base_model": base, **f32,
                           "parameters": {"int8_mask": True, "normalize": True, "lambda": 0.8}, "models": [
            {"model": base}, {"model": e1, "parameters": {"weight": [1.0, 0.5]}},
            {"model": e2, "parameters": {"weight": 0.7}}]},
    }


def _trimmed(family: dict[str, Path]) -> dict[str, dict]:
    """TIES with a trim: equal but where mergekit's unstable sort keeps another entry tied at a threshold."""
    base, e1, e2 = (str(family[k]) for k in ("base", "e1", "e2"))
    return {"ties_int8_mask_trimmed": {"merge_method": "ties", "base_model": base, "dtype": "float32",
                                       "parameters": {"int8_mask": True, "normalize": False}, "models": [
        {"model": e1, "parameters": {"weight": 1.0, "density": [0.3, 0.7]}},
        {"model": e2, "parameters": {"weight": 0.5, "density": 0.5}}]}}


#: Random-drop configs: (method, weight of the one expert, whether survivors are rescaled to the L1 norm,
#: density).
RANDOM = {"dare_linear_rescaled": ("dare_linear", 0.8, True, 0.5),
          "dare_linear_plain": ("dare_linear", 0.8, False, 0.4),
          "della_linear_rescaled": ("della_linear", 1.0, True, 0.5)}


def _random(family: dict[str, Path]) -> dict[str, dict]:
    out = {}
    for name, (method, weight, rescale, density) in RANDOM.items():
        params = {"weight": weight, "density": density, **({"epsilon": 0.1} if method.startswith("della") else {})}
        out[name] = {"merge_method": method, "base_model": str(family["base"]), "dtype": "float32",
                     "parameters": {"rescale": rescale}, "models": [{"model": str(family["e1"]), "parameters": params}]}
    return out


# ---------------------------------------------------------------------- LLaVA-style checkpoints


def make_llava(out: Path, seed: int) -> Path:
    """A tiny LLaVA (a 2-layer Llama inside, a 2-layer CLIP vision tower, the projector), saved by
    transformers as LLaVA checkpoints are: ``language_model.model.*``, ``vision_tower.*``,
    ``multi_modal_projector.*`` (64 tensors, 21 of them the language model's)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4, projection_dim=16)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=63, vision_feature_layer=-1)
    LlavaForConditionalGeneration(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {"a": make_llava(root / "a", 0), "b": make_llava(root / "b", 1)}


def _llava_config(llava: dict[str, Path]) -> dict:
    return {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(llava["a"]), "parameters": {"weight": 0.3}},
        {"model": str(llava["b"]), "parameters": {"weight": 0.7}}]}


# ---------------------------------------------------------------------- running both


@pytest.fixture(scope="module")
def suite(tiny_family, llava, tmp_path_factory) -> tuple[dict[str, Path], dict[str, dict[str, torch.Tensor]]]:
    """(name -> config file, name -> mergekit's output tensors), every config run by one mergekit-yaml process."""
    root = tmp_path_factory.mktemp("mergekit-suite")
    configs = {**_deterministic(tiny_family), **_trimmed(tiny_family), **_random(tiny_family),
               "llava_linear": _llava_config(llava)}
    files, jobs = {}, []
    for name, config in configs.items():
        files[name] = root / f"{name}.yml"
        files[name].write_text(yaml.safe_dump(config, sort_keys=False))
        jobs.append((str(files[name]), str(root / f"mergekit-{name}")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([OPTIONS, jobs])], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"mergekit failed:\n{proc.stderr[-3000:]}"
    return files, {name: load_tensors(Path(out)) for name, (_, out) in zip(files, jobs)}


def mergepipe_merge(config: Path, out: Path, db: Path, capsys) -> tuple[int | None, str, str]:
    """`mergepipe merge --config CONFIG --out OUT`, as a user types it."""
    return run_main(["merge", "--db", db, "--config", config, "--out", out, "--no-progress"], capsys)


def within_rounding(mine: torch.Tensor, theirs: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Elements equal up to float32 rounding: 16 ulps of the largest input or result magnitude (the two
    order their fp32 operations differently)."""
    scale = torch.stack([t.float().abs() for t in (*inputs, mine, theirs)]).amax(dim=0)
    return (mine.float() - theirs.float()).abs() <= scale * 2.0**-19


def _family_tensors(family: dict[str, Path]) -> list[dict[str, torch.Tensor]]:
    return [load_tensors(family[k]) for k in ("base", "e1", "e2")]


@pytest.mark.parametrize("name", list(_deterministic({k: Path(k) for k in ("base", "e1", "e2")})))
def test_deterministic_configs_equal_mergekit_element_wise(suite, tiny_family, tmp_path, capsys, name):
    files, theirs_all = suite
    code, _, err = mergepipe_merge(files[name], tmp_path / "out", tmp_path / "c.db", capsys)
    assert code == 0, err
    mine, theirs = load_tensors(tmp_path / "out"), theirs_all[name]
    assert set(mine) == set(theirs)
    inputs = _family_tensors(tiny_family)
    for t in mine:
        assert mine[t].dtype == theirs[t].dtype == torch.float32, t
        close = within_rounding(mine[t], theirs[t], [i[t] for i in inputs])
        assert bool(close.all()), f"{name} {t}: {int((~close).sum())} of {close.numel()} differ beyond rounding"
    if name.startswith("linear_first"):  # the first model is averaged, never called a base
        assert "the first model '" in err and "base '" not in err


def test_trimmed_ties_with_int8_mask_equals_mergekit_but_at_tied_thresholds(suite, tiny_family, tmp_path, capsys):
    files, theirs_all = suite
    code, _, err = mergepipe_merge(files["ties_int8_mask_trimmed"], tmp_path / "out", tmp_path / "c.db", capsys)
    assert code == 0, err
    assert "int8_mask ignored" in err
    mine, theirs = load_tensors(tmp_path / "out"), theirs_all["ties_int8_mask_trimmed"]
    inputs = _family_tensors(tiny_family)
    total = off = 0
    for t in mine:
        close = within_rounding(mine[t], theirs[t], [i[t] for i in inputs])
        total, off = total + close.numel(), off + int((~close).sum())
    assert off / total < 0.005, f"{off} of {total} elements differ beyond rounding"


def _drop_form(out: dict[str, torch.Tensor], base: dict[str, torch.Tensor], expert: dict[str, torch.Tensor],
               weight: float, rescaled: bool) -> float:
    """Check every element of a one-expert random-drop output against ``B + w c m Δ`` on its own mask m
    (an element kept or not), c = 1 without rescale, else one factor per tensor that brings the kept
    entries' L1 norm back to Δ's; returns the fraction of changed entries kept."""
    kept = changed = 0
    for t, value in out.items():
        b, delta = base[t].float(), expert[t].float() - base[t].float()
        moved = value.float() - b
        mask = moved != 0
        l1 = float(delta.abs().double().sum())
        factor = l1 / float((delta * mask).abs().double().sum()) if rescaled and bool(mask.any()) else 1.0
        expected = b + weight * factor * delta * mask
        scale = torch.stack([b.abs(), value.float().abs()]).amax(dim=0)
        assert bool(((value.float() - expected).abs() <= scale * 2.0**-19 + 1e-12).all()), t
        if rescaled and l1 > 0:  # the kept entries carry all of Δ's L1 norm
            assert abs(float(moved.abs().double().sum()) / (weight * l1) - 1) < 1e-4, t
        kept, changed = kept + int((mask & (delta != 0)).sum()), changed + int((delta != 0).sum())
    return kept / changed


@pytest.mark.parametrize("name", list(RANDOM))
def test_rescale_on_random_drops_is_mergekit_s_element_by_element(suite, tiny_family, tmp_path, capsys, name):
    files, theirs_all = suite
    code, _, err = mergepipe_merge(files[name], tmp_path / "out", tmp_path / "c.db", capsys)
    assert code == 0, err
    _, weight, rescaled, density = RANDOM[name]
    base, e1, _ = _family_tensors(tiny_family)
    mine = _drop_form(load_tensors(tmp_path / "out"), base, e1, weight, rescaled)
    theirs = _drop_form(theirs_all[name], base, e1, weight, rescaled)
    assert abs(mine - density) < 0.02 and abs(theirs - density) < 0.02
    written = yaml.safe_load((tmp_path / "out" / "mergepipe_config.yml").read_text())
    assert written["parameters"]["rescale"] is rescaled  # mergekit's spelling: true is l1


def as_on_disk(name: str) -> str:
    """A LLaVA tensor's name as transformers names it in memory (``model.vision_tower.…``,
    ``model.language_model.…``, what mergekit writes) turned into the name the checkpoint files hold."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    return name.removeprefix("model.")


def test_llava_checkpoints_keep_every_tensor_where_mergekit_drops_the_language_model(suite, llava, tmp_path,
                                                                                       capsys):
    """docs/MERGEKIT.md: MergePipe merges all 64 tensors of a LLaVA-style checkpoint under the names its files
    hold; mergekit 0.1.5 with current transformers writes 43, renamed as transformers names them in memory
    (``model.vision_tower.…``), without the 21 ``language_model.*`` tensors. What both write is equal."""
    files, theirs_all = suite
    code, _, err = mergepipe_merge(files["llava_linear"], tmp_path / "out", tmp_path / "c.db", capsys)
    assert code == 0, err
    mine, theirs = load_tensors(tmp_path / "out"), {as_on_disk(t): v for t, v in theirs_all["llava_linear"].items()}
    a, b = load_tensors(llava["a"]), load_tensors(llava["b"])
    language = {t for t in a if t.startswith("language_model.")}
    assert set(mine) == set(a) and (len(a), len(language)) == (64, 21)
    assert set(theirs) <= set(mine) and set(mine) - set(theirs) <= language
    print(f"\nLLaVA-style: MergePipe wrote {len(mine)} tensors, mergekit {len(theirs)} "
          f"({len(language - set(theirs))} language-model tensors dropped)")
    for t, value in mine.items():
        expected = 0.3 * a[t].float() + 0.7 * b[t].float()
        assert bool(within_rounding(value, expected, [a[t], b[t]]).all()), t
        if t in theirs:
            assert bool(within_rounding(value, theirs[t], [a[t], b[t]]).all()), t


def test_a_linear_merge_without_a_base_reruns_from_its_written_config(tiny_family, tmp_path, capsys):
    """mergepipe_config.yml lists the first model among the averaged ones with its weight, as mergekit
    says it, and reruns to the same snapshot."""
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump(_deterministic(tiny_family)["linear_first_filters"]))
    db, out = tmp_path / "c.db", tmp_path / "out"
    code, _, err = mergepipe_merge(config, out, db, capsys)
    assert code == 0, err
    written = yaml.safe_load((out / "mergepipe_config.yml").read_text())
    first = written["models"][0]
    assert written["merge_method"] == "linear" and first["model"] == written["base_model"]
    assert first["parameters"]["weight"] == [{"filter": "mlp", "value": 0.1},
                                             {"filter": "self_attn", "value": [0.5, 1.5]}, {"value": 0.8}]
    code, text, err = mergepipe_merge(out / "mergepipe_config.yml", tmp_path / "again", db, capsys)
    assert code == 0, err
    snapshot = json.loads((out / "manifest.json").read_text())["snapshot_id"]
    assert f"re-materialised snapshot {snapshot}" in text + err


def test_mergepipe_s_own_linear_writes_its_base_out_of_the_average_and_reruns(tiny_family, tmp_path, capsys):
    """MergePipe's linear of the experts alone (the base their deltas' origin): mergekit would add the base to
    the averaged models, so the written config says base_weight: 0, and reruns to the same snapshot."""
    db, out = tmp_path / "c.db", tmp_path / "out"
    code, _, err = run_main(["merge", "--db", db, "--base", tiny_family["base"], "--experts", tiny_family["e1"],
                             tiny_family["e2"], "--operator", "linear", "--weights", "1", "3", "--out", out,
                             "--no-progress"], capsys)
    assert code == 0, err
    written = yaml.safe_load((out / "mergepipe_config.yml").read_text())
    assert written["parameters"]["base_weight"] == 0 and len(written["models"]) == 2
    code, text, err = mergepipe_merge(out / "mergepipe_config.yml", tmp_path / "again", db, capsys)
    assert code == 0, err
    snapshot = json.loads((out / "manifest.json").read_text())["snapshot_id"]
    assert f"re-materialised snapshot {snapshot}" in text + err


# ---------------------------------------------------------------------- mergekit's methods


def test_the_method_lists_are_mergekit_s_registry():
    from mergekit.merge_methods import registry

    names = {method.spec.name for method in registry.registered_methods()}
    assert set(METHODS) | set(OTHER_METHODS) == names
    assert not set(METHODS) & set(OTHER_METHODS)


@pytest.mark.parametrize("method", [*OTHER_METHODS, "next_method", "sparkle"])
def test_a_method_mergepipe_lacks_is_not_supported_yet_never_unknown(tiny_family, tmp_path, capsys, monkeypatch,
                                                                     method):
    """Every mergekit method MergePipe lacks (``OTHER_METHODS``, empty once it runs them all; a stand-in for the
    next one mergekit adds) is "not supported yet"; a name neither has is unknown."""
    if method == "next_method":
        monkeypatch.setattr("mergepipe.spec.mergekit.OTHER_METHODS", (*OTHER_METHODS, method))
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump({"merge_method": method, "base_model": str(tiny_family["base"]),
                                      "models": [{"model": str(tiny_family["e1"])}]}))
    code, out, err = mergepipe_merge(config, tmp_path / "out", tmp_path / "c.db", capsys)
    assert code != 0 and out == "" and len(err.splitlines()) == 1
    if method != "sparkle":
        assert f"merge_method '{method}' (mergekit's) is not supported yet" in err and "unknown" not in err
    else:
        assert "unknown merge_method 'sparkle': neither mergekit 0.1.5 nor MergePipe has it" in err
    assert not (tmp_path / "c.db").exists()


# ---------------------------------------------------------------------- refused before any I/O


@pytest.fixture
def no_checkpoint_io(tiny_family, monkeypatch) -> list[str]:
    """The checkpoint files opened (any open under the family's folder) and the bytes the storage layer's
    read counters counted, recorded for the test to assert on."""
    root = str(Path(tiny_family["base"]).parent.resolve())
    seen: list[str] = []

    def watch(opener):
        def opened(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(root):
                seen.append(os.fspath(path))
            return opener(path, *args, **kwargs)
        return opened

    add = ReadCounter.add

    def counted(self, nbytes, tag):
        seen.append(f"{nbytes} bytes read ({tag})")
        add(self, nbytes, tag)

    monkeypatch.setattr(os, "open", watch(os.open))
    monkeypatch.setattr(io, "open", watch(io.open))
    monkeypatch.setattr(builtins, "open", watch(builtins.open))
    monkeypatch.setattr(ReadCounter, "add", counted)
    return seen


def _invalid(family: dict[str, Path]) -> dict[str, tuple[dict, str]]:
    """Configs with one invalid parameter each, and what the one line says."""
    base, e1, e2 = (str(family[k]) for k in ("base", "e1", "e2"))

    def della(epsilon) -> dict:
        return {"merge_method": "della", "base_model": base, "models": [
            {"model": e1, "parameters": {"weight": 1.0, "density": 0.2, "epsilon": epsilon}},
            {"model": e2, "parameters": {"weight": 1.0, "density": 0.5}}]}

    return {
        "della_epsilon_gradient": (della([0.1, 0.3]), "density 0.2 +- epsilon 0.3 must stay inside (0, 1) for the "
                                                      "last layer"),
        "della_epsilon": (della(0.25), "density 0.2 +- epsilon 0.25 must stay inside (0, 1) for every tensor"),
        "density_range": ({"merge_method": "ties", "base_model": base, "models": [
            {"model": e1, "parameters": {"weight": 1.0, "density": [0.5, 1.5]}}]}, "density must be in (0, 1]"),
        "unknown_parameter": ({"merge_method": "task_arithmetic", "base_model": base, "models": [
            {"model": e1, "parameters": {"weight": 1.0, "densty": 0.5}}]}, "does not take parameter 'densty'"),
        "linear_first_model": ({"merge_method": "linear", "models": [
            {"model": base, "parameters": {"weight": 1.0, "gamma": 0.1}}, {"model": e1}]},
            "linear does not take parameter 'gamma' (the first model"),
    }


@pytest.mark.parametrize("existing", [False, True], ids=["no-catalog", "empty-catalog"])
@pytest.mark.parametrize("case", list(_invalid({k: Path(k) for k in ("base", "e1", "e2")})))
def test_an_invalid_parameter_is_refused_in_one_line_before_any_read_or_registration(
        tiny_family, tmp_path, capsys, no_checkpoint_io, case, existing):
    config, message = _invalid(tiny_family)[case]
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump(config))
    db = tmp_path / "c.db"
    if existing:
        Catalog.create(db).close()
    code, out, err = mergepipe_merge(path, tmp_path / "out", db, capsys)
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert no_checkpoint_io == []  # no checkpoint file opened, no byte counted
    if existing:
        with Catalog.open(db) as catalog:
            assert catalog.models.list() == []
    else:
        assert not db.exists()
    assert not (tmp_path / "out").exists()


def test_a_rule_that_needs_the_tensor_names_is_refused_before_any_expert_is_registered(
        tiny_family, tmp_path, capsys, no_checkpoint_io):
    """epsilon 0.3 on the ``mlp`` tensors only: the base's tensor names decide it, so its headers are read
    (and it is registered, then taken back), and no expert's file is opened."""
    base, e1, e2 = (str(tiny_family[k]) for k in ("base", "e1", "e2"))
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump({"merge_method": "della", "base_model": base, "models": [
        {"model": e1, "parameters": {"density": 0.2, "epsilon": [{"filter": "mlp", "value": 0.3}, {"value": 0.1}]}},
        {"model": e2, "parameters": {"density": 0.5}}]}))
    db = tmp_path / "c.db"
    code, _, err = mergepipe_merge(path, tmp_path / "out", db, capsys)
    assert code != 0
    error = err.splitlines()[-1]  # after the model id's note: one line, its traceback none
    assert error.startswith("error: ") and "Traceback" not in err, err
    assert "epsilon 0.3 must stay inside (0, 1) for model.layers.0.mlp." in error
    opened = [p for p in no_checkpoint_io if not p.endswith(")")]
    assert opened and all(str(Path(p).resolve()).startswith(str(Path(base).resolve())) for p in opened)
    with Catalog.open(db) as catalog:
        assert catalog.models.list() == []
