"""nearswap, arcee_fusion, model stock per row (``filter_wise: true``) and the weights mergekit ignores,
against mergekit 0.1.5 on the tiny bf16 test models.

Each config runs through mergekit (``dtype: float32``; tests/fixtures/mergekit.py) and through
``mergepipe merge --config`` as a user types it, each into its own catalog. nearswap does mergekit's
float32 operations in mergekit's order and arcee_fusion its quantile rule, so both must give mergekit's
tensors bit for bit; model stock per row sums in float64 where mergekit sums in float32, so it must agree
to float32 rounding. A ``weight`` on slerp or model stock changes nothing in mergekit: MergePipe drops it
with one note, so both outputs stay what they are without it. The shares of differing elements are
printed (``pytest -s``) for docs/MERGEKIT.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.mergekit import differing, run_mergekit

pytestmark = pytest.mark.mergekit
pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed (pip install mergekit==0.1.5)")

#: Budgets of the partial-budget runs: some tensors (blocks) read, some not.
PARTIAL = "40%"


def _configs(family: dict[str, Path]) -> dict[str, dict]:
    base, e1, e2, e3 = (str(family[k]) for k in ("base", "e1", "e2", "e3"))

    def config(method: str, models: list[dict], **parameters) -> dict:
        out = {"merge_method": method, "base_model": base, "dtype": "float32", "models": models}
        return {**out, "parameters": parameters} if parameters else out

    stock = [{"model": e1}, {"model": e2}, {"model": e3}]
    weighted_stock = [{"model": e1, "parameters": {"weight": 1.0}}, {"model": e2, "parameters": {"weight": 0.5}},
                      {"model": e3, "parameters": {"weight": [0.0, 1.0]}}]
    return {
        "nearswap": config("nearswap", [{"model": e1}], t=0.01),
        # the base listed too: mergekit's two inputs either way
        "arcee_fusion": config("arcee_fusion", [{"model": base}, {"model": e2}]),
        "model_stock": config("model_stock", stock),
        "model_stock-filter_wise": config("model_stock", stock, filter_wise=True),
        "model_stock-weighted": config("model_stock", weighted_stock, weight=0.3),
        "slerp": config("slerp", [{"model": base}, {"model": e1}], t=0.4),
        "slerp-weighted": config("slerp", [{"model": base, "parameters": {"weight": 0.3}},
                                           {"model": e1, "parameters": {"weight": 0.7}}], t=0.4),
    }


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def runs(tiny_family, tmp_path_factory, monkeypatch_module) -> dict[str, tuple[dict, dict, Path]]:
    """name -> (MergePipe's output tensors, mergekit's output tensors, the config file)."""
    root = tmp_path_factory.mktemp("mergekit-fusions")
    runner = wide_runner(monkeypatch_module)
    files, ours = {}, {}
    for name, config in _configs(tiny_family).items():
        files[name] = root / f"{name}.yml"
        files[name].write_text(yaml.safe_dump(config, sort_keys=False))
        out = root / f"ours-{name}"
        invoke(runner, ["merge", "--db", root / f"{name}.db", "--config", files[name], "--out", out,
                        "--model-id", "m", "--no-progress"])
        ours[name] = load_tensors(out)
    theirs = run_mergekit({f"mergekit-{name}": path for name, path in files.items()}, root)
    return {name: (ours[name], theirs[f"mergekit-{name}"], files[name]) for name in files}


def _within_float32_rounding(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                             family: dict[str, Path]) -> bool:
    """Elements equal up to 16 float32 ulps of the largest input or result magnitude there (the two order
    their float32 operations differently, and a result that cancels keeps the inputs' rounding)."""
    inputs = [load_tensors(family[k]) for k in ("base", "e1", "e2", "e3")]
    for t, v in theirs.items():
        scale = torch.stack([ours[t].abs(), v.abs(), *(i[t].float().abs() for i in inputs)]).amax(dim=0)
        if not bool(((ours[t] - v).abs() <= scale * 2.0**-19).all()):
            return False
    return True


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[t], b[t]) for t in a)


@pytest.mark.parametrize("name", ["nearswap", "arcee_fusion"])
def test_the_two_model_fusions_equal_mergekit_bit_for_bit(runs, name):
    ours, theirs, _ = runs[name]
    changed, total = differing(ours, theirs)
    base_changed = sum(int((ours[t] != theirs[t]).sum()) for t in ours)
    print(f"\n{name}: {changed} of {total} elements differ from mergekit ({100 * changed / total:.4f}%)")
    assert set(ours) == set(theirs) and changed == base_changed == 0


