"""The order of a delta store's entries: largest |Δ| first, equal ones by position, whole or by bands."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mergepipe.analysis import deltastore as store_order
from mergepipe.analysis.deltastore import Histogram, exact_counts, in_chunks, magnitude_bits, plan_bands


def histogram(bits: np.ndarray) -> np.ndarray:
    scan = Histogram()
    scan.add(bits)
    return scan.counts


def oversized(counts: np.ndarray, cap: int) -> np.ndarray:
    """The buckets over a band of ``cap`` entries, whose exact counts ``plan_bands`` needs."""
    return np.flatnonzero(counts > cap)


def slices(values: np.ndarray, first: int = 7, size: int = 7, indices: bool = False) -> list[list[int]]:
    """The positions of the non-zero entries of ``values`` in each slice ``in_chunks`` gives (as a build calls
    it); with ``indices``, from the indices of the entries listed in position order."""
    positions = np.flatnonzero(values)
    bits = magnitude_bits(values[positions])
    if indices:
        return [positions[p].tolist() for p, _ in in_chunks(bits, None, first, size)]
    return [p.tolist() for p, _ in in_chunks(bits, positions, first, size)]


def cut_like_a_store(order: list[int], first: int = 7, size: int = 7) -> list[list[int]]:
    """``order`` cut into the first ``first`` entries, then ``size`` at a time, each slice in position order:
    what a store's chunks hold."""
    edges = [0, *range(first, len(order), size), len(order)] if order else [0]
    return [sorted(order[a:b]) for a, b in zip(edges, edges[1:])]


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


@pytest.mark.parametrize(("first", "size"), [(7, 7), (1, 3), (2, 2), (1, 1), (5, 100)])
@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_slices_hold_the_entries_of_a_stable_descending_sort_of_magnitudes_in_position_order(case, first, size):
    values = np.array(ADVERSARIAL[case], dtype=np.float32)
    if case == "nans":
        values.view(np.int32)[5] = 0x7FC00123  # another NaN payload: NaNs are alike all the same
    expected = cut_like_a_store(_reference_order(values), first, size)
    assert slices(values, first, size) == expected
    assert slices(values, first, size, indices=True) == expected


@pytest.mark.parametrize("fine", [False, True])
def test_slices_on_many_bf16_like_ties_match_the_torch_stable_sort(fine, monkeypatch):
    if fine:  # the finer buckets of a large set of entries
        monkeypatch.setattr(store_order, "_FINE_ENTRIES", 0)
    gen = torch.Generator().manual_seed(3)
    delta = (torch.randn(200_003, generator=gen) * 1e-3).to(torch.bfloat16).float()
    delta[torch.rand(200_003, generator=gen) < 0.3] = 0
    nonzero = torch.nonzero(delta).flatten()
    reference = nonzero[torch.sort(delta[nonzero].abs(), descending=True, stable=True).indices].tolist()
    for first, size in ((7, 7), (1000, 4096), (3, 50_000)):  # edges inside buckets of one and of many values
        assert slices(delta.numpy(), first, size) == cut_like_a_store(reference, first, size)


@pytest.mark.parametrize("fine", [False, True])
def test_slices_of_distinct_fp32_magnitudes_and_over_65536_slices(fine, monkeypatch):
    if fine:
        monkeypatch.setattr(store_order, "_FINE_ENTRIES", 0)
    gen = torch.Generator().manual_seed(4)
    delta = torch.randn(70_001, generator=gen) * torch.exp(torch.randn(70_001, generator=gen) * 4)
    delta[:70_000:5] = delta[1::5]  # some ties
    nonzero = torch.nonzero(delta).flatten()
    reference = nonzero[torch.sort(delta[nonzero].abs(), descending=True, stable=True).indices].tolist()
    assert slices(delta.numpy(), 1, 1) == [[p] for p in reference]  # 70,001 slices: two 16-bit digits
    assert slices(delta.numpy(), 9, 31) == cut_like_a_store(reference, 9, 31)


@pytest.mark.parametrize("case", [c for c in ADVERSARIAL if ADVERSARIAL[c]])
def test_in_chunks_gives_each_entry_s_magnitude_bits(case):
    values = np.array(ADVERSARIAL[case], dtype=np.float32)
    positions = np.flatnonzero(values)
    parts = list(in_chunks(magnitude_bits(values[positions]), positions, 1, 2))
    assert [len(p) for p, _ in parts][:1] == [1][: len(parts)] and all(len(p) <= 2 for p, _ in parts)
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
        order += [p for part, _ in in_chunks(bits[where], where, 1, 1) for p in part.tolist()]
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


def test_a_histogram_fed_window_by_window_knows_the_exact_counts_of_its_buckets_of_one_magnitude():
    values = _bf16_like(20_000, 11)
    one, other = np.float32(0.125), np.nextafter(np.float32(0.25), np.float32(1))  # 0.25's bucket, not 0.25
    values[100:20_000:97] = -one  # one magnitude in every window
    values[5000:5100] = 0.25  # a bucket of two magnitudes, met in different windows
    values[15_000:15_100] = other
    values[7000:7100:2], values[7001:7100:2] = 2.0, np.nextafter(np.float32(2), np.float32(3))  # in one window
    values[9000:9010] = np.float32(1e-44)  # subnormals share bucket 0 with the zeros
    bits = magnitude_bits(values)
    scan = Histogram()
    for start in range(0, len(bits), 4096):
        scan.add(bits[start : start + 4096].copy())
    assert np.array_equal(scan.counts, histogram(bits))
    present = np.flatnonzero(scan.counts)
    known, mixed = scan.exact(present)
    bucket = {v: int(magnitude_bits(np.array([v], dtype=np.float32))[0]) >> 15 for v in (one, 0.25, 2.0)}
    assert bucket[one] in known and {bucket[0.25], bucket[2.0], 0} <= set(mixed.tolist())
    for b in present.tolist():  # exact where known; a bucket is called mixed only if it is, or is bucket 0
        several = len(np.unique(bits[((bits >> 15) == b) & (bits > 0)])) > 1
        if b in known:
            assert np.array_equal(known[b], exact_counts(bits, np.array([b]))[0])
        else:
            assert several or b == 0
