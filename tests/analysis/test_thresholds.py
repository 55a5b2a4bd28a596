"""trim_thresholds/keep_mask equal a stable descending sort, block by block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.analysis.thresholds import (
    _SCAN_CHUNK,
    SORT_BELOW,
    keep_mask,
    trim_thresholds,
)
from mergepipe.spec.thresholds import DENSITY_GRID, TrimThreshold


def reference_keep(abs_flat: torch.Tensor, density: float) -> torch.Tensor:
    """Plain definition: the first k of a stable descending sort."""
    n = abs_flat.numel()
    k = max(1, int(density * n))
    order = torch.sort(abs_flat, descending=True, stable=True).indices
    kept = torch.zeros(n, dtype=torch.bool)
    kept[order[:k]] = True
    return kept


def make_values(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":  # a handful of distinct values: many exact ties
        return torch.randint(0, 4, (n,), generator=gen).float() * 0.5
    if kind == "bf16":  # bf16 spacing: ties as real checkpoints have
        return torch.randn(n, generator=gen).abs().to(torch.bfloat16).float()
    if kind == "sparse":  # most entries exactly zero, as bf16 deltas are
        values = torch.randn(n, generator=gen).abs() * 1e-3
        return values * (torch.rand(n, generator=gen) < 0.2)
    return torch.randn(n, generator=gen).abs() * 1e-3


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["ties", "bf16", "smooth", "sparse"]),
    n=st.integers(1, 2000),
    seed=st.integers(0, 2**16),
    cuts=st.lists(st.integers(1, 300), min_size=1, max_size=12),
)
def test_blockwise_keep_equals_stable_sort(kind, n, seed, cuts):
    values = make_values(kind, n, seed)
    densities = list(DENSITY_GRID) + [1.0, 0.333]
    for density, thr in zip(densities, trim_thresholds(values, densities)):
        expected = reference_keep(values, density)
        pieces, start, i = [], 0, 0
        while start < n:
            end = min(n, start + cuts[i % len(cuts)])
            pieces.append(keep_mask(values[start:end], start, thr))
            start, i = end, i + 1
        got = torch.cat(pieces)
        assert torch.equal(got, expected)
        assert int(got.sum()) == thr.k == max(1, int(density * n))


def test_tau_is_kth_largest_and_mask_works_on_2d_blocks():
    values = make_values("bf16", 64 * 10, 3)
    (thr,) = trim_thresholds(values, [0.2])
    assert thr.tau == torch.sort(values, descending=True).values[thr.k - 1].item()
    as_rows = values.view(10, 64)
    mask = torch.cat([keep_mask(as_rows[r : r + 3], r * 64, thr) for r in range(0, 10, 3)])
    assert torch.equal(mask.flatten(), reference_keep(values, 0.2))


def test_empty_tensor_keeps_nothing():
    (thr,) = trim_thresholds(torch.zeros(0), [0.5])
    assert thr.k == 0 and thr.last_index == -1


def test_all_zero_deltas_keep_first_k_by_position():
    (thr,) = trim_thresholds(torch.zeros(10), [0.3])
    assert (thr.tau, thr.k, thr.last_index) == (0.0, 3, 2)


def test_json_round_trip():
    thr = TrimThreshold(0.5, 7, 0.0011, 42)
    assert TrimThreshold.from_json(thr.to_json()) == thr


def test_rejects_wrong_dtype():
    with pytest.raises(ValueError):
        trim_thresholds(torch.zeros(4, dtype=torch.float64), [0.5])


@pytest.mark.parametrize("kind", ["ties", "bf16", "smooth", "sparse"])
def test_histogram_path_on_large_tensors(kind):
    """Above SORT_BELOW entries the radix select runs; it must agree too."""
    n = SORT_BELOW * 3 + 17
    values = make_values(kind, n, 7)
    densities = [0.01, 0.1, 0.5, 0.9, 1.0]
    for density, thr in zip(densities, trim_thresholds(values, densities)):
        expected = reference_keep(values, density)
        got = torch.cat([keep_mask(values[s : s + 5000], s, thr) for s in range(0, n, 5000)])
        assert torch.equal(got, expected)


def test_zero_cuts_spanning_several_scan_chunks():
    """Cuts that fall on exact zeros are located chunk by chunk; check a
    tensor several chunks long against the stable sort."""
    n = 2 * _SCAN_CHUNK + 12345
    values = make_values("sparse", n, 11)
    order = torch.sort(values, descending=True, stable=True).indices
    for density, thr in zip([0.5, 0.9, 1.0], trim_thresholds(values, [0.5, 0.9, 1.0])):
        assert thr.tau == 0.0
        assert thr.last_index == int(order[thr.k - 1])