def test_model_stock_per_row_equals_mergekit_to_rounding(runs, tiny_family):
    ours, theirs, _ = runs["model_stock-filter_wise"]
    changed, total = differing(ours, theirs)
    print(f"\nmodel_stock filter_wise: {changed} of {total} elements differ from mergekit "
          f"({100 * changed / total:.4f}%), all within float32 rounding")
    assert _within_float32_rounding(ours, theirs, tiny_family)
    per_tensor, _, _ = runs["model_stock"]
    assert not _within_float32_rounding(ours, per_tensor, tiny_family)  # the rows did take their own ratios


@pytest.mark.parametrize("method", ["slerp", "model_stock"])
def test_a_weight_mergekit_ignores_changes_nothing_on_either_side(runs, tiny_family, method):
    ours, theirs, _ = runs[f"{method}-weighted"]
    plain_ours, plain_theirs, _ = runs[method]
    assert _same(theirs, plain_theirs)  # mergekit ignores the weights
    assert _same(ours, plain_ours)  # so does MergePipe
    assert _within_float32_rounding(ours, theirs, tiny_family)


def test_the_ignored_weight_is_one_note(runs, tmp_path, capsys):
    *_, config = runs["slerp-weighted"]
    code, _, err = run_main(["merge", "--db", tmp_path / "c.db", "--config", config, "--out", tmp_path / "out",
                             "--no-progress"], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if "weight ignored" in line]
    assert notes == ["note: weight ignored: slerp takes no weight (mergekit ignores it too, so the result is the "
                     "same)"]


# ------------------------------------------------------------ partial budgets


def _partial(runs, name, tmp_path, capsys) -> tuple[dict, dict, dict, dict]:
    """(MergePipe's output at PARTIAL, its full output, the base, the plan), in a catalog of 4 KiB blocks (the
    test models' tensors span several)."""
    full, _, written = runs[name]
    config = yaml.safe_load(written.read_text())
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump({**config, "mergepipe": {"block_bytes": "4KiB", "budget": PARTIAL}}))
    db = tmp_path / "c.db"
    code, plan, err = run_main(["plan", "--db", db, "--config", path, "--json"], capsys)
    assert code == 0, err
    code, _, err = run_main(["merge", "--db", db, "--config", path, "--out", tmp_path / "out", "--no-progress"],
                            capsys)
    assert code == 0, err
    base = load_tensors(Path(config["base_model"]))
    return load_tensors(tmp_path / "out"), full, {t: v.float() for t, v in base.items()}, json.loads(plan)


def test_nearswap_under_a_budget_is_the_full_merge_or_the_base_block_by_block(runs, tmp_path, capsys):
    out, full, base, _ = _partial(runs, "nearswap", tmp_path, capsys)
    mixed = 0
    for t, value in out.items():
        as_full, as_base = value == full[t], value == base[t]
        assert bool((as_full | as_base).all()), t
        mixed += bool((~as_base).any()) and bool((~as_full).any())
    assert mixed  # a tensor read in part: nearswap streams block by block


def test_arcee_fusion_under_a_budget_fuses_whole_tensors_or_keeps_the_base(runs, tmp_path, capsys):
    out, full, base, plan = _partial(runs, "arcee_fusion", tmp_path, capsys)
    fused = {t for t, value in out.items() if torch.equal(value, full[t]) and not torch.equal(value, base[t])}
    kept = {t for t, value in out.items() if torch.equal(value, base[t])}
    assert fused and kept and fused | kept == set(out)
    notes = plan["notes"]
    assert any(n.startswith("arcee_fusion fuses whole tensors") for n in notes)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("method, models, parameters, message", [
    ("nearswap", ["e1"], {}, "nearswap needs t, the distance |E - B| up to which the expert's value is taken "
                             "(e.g. 0.001); mergekit requires it too"),
    ("nearswap", ["e1"], {"t": -0.5}, "nearswap, global parameters: t must be in [0, inf], got -0.5"),
    ("nearswap", ["e1", "e2"], {"t": 0.01}, "nearswap needs exactly 1 expert, got 2"),
    ("arcee_fusion", ["e1"], {"t": 0.5}, "arcee_fusion does not take parameter 't'; it takes: no parameters"),
    ("model_stock", ["e1", "e2"], {"filter_wise": "yes"},
     "model_stock, global parameters: filter_wise must be true or false, got 'yes'"),
])
def test_an_invalid_parameter_is_refused_in_one_line_before_anything(tiny_family, tmp_path, capsys, method, models,
                                                                     parameters, message):
    config = {"merge_method": method, "base_model": str(tiny_family["base"]),
              "models": [{"model": str(tiny_family[m])} for m in models], "parameters": parameters}
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump(config))
    code, out, err = run_main(["merge", "--db", tmp_path / "c.db", "--config", path, "--out", tmp_path / "out"],
                              capsys)
    assert code != 0 and out == ""
    assert err.splitlines() == [f"error: {message}"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "c.db").exists()
