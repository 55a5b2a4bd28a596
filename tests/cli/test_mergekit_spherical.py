"""nuslerp, multislerp and karcher through `mergepipe merge --config`, against mergekit 0.1.5 on the same files.

Every setting of these methods: nuslerp with and without a ``base_model`` (the
base apart or listed among the models), ``nuslerp_flatten`` and ``nuslerp_row_wise`` both ways, weights as
layer gradients and filter rules; multislerp with and without a base, ``normalize_weights: false``, ``eps``;
karcher with and without a base, ``max_iter``, ``tol`` and the weights it ignores. Each config computes in
float32 (``dtype: float32``) on the tiny bf16 models and is run by mergekit-yaml's library calls and by
MergePipe's CLI (one catalog for all of them, as a user who merges again); the two agree element-wise to
float32 rounding (``within_rounding``; multislerp and karcher within mergekit's float32 whole-tensor sums,
``NORM_SCALED``). ``pytest -s`` prints the share of elements that differ at all. The ``mergepipe_config.yml``
a merge writes states it as mergekit does (no ``base_model`` where the models themselves are interpolated) and
runs to the same tensors in both. A partial budget plans whole tensors and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mergepipe.catalog import Catalog
from tests.cli.test_mergekit_outputs import with_paths
from tests.cli.test_mergepipe_yaml import NORM_SCALED, within_rounding
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.mergekit import run_mergekit

pytestmark = pytest.mark.mergekit
pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed (pip install mergekit==0.1.5)")

#: A weight as a layer gradient and one as filter rules (mergekit's two forms of a varying setting).
GRADIENT = [0.2, 0.9]
RULES = [{"filter": "self_attn", "value": 0.3}, {"filter": "mlp", "value": [0.8, 0.4]}, {"value": 0.6}]


def _configs(family) -> dict[str, dict]:
    base, e1, e2, e3 = (str(family[k]) for k in ("base", "e1", "e2", "e3"))

    def config(method: str, models: list[tuple[str, object]], base_model: str | None = None, **parameters) -> dict:
        out: dict = {"merge_method": method}
        if base_model is not None:
            out["base_model"] = base_model
        out["models"] = [{"model": m, **({"parameters": {"weight": w}} if w is not None else {})} for m, w in models]
        return {**out, **({"parameters": parameters} if parameters else {}), "dtype": "float32"}

    pair = [(e1, GRADIENT), (e2, RULES)]
    configs = {}
    for flatten in (True, False):
        for row_wise in (False, True):
            mode = f"{'flat' if flatten else 'vectors'}{'-row_wise' if row_wise else ''}"
            knobs = {"nuslerp_flatten": flatten, "nuslerp_row_wise": row_wise}
            configs[f"nuslerp-base-{mode}"] = config("nuslerp", pair, base, **knobs)
            configs[f"nuslerp-models-{mode}"] = config("nuslerp", pair, **knobs)
    configs["nuslerp-base-listed"] = config("nuslerp", [(base, None), *pair], base, nuslerp_flatten=False)
    configs["nuslerp-models-global-weight"] = config("nuslerp", [(e3, None), (e1, 0.7)], weight=0.2)
    configs["multislerp-base"] = config("multislerp", [(e1, GRADIENT), (e2, RULES), (e3, 0.5)], base)
    configs["multislerp-models"] = config("multislerp", [(base, 0.4), (e1, GRADIENT), (e2, RULES)])
    configs["multislerp-unnormalized"] = config("multislerp", [(e1, 0.3), (e2, 0.2), (e3, 0.6)],
                                                normalize_weights=False, eps=1e-6)
    configs["karcher-base"] = config("karcher", [(e1, None), (e2, None)], base)
    configs["karcher-listed"] = config("karcher", [(base, 0.2), (e1, 0.5), (e3, None)], base, max_iter=3)
    configs["karcher-models"] = config("karcher", [(e1, None), (e2, None), (e3, None)], max_iter=50, tol=1e-7)
    return configs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


#: Merges whose written ``mergepipe_config.yml`` (ids replaced by paths) mergekit runs too, and MergePipe again.
WRITTEN = ("nuslerp-models-vectors", "multislerp-models", "karcher-models")
NAMES = sorted([*_configs({k: k for k in ("base", "e1", "e2", "e3")}), *(f"written-{n}" for n in WRITTEN)])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The configs, the catalog and every output (``NAME/`` MergePipe's, ``mergekit-NAME/`` mergekit's)."""
    return tmp_path_factory.mktemp("mergekit-spherical")


@pytest.fixture(scope="module")
def runs(root, tiny_family, monkeypatch_module) -> dict[str, tuple[dict, dict]]:
    """name -> (MergePipe's output tensors, mergekit's output tensors) of the same config file; ``written-NAME``:
    mergekit's of the config file MergePipe wrote for NAME (the snapshot's ``mergepipe_config.yml``)."""
    runner = wide_runner(monkeypatch_module)
    files, ours = {}, {}
    for name, config in _configs(tiny_family).items():
        files[name] = root / f"{name}.yml"
        files[name].write_text(yaml.safe_dump(config, sort_keys=False))
        invoke(runner, ["merge", "--db", root / "catalog.db", "--config", files[name], "--out", root / name,
                        "--model-id", name, "--no-progress"])
        ours[name] = load_tensors(root / name)
    for name in WRITTEN:
        written = (root / name / "mergepipe_config.yml").read_text()
        files[f"written-{name}"] = root / f"written-{name}.yml"
        files[f"written-{name}"].write_text(with_paths(written, tiny_family))
        ours[f"written-{name}"] = ours[name]
    theirs = run_mergekit({f"mergekit-{name}": path for name, path in files.items()}, root)
    return {name: (ours[name], theirs[f"mergekit-{name}"]) for name in files}


