"""The order of a delta store's entries: largest |Δ| first, equal ones by position, whole or by bands."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mergepipe.analysis import store_order
from mergepipe.analysis.store_order import (
    exact_counts,
    histogram,
    in_order,
    magnitude_bits,
    oversized,
    plan_bands,
)


def largest_first(values: np.ndarray) -> np.ndarray:
    """The store order of the non-zero entries of ``values``, from ``in_order`` (as a build calls it)."""
    positions = np.flatnonzero(values)
    parts = [p for p, _ in in_order(magnitude_bits(values[positions]), positions, len(values), 7)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _reference_order(values: np.ndarray) -> list[int]:
    """Non-zero positions by descending |v| (every NaN alike and largest), equal ones by position: in Python."""
    def magnitude(i):
        v = abs(float(values[i]))
        return math.inf if math.isnan(v) else v  # NaN first; inf next (ties with NaN broken below)
    nonzero = [i for i in range(len(values)) if values[i] != 0 or math.isnan(values[i])]
    return sorted(nonzero, key=lambda i: (not math.isnan(values[i]), -magnitude(i), i))


ADVERSARIAL = {
    "empty": [],
    "one element": [0.5],
    "one zero": [0.0],
    "all equal": [0.25] * 9,
    "signed ties and zeros": [0.0, -1.0, 1.0, -0.0, 0.5, -0.5, 0.0, 1.0, -2.0],
    "extremes": [1e-45, -1e-45, 3.4e38, -3.4e38, 1e-38, float("inf"), -float("inf"), 2.0],
    "nans": [1.0, float("nan"), -float("nan"), float("inf"), 0.0, float("nan")],
}


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_largest_first_orders_entries_as_a_stable_descending_sort_of_magnitudes(case, narrow, monkeypatch):
    if narrow:  # the fallback for positions too wide to share a key with the magnitude
        monkeypatch.setattr(store_order, "_KEY_BITS", 31)
    values = np.array(ADVERSARIAL[case], dtype=np.float32)
    if case == "nans":
        values.view(np.int32)[5] = 0x7FC00123  # another NaN payload: NaNs are alike all the same
    assert largest_first(values).tolist() == _reference_order(values)


def test_largest_first_on_many_bf16_like_ties_matches_the_torch_stable_sort():
    gen = torch.Generator().manual_seed(3)
    delta = (torch.randn(200_003, generator=gen) * 1e-3).to(torch.bfloat16).float()
    delta[torch.rand(200_003, generator=gen) < 0.3] = 0
    nonzero = torch.nonzero(delta).flatten()
    reference = nonzero[torch.sort(delta[nonzero].abs(), descending=True, stable=True).indices]
    assert np.array_equal(largest_first(delta.numpy()), reference.numpy())


@pytest.mark.parametrize("case", [c for c in ADVERSARIAL if ADVERSARIAL[c]])
def test_in_order_gives_the_order_a_slice_at_a_time_with_each_entry_s_magnitude_bits(case):
    values = np.array(ADVERSARIAL[case], dtype=np.float32)
    positions = np.flatnonzero(values)
    parts = list(in_order(magnitude_bits(values[positions]), positions, len(values), 2))
    assert all(len(p) <= 2 for p, _ in parts)
    chosen = np.concatenate([p for p, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
    assert chosen.tolist() == _reference_order(values)
    for p, bits in parts:  # the bits of |v| (one NaN pattern), as an independent view computes them
        expected = [0x7FC00000 if math.isnan(values[i]) else int(np.abs(values[i:i + 1]).view(np.int32)[0])
                    for i in p]
        assert bits.tolist() == expected


def _bf16_like(count: int, seed: int, zeros: float = 0.3) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    delta = (torch.randn(count, generator=gen) * 1e-3).to(torch.bfloat16).float()
    delta[torch.rand(count, generator=gen) < zeros] = 0
    return delta.numpy()


@pytest.mark.parametrize("cap", [1, 50, 997, 10**9])
def test_bands_cover_every_entry_once_in_descending_order_within_the_cap(cap):
    values = _bf16_like(20_000, 5)
    values[:3000:3] = 0.125  # one magnitude held by 1000 entries: more than most caps, so it is streamed
    bits = magnitude_bits(values)
    counts = histogram(bits)
    assert counts.sum() == np.count_nonzero(values)
    big = oversized(counts, cap)
    exact = dict(zip(big.tolist(), exact_counts(bits, big)))
    bands = plan_bands(counts, exact, cap)
    for band in bands:  # counted here, from the values alone
        inside = (bits >= band.low) & (bits <= band.high)
        assert band.count == int(inside.sum()) > 0
        assert band.count <= cap or band.low == band.high
    assert all(a.low > b.high for a, b in zip(bands, bands[1:]))  # descending, disjoint
    assert sum(b.count for b in bands) == np.count_nonzero(values)
    order = []  # each band sorted on its own, bands in turn: the whole order
    for band in bands:
        where = np.flatnonzero((bits >= band.low) & (bits <= band.high))
        order += np.concatenate([p for p, _ in in_order(bits[where], where, len(bits), 64)]).tolist()
    assert order == _reference_order(values)


def test_a_single_magnitude_over_the_cap_is_one_streamed_band():
    values = np.full(100, -0.5, dtype=np.float32)
    values[7] = 0.75
    bits = magnitude_bits(values)
    counts = histogram(bits)
    big = oversized(counts, 10)
    bands = plan_bands(counts, dict(zip(big.tolist(), exact_counts(bits, big))), 10)
    half = int(np.array([0.5], dtype=np.float32).view(np.int32)[0])
    assert [(b.count, b.streamed) for b in bands] == [(1, False), (99, True)]
    assert bands[1].low == bands[1].high == half


@pytest.mark.parametrize("case", [c for c in ADVERSARIAL if ADVERSARIAL[c]])
def test_in_order_of_indices_sorts_entries_listed_in_position_order_as_their_positions(case):
    values = np.array(ADVERSARIAL[case], dtype=np.float32)
    positions = np.flatnonzero(values)  # the band's entries, in position order
    parts = in_order(magnitude_bits(values[positions]), None, len(positions), 3)
    chosen = [int(positions[i]) for p, _ in parts for i in p]
    assert chosen == _reference_order(values)
