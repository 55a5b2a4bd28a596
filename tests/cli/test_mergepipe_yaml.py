"""`mergepipe-yaml CONFIG OUT`: a mergekit user's command, run as they type it, against mergekit 0.1.5.

Every merge method MergePipe runs (``spec/mergekit.py`` METHODS) is given as a mergekit YAML
(``dtype: float32``, layer gradients, ``{filter, value}`` rules) to ``mergepipe-yaml`` and, with the
same command-line options, to mergekit-yaml's own command (its click command, in one interpreter for
all of them: one start-up). Each test runs in a fresh HOME, so the catalog is the per-user default
one, made for the test. Deterministic methods must agree element-wise to float32 rounding; TIES and
breadcrumbs may differ where mergekit's unstable sort keeps other entries tied at a trim threshold
(tests/spec/operators/test_mergekit_compat.py pins where), SCE where its ``topk`` keeps other entries
tied at the variance cut (one entry more or less moves SCE's expert weights, so such a tensor differs a
little almost everywhere: the test checks the selections there); DARE and DELLA draw other random masks,
so they are compared statistically.
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

from mergepipe.spec.mergekit import METHODS
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import mergepipe_yaml

pytestmark = pytest.mark.mergekit
pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed (pip install mergekit==0.1.5)")

#: Options both commands are given: mergekit-yaml's common ones, as a user passes them.
COMMON = ["--random-seed", "0", "--no-copy-tokenizer", "--lazy-unpickle", "--quiet"]
DETERMINISTIC = ("linear", "task_arithmetic", "slerp", "model_stock", "nearswap", "arcee_fusion", "ram",
                 "ramplus_tl", "nuslerp", "multislerp", "karcher")
TRIMMED = ("ties", "breadcrumbs", "breadcrumbs_ties")
#: Selections by the variance across the experts, whose ties at the cut mergekit breaks either way.
VARIANCE = ("sce",)
RANDOM = ("dare_linear", "dare_ties", "della", "della_linear")
#: Layers stacked by a copy map, byte for byte (tests/cli/test_frankenmerge.py tests them further).
COPIED = ("passthrough",)
#: Methods that scale every element by whole-tensor norms and dot products, which mergekit sums in float32: its
#: result is off by up to about 30 float32 steps of the tensor's largest element (MergePipe sums in float64; its
#: result is within one step of a float64 computation, tests/spec/operators/test_spherical.py).
NORM_SCALED = ("multislerp", "karcher")


def _configs(family: dict[str, Path]) -> dict[str, dict]:
    """One mergekit config per method, with gradients and filter rules where the method has parameters."""
    base, e1, e2, e3 = (str(family[k]) for k in ("base", "e1", "e2", "e3"))

    def based(method: str, models: list[dict], **parameters) -> dict:
        config = {"merge_method": method, "base_model": base, "dtype": "float32", "models": models}
        return {**config, "parameters": parameters} if parameters else config

    sparse = [{"model": e1, "parameters": {"weight": [1.0, 0.6], "density": [0.4, 0.8]}},
              {"model": e2, "parameters": {"weight": 0.5, "density": [{"filter": "mlp", "value": 0.3},
                                                                       {"value": 0.6}]}}]
    dropped = [{"model": e1, "parameters": {"weight": 1.0, "density": [0.4, 0.7], "epsilon": 0.1}},
               {"model": e2, "parameters": {"weight": [{"filter": "self_attn", "value": 0.3}, {"value": 0.6}],
                                            "density": 0.5, "epsilon": 0.1}}]
    return {
        # no base_model: the first model is averaged with its weight (tests/cli/test_mergekit_suite.py: gradients,
        # filter rules, normalize: false)
        "linear": {"merge_method": "linear", "dtype": "float32", "parameters": {"normalize": True},
                   "models": [{"model": base, "parameters": {"weight": 0.4}},
                              {"model": e1, "parameters": {"weight": 1.0}},
                              {"model": e2, "parameters": {"weight": 0.7}}]},
        "task_arithmetic": based("task_arithmetic", [
            {"model": e1, "parameters": {"weight": [0.2, 1.0, 0.6]}},
            {"model": e2, "parameters": {"weight": [{"filter": "embed", "value": 0.1}, {"value": 0.5}]}}],
            **{"lambda": 0.9}),
        "ties": based("ties", sparse, normalize=True),
        "breadcrumbs": based("breadcrumbs", [{**m, "parameters": {**m["parameters"], "gamma": 0.05}}
                                             for m in sparse]),
        "breadcrumbs_ties": based("breadcrumbs_ties", [{**m, "parameters": {**m["parameters"], "gamma": 0.05}}
                                                       for m in sparse], normalize=True),
        "dare_linear": based("dare_linear", [{**m, "parameters": {k: v for k, v in m["parameters"].items()
                                                                  if k != "epsilon"}} for m in dropped]),
        "dare_ties": based("dare_ties", [{**m, "parameters": {k: v for k, v in m["parameters"].items()
                                                                if k != "epsilon"}} for m in dropped]),
        "della": based("della", dropped, **{"lambda": 1.0}),
        "della_linear": based("della_linear", dropped),
        "slerp": based("slerp", [{"model": base}, {"model": e1}],
                       t=[{"filter": "self_attn", "value": [0.1, 0.7]}, {"value": [0.8, 0.3, 0.5]}]),
        "model_stock": based("model_stock", [{"model": e1}, {"model": e2}, {"model": e3}]),
        # no base_model: the models themselves, row-wise vectors; the first is MergePipe's base, with its weight
        "nuslerp": {"merge_method": "nuslerp", "dtype": "float32",
                    "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": True},
                    "models": [{"model": e1, "parameters": {"weight": [0.3, 0.8]}},
                               {"model": e2, "parameters": {"weight": [{"filter": "mlp", "value": 0.6},
                                                                       {"value": 0.4}]}}]},
        # the base listed too (skipped, as mergekit does): the task vectors of three models
        "multislerp": based("multislerp", [{"model": base}, {"model": e1, "parameters": {"weight": [0.2, 1.0]}},
                                           {"model": e2, "parameters": {"weight": 0.5}},
                                           {"model": e3, "parameters": {"weight": 0.7}}]),
        # the base not listed: mergekit averages it with the models all the same
        "karcher": based("karcher", [{"model": e1}, {"model": e2}], max_iter=20),
        # the base listed too (mergekit's two inputs), t a gradient across the layers
        "nearswap": based("nearswap", [{"model": base}, {"model": e2}], t=[0.005, 0.02, 0.05]),
        "arcee_fusion": based("arcee_fusion", [{"model": e1}]),
        # the base listed too (skipped, as mergekit does), select_topk a filter rule and a layer gradient
        "sce": based("sce", [{"model": base}, {"model": e1}, {"model": e2}],
                     select_topk=[{"filter": "mlp", "value": 0.5}, {"value": [1.0, 0.2]}]),
        "ram": based("ram", [{"model": e1}, {"model": e2}, {"model": e3}], epsilon=0.005),
        "ramplus_tl": based("ramplus_tl", [{"model": e1}, {"model": e2}, {"model": e3}], r=[0.2, 1.0], alpha=0.5,
                            epsilon=[{"filter": "self_attn", "value": 0.01}, {"value": 0.004}]),
        # a frankenmerge: both layers of the base, then e1's last layer again (3 layers)
        "passthrough": {"merge_method": "passthrough", "dtype": "float32",
                        "slices": [{"sources": [{"model": base, "layer_range": [0, 2]}]},
                                   {"sources": [{"model": e1, "layer_range": [1, 2]}]}]},
    }


#: mergekit-yaml's own command (click), run on each (config, out) with the same options, one after another.
RUNNER = """
import json, sys
from mergekit.scripts.run_yaml import main