@pytest.mark.parametrize("name", NAMES)
def test_equal_to_mergekit_element_wise(runs, tiny_family, name):
    mine, theirs = runs[name]
    assert set(mine) == set(theirs)
    inputs = [load_tensors(tiny_family[k]) for k in ("base", "e1", "e2", "e3")]
    off = differ = total = 0
    for t in sorted(mine):
        assert mine[t].dtype == theirs[t].dtype == torch.float32, t
        close = within_rounding(mine[t], theirs[t], [m[t] for m in inputs])
        off, total = off + int((~close).sum()), total + close.numel()
        differ += int((mine[t] != theirs[t]).sum())
        if any(method in name for method in NORM_SCALED):  # mergekit's float32 whole-tensor sums
            close |= (mine[t] - theirs[t]).abs() <= theirs[t].abs().max() * 2.0**-17
        assert bool(close.all()), f"{name} {t}: {int((~close).sum())} of {close.numel()} differ beyond rounding"
    print(f"\n{name}: {differ} of {total} elements differ ({100 * differ / total:.3f}%), {off} "
          f"({100 * off / total:.3f}%) beyond 16 float32 steps of their inputs")


@pytest.mark.parametrize("name", WRITTEN)
def test_the_written_config_states_the_merge_as_mergekit_does_and_reruns_to_it(runs, root, tiny_family, tmp_path,
                                                                                monkeypatch, name):
    """Of the models themselves, nuslerp and multislerp have no base_model in mergekit: the written file lists
    the base first with its weight; MergePipe reads it back to the same tensors (another catalog)."""
    mine, _ = runs[name]
    written = yaml.safe_load((root / name / "mergepipe_config.yml").read_text())
    given = [{"model": f"{Path(m['model']).name}@1", **m.get("parameters", {})}
             for m in _configs(tiny_family)[name]["models"]]
    stated = [{"model": m["model"], **m.get("parameters", {})} for m in written["models"]]
    if name.startswith("karcher"):  # the base (the first model) averaged with the others, as mergekit adds it
        assert (written["base_model"], stated) == (given[0]["model"], given[1:])
    else:  # as given: no base_model, the first model with its weight
        assert "base_model" not in written and stated == given
        assert not {"task_vectors", "base_weight"} & set(written.get("parameters", {}))
    again = tmp_path / "again"
    config = tmp_path / "written.yml"
    config.write_text(with_paths(yaml.safe_dump(written, sort_keys=False), tiny_family))
    invoke(wide_runner(monkeypatch), ["merge", "--db", tmp_path / "c.db", "--config", config, "--out", again,
                                      "--no-progress"])
    rerun = load_tensors(again)
    assert set(rerun) == set(mine) and all(torch.equal(rerun[t], mine[t]) for t in mine)


def test_the_first_model_is_the_base_and_a_participant(runs, tiny_family):
    """Without a base_model the output is not the first model's: it is one of the interpolated points."""
    mine, _ = runs["nuslerp-models-flat"]
    first = load_tensors(tiny_family["e1"])
    assert any(not torch.equal(mine[t], first[t].float()) for t in mine)


@pytest.mark.parametrize("method, parameters, needle", [
    ("karcher", {"max_iter": 2.5}, "max_iter must be a whole number, got 2.5"),
    ("karcher", {"tol": -1}, "tol must be in [0, inf]"),
    ("multislerp", {"eps": 0}, "eps must be in (0, inf]"),
    ("multislerp", {"normalize_weights": "yes"}, "normalize_weights must be true or false"),
    ("nuslerp", {"nuslerp_row_wise": 1}, "nuslerp_row_wise must be true or false"),
])
def test_an_invalid_parameter_is_refused_in_one_line_before_anything_is_registered(
        tiny_family, tmp_path, capsys, method, parameters, needle):
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump({
        "merge_method": method, "base_model": str(tiny_family["base"]),
        "models": [{"model": str(tiny_family["e1"])}, {"model": str(tiny_family["e2"])}],
        "parameters": parameters, "dtype": "float32"}))
    db = tmp_path / "c.db"
    code, _, err = run_main(["merge", "--db", db, "--config", config, "--out", tmp_path / "out", "--model-id", "m",
                             "--no-progress"], capsys)
    lines = err.strip().splitlines()
    assert code not in (0, None) and len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0] and method in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    if db.exists():
        with Catalog.open(db) as catalog:
            assert catalog.models.list() == []


@pytest.mark.parametrize("method", ["nuslerp", "multislerp", "karcher"])
def test_a_partial_budget_plans_whole_tensors_and_says_so(tiny_family, tmp_path, monkeypatch, method):
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump({
        "merge_method": method, "models": [{"model": str(tiny_family[k])} for k in ("e1", "e2")],
        "parameters": {"nuslerp_flatten": False} if method == "nuslerp" else {}, "dtype": "float32",
        "mergepipe": {"budget": "40%"}}))
    runner = wide_runner(monkeypatch)
    out = invoke(runner, ["plan", "--db", tmp_path / "c.db", "--config", config, "--json"])
    plan = json.loads(out[out.index("{"):])
    merged = set(plan["reads"])
    assert merged and set(plan["tensor_level"]) >= merged  # every tensor read is read whole
    assert plan["cost"]["expert_bytes"] < plan["cost"]["full_expert_bytes"]
    assert any(note.startswith(f"{method} ") and "whole tensors" in note for note in plan["notes"])
