"""The CUDA path against the CPU: same kernels, same thresholds, same files.

Every check here runs on a GPU only (marker ``cuda``; scripts/gpu-check.sh
runs them). The streaming kernels are separate fp32 multiplies/adds in a
fixed order, random masks come from the CPU-generated element stream and
trims from integer thresholds, so their results must be bit-identical on
both devices; slerp and model_stock reduce whole tensors in float64, whose
summation order may differ, so they only need to be close.

Each check is a helper taking the device, so ``test_the_checks_run_on_the_cpu``
runs the same code CPU against CPU where there is no GPU: it cannot find a
device difference, but it keeps the GPU-only code from rotting unseen.
"""

from __future__ import annotations

import pytest
import torch

from mergepipe.analysis.deltastore import build_store
from mergepipe.analysis.stats import SORT_BELOW, trim_thresholds
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.spec.operators.kernels import keep_mask, merge
from mergepipe.spec.operators.base import ElementRng
from mergepipe.planner.planner import Planner
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.operators import DENSITY_GRID
from mergepipe.spec.request import MergeRequest
from tests.spec.operators.table import (
    IDS,
    context,
    make_inputs,
    resolved,
    run_blocks,
    thresholds_for,
)
from tests.planner.support import build_catalog, clone_catalog

#: With ``@pytest.mark.cuda`` on every GPU test (``pytest -m cuda`` selects them).
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check.sh)")

