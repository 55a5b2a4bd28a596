"""At a budget covering everything, the engine's block-streamed output is bit
for bit the full-read merge, for every operator of the registry.

References are computed here on whole tensors read with safetensors. For the
fixed-formula operators (avg, linear, task arithmetic, TIES, SLERP, model
stock) they are the plain published formulas (tests/planner/support.py). For
the random operators (DARE, DELLA, breadcrumbs) the reference is the
operator's own kernel (``registry.merge``) applied once to the WHOLE
tensors: this checks that block streaming (catalog thresholds,
element-addressed random numbers, row offsets) equals the whole-tensor
merge, not the formula itself, which tests/spec/operators covers.

The merged checkpoints also load in transformers and give the same logits
as a checkpoint saved from the reference tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.spec.operators import BlockContext
from mergepipe.spec.operators.kernels import merge
from mergepipe.planner.planner import Planner
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import OPERATORS, get_operator
from mergepipe.spec.settings import count_layers
from mergepipe.spec.request import MergeRequest
from tests.spec.operators.table import TABLE
from tests.planner.support import (
    build_catalog,
    deltas_of,
    load_tensors,
    raw_layout,
    ref_avg,
    ref_linear,
    ref_model_stock,
    ref_slerp,
    ref_task_arithmetic,
    ref_ties,
    save_reference_checkpoint,
)

BLOCK_BYTES = 2048  # several blocks per tensor; 250- and 120-row tensors split unevenly
SEED = 7
EXPERTS = ["e1", "e2", "e3"]  # list order = id order (sums run in id order)

#: operator -> (experts, weights, global params): each method's row of the test table. Densities and bands
#: are on the catalog's threshold grid so TIES/breadcrumbs stream block by block.
CASES = {name: row.merge for name, row in TABLE.items()}

#: Extra configurations that take other engine paths.
EXTRA_CASES = {
    # off-grid density: no catalog threshold, TIES falls back to whole tensors
    "ties-offgrid": ("ties", EXPERTS, [1.0, 0.7, 0.4], {"density": 0.37}),
    # L1 rescale needs per-tensor norms: tensor level
    "dare_linear-l1": ("dare_linear", EXPERTS, None, {"density": 0.5, "rescale": "l1"}),
}


@pytest.fixture(scope="module")
def op_catalog(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("opcat") / "catalog.db"
    build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=EXPERTS)
    with Catalog.open(path) as catalog:
        yield catalog


@pytest.fixture(scope="module")
def family_tensors(tiny_family):
    return {name: load_tensors(path) for name, path in tiny_family.items()}


def reference_merge(op_name, experts, weights, params, tensors, base="base"):
    """The full-read merge of every tensor, from whole tensors, in fp32.

    Inputs are the test's own request (not the plan's record of it)."""
    weights = list(weights) if weights is not None else [1.0] * len(experts)
    base_t = tensors[base]
    expert_t = [tensors[e] for e in experts]
    num_layers = count_layers(list(base_t))
    out = {}
    for name in base_t:
        b, ds = deltas_of(base_t, expert_t, name)
        if op_name == "task_arithmetic":
            out[name] = ref_task_arithmetic(b, ds, weights, params.get("lambda", 1.0))
        elif op_name == "linear":
            out[name] = ref_linear(b, ds, weights)
        elif op_name == "avg":
            out[name] = ref_avg(b, ds)
        elif op_name == "ties":
            out[name] = ref_ties(b, ds, weights, params["density"], params.get("lambda", 1.0))
        elif op_name == "slerp":
            out[name] = ref_slerp(b, ds[0], params["t"])
        elif op_name == "model_stock":
            out[name] = ref_model_stock(b, ds)
        else:  # random operators: the operator itself, on whole tensors
            spec = MergeSpec(op_name, tuple((e, {"weight": w}) for e, w in zip(experts, weights)), params, SEED)
            definition = get_operator(op_name)
            typed = definition.resolve(spec, name, num_layers)
            ctx = BlockContext(definition, name, tuple(b.shape), spec.expert_ids, typed, seed=SEED)
            out[name] = merge(b, ds, ctx)
    return out


def _run(catalog, tmp_path, op_name, experts, weights, params, model_id, **plan_kwargs):
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator=op_name, weights=weights, params=params, seed=SEED, budget="100%", **plan_kwargs))
    assert plan.cost.expert_bytes == plan.cost.full_expert_bytes
    out = tmp_path / "out"
    _, manifest = Engine(catalog).execute(plan, out=out, model_id=model_id)
    return plan, out, manifest


def _assert_bit_identical(got: dict, ref: dict, dtype: torch.dtype):
    assert set(got) == set(ref)
    for name, expected in ref.items():
        expected = expected.to(dtype)
        assert got[name].dtype == dtype, name
        assert torch.equal(got[name], expected), (
            f"{name}: max |diff| {float((got[name].float() - expected.float()).abs().max())}"
        )


def _logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 200, 3, 17]])).logits


def test_cases_cover_the_registry():
    assert set(CASES) == set(OPERATORS)


@pytest.mark.parametrize("op_name", sorted(OPERATORS))
def test_full_budget_is_bit_identical_to_whole_tensor_reference(op_name, op_catalog, family_tensors, tiny_family, tmp_path):
    experts, weights, params = CASES[op_name]
    plan, out, manifest = _run(op_catalog, tmp_path, op_name, experts, weights, params, f"full-{op_name}")
    ref = reference_merge(op_name, experts, weights, params, family_tensors)
    got = load_tensors(out)
    _assert_bit_identical(got, ref, torch.bfloat16)
    # every changed block was read, so the manifest reports no error
    assert manifest.error_bound.realized == 0.0
    assert manifest.cost.realized.expert_bytes == plan.cost.full_expert_bytes
    # transformers loads the snapshot and its logits are the reference's
    reference_dir = save_reference_checkpoint(
        tiny_family["base"], {k: v.to(torch.bfloat16) for k, v in ref.items()}, tmp_path / "reference"
    )
    assert torch.equal(_logits(out), _logits(reference_dir))


@pytest.mark.parametrize("case", sorted(EXTRA_CASES))
def test_tensor_level_fallbacks_are_bit_identical(case, op_catalog, family_tensors, tmp_path):
    op_name, experts, weights, params = EXTRA_CASES[case]
    plan, out, _ = _run(op_catalog, tmp_path, op_name, experts, weights, params, f"full-{case}")
    assert plan.tensor_level, "expected whole-tensor merges for this configuration"
    ref = reference_merge(op_name, experts, weights, params, family_tensors)
    _assert_bit_identical(load_tensors(out), ref, torch.bfloat16)


def test_out_dtype_f32_writes_the_unrounded_merge(op_catalog, family_tensors, tmp_path):
    params = {"density": 0.5, "lambda": 0.9}
    _, out, _ = _run(op_catalog, tmp_path, "ties", EXPERTS, [1.0, 0.7, 0.4], params, "full-ties-f32",
                     out_dtype="f32")
    ref = reference_merge("ties", EXPERTS, [1.0, 0.7, 0.4], params, family_tensors)
    _assert_bit_identical(load_tensors(out), ref, torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "float32"
    assert all(t.dtype == "F32" for t in raw_layout(out).values())


@pytest.fixture(scope="module")
def sharded_catalog(sharded_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("shardcat") / "catalog.db"
    build_catalog(path, BLOCK_BYTES, dict(sharded_family), base="base", experts=["e1", "e2"])
    with Catalog.open(path) as catalog:
        yield catalog


def test_sharded_tied_qwen3_mirrors_base_shards_and_matches_reference(sharded_catalog, sharded_family, tmp_path):
    base_dir = sharded_family["base"]
    _, out, _ = _run(sharded_catalog, tmp_path, "ties", ["e1", "e2"], [1.0, 0.5], {"density": 0.3}, "sharded-ties")
    tensors = {name: load_tensors(path) for name, path in sharded_family.items()}
    ref = reference_merge("ties", ["e1", "e2"], [1.0, 0.5], {"density": 0.3}, tensors)
    _assert_bit_identical(load_tensors(out), ref, torch.bfloat16)
    # same shard files, each with the same tensors in the same order
    base_layout, out_layout = raw_layout(base_dir), raw_layout(out)
    assert len({t.file.name for t in base_layout.values()}) > 1
    assert {n: t.file.name for n, t in out_layout.items()} == {n: t.file.name for n, t in base_layout.items()}
    def order(layout, shard):
        return [n for n, t in sorted(layout.items(), key=lambda kv: kv[1].begin) if t.file.name == shard]

    for shard in {t.file.name for t in base_layout.values()}:
        assert order(out_layout, shard) == order(base_layout, shard)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    base_index = json.loads((base_dir / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == base_index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in out_layout.values())
    # side files copied from the base
    assert (out / "tokenizer_config.json").read_bytes() == (base_dir / "tokenizer_config.json").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((base_dir / "config.json").read_text())
    reference_dir = save_reference_checkpoint(
        base_dir, {k: v.to(torch.bfloat16) for k, v in ref.items()}, tmp_path / "reference"
    )
    assert torch.equal(_logits(out), _logits(reference_dir))


def test_breadcrumbs_band_edges_that_are_float_sums(op_catalog, family_tensors, tmp_path):
    params = {"density": 0.2, "gamma": 0.1}
    _, out, _ = _run(op_catalog, tmp_path, "breadcrumbs", EXPERTS, None, params, "bc-float-sum")
    ref = reference_merge("breadcrumbs", EXPERTS, None, params, family_tensors)
    _assert_bit_identical(load_tensors(out), ref, torch.bfloat16)