options, jobs = json.loads(sys.argv[1])
for config, out in jobs:
    main.main(args=[config, out, *options], standalone_mode=False)
"""


@pytest.fixture(scope="module")
def mergekit_runs(tiny_family, tmp_path_factory):
    """(configs: method -> config file, method -> mergekit's output tensors)."""
    root = tmp_path_factory.mktemp("mergepipe-yaml")
    configs, jobs = {}, []
    for name, config in _configs(tiny_family).items():
        configs[name] = root / f"{name}.yml"
        configs[name].write_text(yaml.safe_dump(config, sort_keys=False))
        jobs.append((str(configs[name]), str(root / f"mergekit-{name}")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([COMMON, jobs])], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mergekit failed:\n{proc.stderr[-3000:]}"
    return configs, {name: load_tensors(Path(out)) for name, (_, out) in zip(configs, jobs)}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh HOME: the default catalog is ``HOME/.local/share/mergepipe/catalog.db``, made by the test."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("MERGEPIPE_DB", raising=False)
    return tmp_path / "home"




def default_catalog(home: Path) -> Path:
    return home / ".local" / "share" / "mergepipe" / "catalog.db"


def within_rounding(mine: torch.Tensor, theirs: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Elements equal up to float32 rounding: 16 ulps of the largest input or result magnitude (the two
    order their fp32 operations differently; slerp's trigonometry is the furthest apart)."""
    scale = torch.stack([t.float().abs() for t in (*inputs, mine, theirs)]).amax(dim=0)
    return (mine.float() - theirs.float()).abs() <= scale * 2.0**-19


def test_every_supported_method_is_in_the_suite(tiny_family):
    assert set(_configs(tiny_family)) == set(METHODS) == {*DETERMINISTIC, *TRIMMED, *VARIANCE, *RANDOM, *COPIED}


@pytest.mark.parametrize("name", COPIED)
def test_copied_layers_equal_mergekit_byte_for_byte(mergekit_runs, home, tmp_path, capsys, name):
    configs, theirs_all = mergekit_runs
    out = tmp_path / name
    code, _, err = mergepipe_yaml([configs[name], out, *COMMON], capsys)
    assert code == 0, err
    mine, theirs = load_tensors(out), theirs_all[name]
    assert set(mine) == set(theirs) and "model.layers.2.mlp.up_proj.weight" in mine
    for t, value in theirs.items():
        assert mine[t].dtype == value.dtype == torch.float32 and torch.equal(mine[t], value), t
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_methods_equal_mergekit_element_wise(mergekit_runs, tiny_family, home, tmp_path, capsys,
                                                           name):
    configs, theirs_all = mergekit_runs
    out = tmp_path / name
    code, _, err = mergepipe_yaml([configs[name], out, *COMMON], capsys)
    assert code == 0, err
    assert f"catalog: {default_catalog(home)} (the default; --db or MERGEPIPE_DB to choose)" in err.splitlines()
    assert "note: --lazy-unpickle ignored: MergePipe reads safetensors only" in err
    mine, theirs = load_tensors(out), theirs_all[name]
    assert set(mine) == set(theirs)
    inputs = {k: load_tensors(tiny_family[k]) for k in ("base", "e1", "e2", "e3")}
    for t in mine:
        assert mine[t].dtype == theirs[t].dtype == torch.float32, t
        close = within_rounding(mine[t], theirs[t], [inputs[k][t] for k in inputs])
        if name in NORM_SCALED:
            close |= (mine[t] - theirs[t]).abs() <= theirs[t].abs().max() * 2.0**-17
        assert bool(close.all()), f"{name} {t}: {int((~close).sum())} of {close.numel()} differ beyond rounding"
    assert not (out / "tokenizer_config.json").exists()  # --no-copy-tokenizer, as mergekit
    assert json.loads((out / "manifest.json").read_text())["model_id"] == name  # the folder's name


@pytest.mark.parametrize("name", TRIMMED)
def test_trimming_methods_equal_mergekit_but_at_tied_thresholds(mergekit_runs, tiny_family, home, tmp_path,
                                                                capsys, name):
    configs, theirs_all = mergekit_runs
    out = tmp_path / name
    code, _, err = mergepipe_yaml([configs[name], out, *COMMON], capsys)
    assert code == 0, err
    mine, theirs = load_tensors(out), theirs_all[name]
    inputs = {k: load_tensors(tiny_family[k]) for k in ("base", "e1", "e2")}
    total = off = 0
    for t in mine:
        close = within_rounding(mine[t], theirs[t], [inputs[k][t] for k in inputs])
        total, off = total + close.numel(), off + int((~close).sum())
    assert off / total < 0.005, f"{name}: {off} of {total} elements differ beyond rounding"


@pytest.mark.parametrize("name", VARIANCE)
def test_variance_selections_equal_mergekit_but_where_a_tie_at_the_cut_went_the_other_way(
        mergekit_runs, tiny_family, home, tmp_path, capsys, name):
    """Every tensor equals mergekit's to rounding, or mergekit's selection (its own ``sce_mask``) differs
    from ours only at entries whose variance is the cut's; fractions are printed (``pytest -s``)."""
    from mergekit.merge_methods.sce import sce_mask

    from mergepipe.spec.operators.sce import variance_keep
    from mergepipe.spec.operators import MergeSpec
    from mergepipe.spec.operators import get_operator
    from mergepipe.spec.settings import count_layers
    from tests.spec.operators.reference import sce_variance

    configs, theirs_all = mergekit_runs
    out = tmp_path / name
    code, _, err = mergepipe_yaml([configs[name], out, *COMMON], capsys)
    assert code == 0, err
    mine, theirs = load_tensors(out), theirs_all[name]
    inputs = {k: load_tensors(tiny_family[k]) for k in ("base", "e1", "e2")}
    spec = MergeSpec(name, (("e1", {}), ("e2", {})), _configs(tiny_family)[name]["parameters"])
    layers = count_layers(list(mine))
    elements = off = tied = selected = flipped = 0
    for t in mine:
        close = within_rounding(mine[t], theirs[t], [inputs[k][t] for k in inputs])
        elements += close.numel()
        if bool(close.all()):
            continue
        off, tied = off + int((~close).sum()), tied + 1
        base = inputs["base"][t].float()
        deltas = [inputs[e][t].float() - base for e in ("e1", "e2")]
        fraction = get_operator(name).resolve(spec, t, layers).global_.select_topk
        my_keep, their_keep = variance_keep(deltas, fraction), sce_mask(torch.stack(deltas), fraction) != 0
        variance = sce_variance(deltas)
        assert bool((variance[my_keep != their_keep] == variance[my_keep].min()).all()), f"{t}: not a tie"
        selected, flipped = selected + int(my_keep.sum()), flipped + int((my_keep != their_keep).sum()) // 2
    print(f"\n[mergekit-yaml] {name}: {tied} of {len(mine)} tensors had a tie at the variance cut go the other "
          f"way ({flipped} of their {selected} selected entries); {off} of {elements} elements differ beyond rounding")


def _changes(merged: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(fraction of elements changed from the base, L1 norm of the change)."""
    changed = total = 0
    l1 = 0.0
    for t, value in merged.items():
        d = value.float() - base[t].float()
        changed, total, l1 = changed + int((d != 0).sum()), total + d.numel(), l1 + float(d.abs().double().sum())
    return changed / total, l1


@pytest.mark.parametrize("name", RANDOM)
def test_random_methods_match_mergekit_statistically(mergekit_runs, tiny_family, home, tmp_path, capsys, name):
    configs, theirs_all = mergekit_runs
    out = tmp_path / name
    code, _, err = mergepipe_yaml([configs[name], out, *COMMON], capsys)
    assert code == 0, err
    base = load_tensors(tiny_family["base"])
    (mine_changed, mine_l1), (theirs_changed, theirs_l1) = (_changes(load_tensors(out), base),
                                                            _changes(theirs_all[name], base))
    assert abs(mine_changed - theirs_changed) < 0.01
    assert abs(mine_l1 / theirs_l1 - 1) < 0.02
    assert json.loads((out / "manifest.json").read_text())["seed"] == 0  # --random-seed is the merge's seed