SHAPE = (61, 33)  # blocks of 8 rows leave a short last block
ROWS_PER_BLOCK = 8
#: Blocks no expert read for: (expert, block index).
UNREAD = frozenset({(0, 1), (1, 4)})
#: A trim input small enough to be sorted, and one large enough for the radix path.
TRIM_SIZES = [SORT_BELOW // 16, SORT_BELOW * 4 + 123]
DENSITIES = [*DENSITY_GRID, 0.37, 0.999]


def assert_same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == "cpu" and want.device.type == "cpu"
    if OPERATORS[name].streaming:
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def merged_on(device: str, name: str, base, deltas, ctx, unread=frozenset()) -> torch.Tensor:
    """``name``'s merge with inputs moved to ``device`` (block by block for
    streaming operators, whole otherwise); the result back on the CPU."""
    base = base.to(device)
    deltas = [d.to(device) for d in deltas]
    if OPERATORS[name].streaming:
        out = run_blocks(base, deltas, ctx, ROWS_PER_BLOCK, unread)
    else:
        out = merge(base, [None if (i, 0) in unread else d for i, d in enumerate(deltas)], ctx)
    assert out.device.type == torch.device(device).type
    return out.cpu()


def check_blocks(device: str, name: str) -> None:
    """Block by block with the catalog's (CPU-computed) thresholds, some blocks unread."""
    params = resolved(name)
    base, deltas = make_inputs(SHAPE, len(params.experts), seed=len(name))
    ctx = context(name, SHAPE, IDS[: len(params.experts)], params, thresholds_for(name, deltas, params))
    for unread in (frozenset(), UNREAD):
        assert_same(name, merged_on(device, name, base, deltas, ctx, unread),
                    merged_on("cpu", name, base, deltas, ctx, unread))


def check_whole_without_thresholds(device: str, name: str) -> None:
    """Whole tensors and no catalog thresholds: the kernel trims on the device itself."""
    params = resolved(name)
    base, deltas = make_inputs(SHAPE, len(params.experts), seed=3)
    ctx = context(name, SHAPE, IDS[: len(params.experts)], params)
    moved = merge(base.to(device), [d.to(device) for d in deltas], ctx).cpu()
    assert_same(name, moved, merge(base, deltas, ctx))


def trim_input(n: int) -> torch.Tensor:
    """|Δ| with many ties and exact zeros, as bf16 checkpoints give."""
    _, (delta,) = make_inputs((n,), 1, seed=n)
    delta[::7] = 0.0
    return delta.abs()


def check_thresholds(device: str, n: int) -> None:
    values = trim_input(n)
    on_cpu = trim_thresholds(values, DENSITIES)
    assert trim_thresholds(values.to(device), DENSITIES) == on_cpu
    moved = values.to(device)
    block = max(1, n // 5)
    for thr in on_cpu:
        for start in range(0, n, block):
            got = keep_mask(moved[start : start + block], start, thr)
            assert got.device.type == torch.device(device).type
            assert torch.equal(got.cpu(), keep_mask(values[start : start + block], start, thr)), (thr, start)


def check_random_streams(device: str) -> None:
    rng = ElementRng(5, "expert-a", "model.layers.0.mlp.up_proj.weight")
    assert torch.equal(rng.bits(1001, 4099, device=device).cpu(), rng.bits(1001, 4099))
    assert torch.equal(rng.bits(7, 5000, device=device).cpu(), rng.bits(7, 5000))


# -------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@no_cuda
@pytest.mark.parametrize("name", list(OPERATORS))
def test_blocks_on_cuda_equal_the_cpu(name):
    check_blocks("cuda", name)


@pytest.mark.cuda
@no_cuda
@pytest.mark.parametrize("name", list(OPERATORS))
def test_whole_tensors_without_thresholds_on_cuda_equal_the_cpu(name):
    check_whole_without_thresholds("cuda", name)


@pytest.mark.cuda
@no_cuda
@pytest.mark.parametrize("n", TRIM_SIZES)
def test_trim_thresholds_and_keep_masks_on_cuda_equal_the_cpu(n):
    check_thresholds("cuda", n)


@pytest.mark.cuda
@no_cuda
def test_random_streams_on_cuda_equal_the_cpu():
    check_random_streams("cuda")


ENGINE_CASES = {
    "ties": (["e1", "e2", "e3"], [1.0, 0.7, 0.4], {"density": 0.5, "lambda": 0.9}),
    "dare_ties": (["e1", "e2", "e3"], [1.0, 0.7, 0.4], {"density": 0.6}),
}


@pytest.fixture(scope="module")
def engine_template(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda") / "template.db"
    return build_catalog(path, 2048, dict(tiny_family), base="base", experts=["e1", "e2", "e3"])


def merged_files(template, root, op_name, device) -> tuple[str, dict[str, str]]:
    """(snapshot id, {file: sha256}) of one budgeted merge on ``device``, in a private catalog."""
    experts, weights, params = ENGINE_CASES[op_name]
    root.mkdir(parents=True)
    with Catalog.open(clone_catalog(template, root / "c.db")) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator=op_name, weights=weights, params=params, seed=5, budget="60%"))
        snapshot_id, manifest = Engine(catalog, device=device).execute(plan, out=root / "out", model_id="m")
    return snapshot_id, {f.name: f.digest for f in manifest.files}


@pytest.mark.cuda
@no_cuda
@pytest.mark.parametrize("op_name", sorted(ENGINE_CASES))
def test_engine_on_cuda_writes_the_files_of_the_cpu(engine_template, tmp_path, op_name):
    on_cpu = merged_files(engine_template, tmp_path / "first", op_name, "cpu")
    on_cuda = merged_files(engine_template, tmp_path / "second", op_name, "cuda")
    assert on_cuda == on_cpu


def merged_entries_files(template, root, device) -> tuple[str, dict[str, str]]:
    """The same for a TIES merge that reads delta stores (sketch stages and exact entries)."""
    root.mkdir(parents=True)
    with Catalog.open(clone_catalog(template, root / "c.db")) as catalog:
        for expert in ("e1", "e2", "e3"):
            build_store(catalog, expert, "base", root / "stores")
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2", "e3"], operator="ties", params={"density": 0.5}, budget="45%", policy="entries"))
        assert plan.sketch_reads and (plan.entry_reads or plan.reads)
        snapshot_id, manifest = Engine(catalog, device=device).execute(plan, out=root / "out", model_id="m")
    return snapshot_id, {f.name: f.digest for f in manifest.files}


@pytest.mark.cuda
@no_cuda
def test_entries_merge_on_cuda_writes_the_files_of_the_cpu(engine_template, tmp_path):
    on_cpu = merged_entries_files(engine_template, tmp_path / "first", "cpu")
    assert merged_entries_files(engine_template, tmp_path / "second", "cuda") == on_cpu


# ---------------------------------------------------------- without a GPU


def test_the_checks_run_on_the_cpu():
    """The helpers above, CPU against CPU, on a few operators of each kind."""
    for name in ("ties", "dare_ties", "della", "breadcrumbs_ties", "slerp", "model_stock"):
        check_blocks("cpu", name)
        check_whole_without_thresholds("cpu", name)
    check_thresholds("cpu", TRIM_SIZES[0])
    check_random_streams("cpu")


def test_the_entries_check_runs_on_the_cpu(engine_template, tmp_path):
    first = merged_entries_files(engine_template, tmp_path / "first", "cpu")
    assert merged_entries_files(engine_template, tmp_path / "second", "cpu") == first
