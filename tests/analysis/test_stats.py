"""Per-tensor delta statistics (analysis.stats) against plain-torch references."""

from __future__ import annotations

import math

import pytest
import torch

from mergepipe.analysis import stats
from mergepipe.analysis.stats import TensorPass, Workspace, block_stats, from_hashes, zero_thresholds
from mergepipe.analysis.stats import trim_thresholds
from mergepipe.catalog.records import BlockRecord, TensorRecord
from mergepipe.errors import CatalogError
from mergepipe.spec.operators import DENSITY_GRID
from tests.catalog.helpers import reference_thresholds


def tensor_and_blocks(shape: tuple[int, ...], dtype: str, rows_per_block: int):
    """A TensorRecord at offset 0 and its row blocks (geometry written out here)."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}[dtype]
    row_bytes = math.prod(shape[1:]) * itemsize
    t = TensorRecord("w", "model.safetensors", dtype, shape, 0, math.prod(shape) * itemsize, 0)
    blocks = [
        BlockRecord("w", i, r0, min(r0 + rows_per_block, shape[0]), r0 * row_bytes,
                    min(r0 + rows_per_block, shape[0]) * row_bytes, None)
        for i, r0 in enumerate(range(0, shape[0], rows_per_block))
    ]
    return t, blocks


@pytest.mark.parametrize("numel", [0, 1, 7, 1000])
def test_zero_thresholds_equal_trim_thresholds_of_zeros(numel):
    expected = {t.density: t for t in trim_thresholds(torch.zeros(numel), DENSITY_GRID)}
    assert zero_thresholds(numel) == expected


@pytest.mark.parametrize("numel", [1, 7, 1000])
def test_zero_thresholds_keep_the_first_k(numel):
    zeros = torch.zeros(numel)
    for density, thr in zero_thresholds(numel).items():
        assert (thr.k, thr.tau, thr.last_index) == reference_thresholds(zeros, density)


@pytest.mark.parametrize("exact_fp32_count", [1 << 24, 0])
@pytest.mark.parametrize("sizes", [[10] * 10 + [3], [10] * 10 + [10], [103], [50, 50, 3]])
def test_block_stats_match_plain_torch(monkeypatch, exact_fp32_count, sizes):
    monkeypatch.setattr(stats, "_EXACT_FP32_COUNT", exact_fp32_count)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(sum(sizes), generator=g).abs()
    a[a < 0.5] = 0.0
    l2, mx, nnz = block_stats(a, sizes)
    parts = torch.split(a, sizes)
    assert nnz == [int((p != 0).sum()) for p in parts]
    assert mx == [float(p.max()) for p in parts]
    assert l2 == pytest.approx([float(torch.linalg.vector_norm(p)) for p in parts], rel=1e-6)


def test_block_stats_of_empty_blocks():
    l2, mx, nnz = block_stats(torch.zeros(0), [0, 0])
    assert (l2, mx, nnz) == ([0.0, 0.0], [0.0, 0.0], [0, 0])


def test_workspace_delta_is_exact_and_reusable():
    """|E - B| in fp32, also for a smaller tensor after a larger one (buffer reuse), and |Δ| of a delta."""
    g = torch.Generator().manual_seed(1)
    workspace = Workspace()
    for shape in [(40, 16), (3, 5), (64, 16)]:
        base = torch.randn(shape, generator=g).to(torch.bfloat16)
        expert = (base.float() + torch.randn(shape, generator=g) * 0.01).to(torch.bfloat16)
        got = workspace.abs_delta(workspace.new_window(math.prod(shape)), expert, base)
        assert got.shape == (math.prod(shape),)
        assert torch.equal(got, (expert.float() - base.float()).abs().reshape(-1))
        delta = (expert.float() - base.float()).to(torch.float16)
        got = workspace.abs_delta(workspace.buffer("again", math.prod(shape)), delta, None)
        assert torch.equal(got, delta.float().abs().reshape(-1))


def whole_pass(t, blocks, flags, abs_delta):
    """A tensor pass fed its whole |Δ| at once (as a LoRA tensor's ΔW is)."""
    work = TensorPass(t, blocks, "'e' against 'b'", Workspace())

    def values(a, b):
        return abs_delta[work.starts[a] : work.starts[b]]

    work.add(0, flags, values)
    return work.result(values)


def test_a_whole_tensor_pass_matches_plain_torch():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(20, 8, generator=g)
    expert = base.clone()
    expert[9:14] += torch.randn(5, 8, generator=g) * 0.1  # rows of blocks 1 and 2 only
    t, blocks = tensor_and_blocks((20, 8), "F32", rows_per_block=6)
    flags = [torch.equal(base[b.row_start : b.row_end], expert[b.row_start : b.row_end]) for b in blocks]
    assert flags == [True, False, False, True]
    abs_delta = (expert - base).abs().reshape(-1)
    deltas, tensor_stats = whole_pass(t, blocks, flags, abs_delta)
    for d, b, same in zip(deltas, blocks, flags):
        part = (expert - base)[b.row_start : b.row_end].reshape(-1)
        assert (d.tensor, d.index, d.identical) == ("w", b.index, same)
        assert d.maxabs == float(part.abs().max())
        assert d.nnz == int((part != 0).sum())
        assert d.l2 == pytest.approx(float(torch.linalg.vector_norm(part)), rel=1e-6)
    assert (tensor_stats.numel, tensor_stats.mergeable, tensor_stats.identical) == (160, True, False)
    for density, thr in tensor_stats.thresholds.items():
        assert (thr.k, thr.tau, thr.last_index) == reference_thresholds(abs_delta, density)
    assert sorted(tensor_stats.thresholds) == sorted(DENSITY_GRID)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_tensor_pass_refuses_non_finite(bad):
    t, blocks = tensor_and_blocks((4, 4), "F32", rows_per_block=2)
    abs_delta = torch.zeros(16)
    abs_delta[9] = bad
    with pytest.raises(CatalogError, match=r"cannot analyse 'e' against 'b': tensor 'w' has a NaN or infinite"):
        whole_pass(t, blocks, [True, False], abs_delta)


@pytest.mark.parametrize(
    "dtype, flags",
    [("BF16", [True, True, True]), ("I64", [True, False, True]), ("I64", [True, True, True])],
)
def test_from_hashes(dtype, flags):
    t, blocks = tensor_and_blocks((9, 2), dtype, rows_per_block=3)
    deltas, tensor_stats = from_hashes(t, blocks, flags)
    for d, same in zip(deltas, flags):
        expected = (0.0, 0.0, 0) if same else (None, None, None)
        assert (d.identical, (d.l2, d.maxabs, d.nnz)) == (same, expected)
    assert tensor_stats.identical == all(flags)
    assert tensor_stats.mergeable == (dtype == "BF16")
    if dtype == "BF16":
        zeros = torch.zeros(18)
        assert {d: (x.k, x.tau, x.last_index) for d, x in tensor_stats.thresholds.items()} == {
            d: reference_thresholds(zeros, d) for d in DENSITY_GRID
        }
    else:
        assert tensor_stats.thresholds == {}


def bf16_pair(shape: tuple[int, ...], seed: int, changed_rows: list[range]):
    """A bf16 base and an expert that differs from it only on ``changed_rows``."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    expert = base.clone()
    for rows in changed_rows:
        part = base[rows.start : rows.stop].float()
        expert[rows.start : rows.stop] = (part + torch.randn(part.shape, generator=g) * 3e-4).to(torch.bfloat16)
    return base, expert


@pytest.mark.parametrize("window_blocks", [1, 2, 3, 100])
def test_tensor_pass_by_windows_equals_plain_torch(window_blocks):
    """Statistics of every block and thresholds of the tensor, fed a few blocks at a time with unchanged
    blocks never converted, equal plain torch on the whole tensor (bit for bit)."""
    shape, rows_per_block = (37, 96), 4
    base, expert = bf16_pair(shape, 3, [range(0, 3), range(9, 21), range(36, 37)])
    t, blocks = tensor_and_blocks(shape, "BF16", rows_per_block)
    flags = [torch.equal(base[b.row_start : b.row_end], expert[b.row_start : b.row_end]) for b in blocks]
    assert not all(flags) and any(flags)
    workspace = Workspace()
    work = stats.TensorPass(t, blocks, "'e' against 'b'", workspace)
    flat_e, flat_b = expert.reshape(-1), base.reshape(-1)
    asked = []

    def values(a: int, b: int) -> torch.Tensor:
        asked.append((a, b))
        lo, hi = work.starts[a], work.starts[b]
        return workspace.abs_delta(workspace.buffer("again", hi - lo), flat_e[lo:hi], flat_b[lo:hi])

    for lo in range(0, len(blocks), window_blocks):
        work.add(lo, flags[lo : lo + window_blocks], values)
    assert all(not any(flags[a:b]) for a, b in asked)  # unchanged blocks are never asked for
    deltas, tensor_stats = work.result(values)
    delta = (expert.float() - base.float()).abs()
    for d, b, same in zip(deltas, blocks, flags):
        part = delta[b.row_start : b.row_end].reshape(-1)
        assert (d.index, d.identical) == (b.index, same)
        assert (d.l2, d.maxabs, d.nnz) == (float(torch.linalg.vector_norm(part)), float(part.max()),
                                           int((part != 0).sum()))
    assert tensor_stats.identical is False
    for density, thr in tensor_stats.thresholds.items():
        assert (thr.k, thr.tau, thr.last_index) == reference_thresholds(delta.reshape(-1), density)


def test_tensor_pass_of_unchanged_blocks_only_equals_from_hashes():
    t, blocks = tensor_and_blocks((300, 300), "BF16", rows_per_block=64)
    work = stats.TensorPass(t, blocks, "'e' against 'b'", Workspace())
    work.add(0, [True] * 3, lambda a, b: pytest.fail("values of unchanged blocks"))
    work.add(3, [True] * 2, lambda a, b: pytest.fail("values of unchanged blocks"))
    assert work.result(lambda a, b: pytest.fail("a second look at zeros")) == from_hashes(t, blocks, [True] * 5)


def test_tensor_pass_refuses_a_nan_in_a_later_window():
    t, blocks = tensor_and_blocks((8, 4), "F32", rows_per_block=2)
    work = stats.TensorPass(t, blocks, "'e' against 'b'", Workspace())
    values = torch.zeros(32)
    values[21] = float("nan")  # block 2: the second window
    work.add(0, [False, False], lambda a, b: values[work.starts[a] : work.starts[b]])
    with pytest.raises(CatalogError, match=r"cannot analyse 'e' against 'b': tensor 'w' has a NaN"):
        work.add(2, [False, False], lambda a, b: values[work.starts[a] : work.starts[b]])
