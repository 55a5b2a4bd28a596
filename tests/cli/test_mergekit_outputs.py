"""What mergekit 0.1.5 itself makes of the YAML MergePipe reads and writes, on the tiny bf16 test models.

* ``slices:`` of whole models (``test_mergekit_slices.py``): mergekit's output of the same file, within
  one bf16 step everywhere (the rounding differences docs/MERGEKIT.md lists);
* a snapshot's ``mergepipe_config.yml`` (``test_config_rerun.py``), its ids replaced by the paths:
  mergekit computes in its ``dtype: float32`` as MergePipe did, so task arithmetic gives the same tensors;
  the config the user wrote (``dtype: bfloat16``) makes mergekit compute in bf16 and differ;
* the share of elements that differ for configs saying ``dtype: bfloat16`` and ``float32``, the numbers
  docs/MERGEKIT.md quotes: ``.venv/bin/python -m pytest -s -m mergekit tests/cli/test_mergekit_outputs.py``
  prints them.

Every MergePipe merge runs through the command line as a user types it, each into its own catalog.
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from tests.cli.test_mergekit_slices import gradient_slerp, sliced_task_arithmetic
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, wide_runner
from tests.fixtures.mergekit import differing, run_mergekit

pytestmark = pytest.mark.mergekit
pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed (pip install mergekit==0.1.5)")

#: The methods whose dtype differences docs/MERGEKIT.md states: (models as (expert, parameters), parameters).
DTYPE_CASES = {
    "task_arithmetic": ([("e1", {"weight": 1.0}), ("e2", {"weight": 0.5})], {}),
    "model_stock": ([("e1", {}), ("e2", {}), ("e3", {})], {}),
    "breadcrumbs": ([("e1", {"weight": 1.0, "density": 0.4, "gamma": 0.05}),
                     ("e2", {"weight": 0.5, "density": 0.4, "gamma": 0.05})], {}),
}
DTYPES = ("bfloat16", "float32")


def dtype_config(family, method: str, dtype: str) -> dict:
    """A config of ``method`` computing in ``dtype`` (mergekit's meaning) and writing bf16."""
    models, params = DTYPE_CASES[method]
    return {"merge_method": method, "base_model": str(family["base"]),
            "models": [{"model": str(family[e]), **({"parameters": p} if p else {})} for e, p in models],
            **({"parameters": params} if params else {}), "dtype": dtype, "out_dtype": "bfloat16"}


def with_paths(written: str, family) -> str:
    """A ``mergepipe_config.yml`` with its catalog ids (``e1@1``) replaced by the models' paths, as mergekit
    needs them (the ids are the test models' folder names)."""
    return re.sub(r"(model: )(\w+)@1$", lambda m: m[1] + str(family[m[2]]), written, flags=re.M)


@pytest.fixture(scope="module")
def runs(tiny_family, tmp_path_factory, monkeypatch_module) -> dict[str, tuple[dict, dict]]:
    """name -> (MergePipe's output tensors, mergekit's output tensors) of the same config file."""
    root = tmp_path_factory.mktemp("mergekit-outputs")
    runner = wide_runner(monkeypatch_module)
    slerp = gradient_slerp(tiny_family)
    configs = {"slices-slerp": {**slerp, "dtype": "float32", "out_dtype": "bfloat16"},
               "slices-task-arithmetic": sliced_task_arithmetic(tiny_family),
               **{f"{m}-{d}": dtype_config(tiny_family, m, d) for m in DTYPE_CASES for d in DTYPES}}
    configs["task_arithmetic-bfloat16"].pop("out_dtype")  # the user's config: bf16 in and out
    ours, files = {}, {}
    for name, config in configs.items():
        files[name] = root / f"{name}.yml"
        files[name].write_text(yaml.safe_dump(config, sort_keys=False))
        out = root / f"ours-{name}"
        invoke(runner, ["merge", "--db", root / f"{name}.db", "--config", files[name], "--out", out,
                        "--model-id", "m", "--no-progress"])
        ours[name] = load_tensors(out)
    written = (root / "ours-task_arithmetic-bfloat16" / "mergepipe_config.yml").read_text()
    files["written"] = root / "written.yml"
    files["written"].write_text(with_paths(written, tiny_family))
    ours["written"] = ours["task_arithmetic-bfloat16"]
    theirs = run_mergekit({f"mergekit-{name}": path for name, path in files.items()}, root)
    return {name: (ours[name], theirs[f"mergekit-{name}"]) for name in files}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _within_one_bf16_step(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> bool:
    for name, value in theirs.items():
        if value.is_floating_point():
            a, b = ours[name].float(), value.float()
            if not bool(((a - b).abs() <= b.abs() * 2.0**-7 + 2.0**-126).all()):
                return False
    return True


@pytest.mark.parametrize("name", ["slices-slerp", "slices-task-arithmetic"])
def test_mergekit_makes_the_same_merge_of_whole_model_slices(runs, name):
    ours, theirs = runs[name]
    changed, total = differing(ours, theirs)
    print(f"\n{name}: {changed} of {total} elements differ ({100 * changed / total:.4f}%)")
    assert _within_one_bf16_step(ours, theirs)
    assert changed / total < 0.002


def test_mergekit_on_the_written_config_gives_the_same_tensors(runs):
    changed, total = differing(*runs["written"])
    assert changed == 0 and total > 0
    user_ours, user_theirs = runs["task_arithmetic-bfloat16"]  # the config as the user wrote it: bf16 in mergekit
    assert differing(user_ours, user_theirs)[0] > 0


def test_a_bf16_dtype_makes_mergekit_differ_and_float32_does_not(runs):
    shares = {}
    for method in DTYPE_CASES:
        for dtype in DTYPES:
            changed, total = differing(*runs[f"{method}-{dtype}"])
            shares[method, dtype] = changed / total
            print(f"\n{method}, dtype: {dtype}: {changed} of {total} elements differ ({100 * changed / total:.4f}%)")
    for method in DTYPE_CASES:
        assert shares[method, "bfloat16"] > 0.01 > shares[method, "float32"]
    assert shares["task_arithmetic", "float32"] == 0
