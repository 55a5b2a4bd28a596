"""trim_thresholds/keep_mask, and the streaming selector under them, equal a stable descending sort."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.analysis import stats as topk
from mergepipe.analysis.stats import PIECE, SORT_BELOW, trim_thresholds
from mergepipe.spec.operators.kernels import keep_mask, trimmed
from mergepipe.analysis.stats import ThresholdSelector
from mergepipe.spec.operators import DENSITY_GRID, TrimThreshold


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
        assert_trimmed_pieces_keep(values, thr, expected, cuts, seed)


def assert_trimmed_pieces_keep(values, thr, expected, cuts, seed):
    """``trimmed`` (the engine's one-pass trim) of signed blocks keeps exactly
    the reference's entries, with their values, whatever the cuts."""
    signs = torch.randint(0, 2, values.shape, generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    signed = values * signs
    pieces, start, i = [], 0, 0
    while start < values.numel():
        end = min(values.numel(), start + cuts[i % len(cuts)])
        pieces.append(trimmed(signed[start:end], start, thr))
        start, i = end, i + 1
    got = torch.cat(pieces)
    assert torch.equal(got, torch.where(expected, signed, 0.0))


@pytest.mark.parametrize("kind", ["ties", "sparse"])
def test_trimmed_when_the_tie_index_is_inside_before_or_after_a_block(kind):
    values = make_values(kind, 999, 5)
    (thr,) = trim_thresholds(values, [0.3])
    expected = reference_keep(values, 0.3)
    p = thr.last_index
    for cuts in ([p, 999], [p + 1, 999], [max(1, p - 3), 7, 999], [999]):  # p last, first, inside, whole
        assert_trimmed_pieces_keep(values, thr, expected, cuts, 11)


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


def test_zero_cuts_spanning_several_pieces():
    """Cuts that fall on exact zeros are located piece by piece; check a
    tensor several pieces long against the stable sort."""
    n = 2 * PIECE + 12345
    values = make_values("sparse", n, 11)
    order = torch.sort(values, descending=True, stable=True).indices
    for density, thr in zip([0.5, 0.9, 1.0], trim_thresholds(values, [0.5, 0.9, 1.0])):
        assert thr.tau == 0.0
        assert thr.last_index == int(order[thr.k - 1])


# ------------------------------------------- the streaming selector (topk.py): windows, pieces, zero runs


def stable_sort_reference(values: torch.Tensor, density: float) -> tuple[int, float, int]:
    """(k, tau, p) by definition: the k-th entry of a stable descending sort (ties by position)."""
    n = values.numel()
    k = max(1, int(density * n))
    sorted_values, order = torch.sort(values, descending=True, stable=True)
    return k, float(sorted_values[k - 1]), int(order[k - 1])


def adversarial(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    if kind == "all equal":
        return torch.full((n,), 0.125)
    if kind == "all zero":
        return torch.zeros(n)
    if kind == "many zeros":  # a bf16-like delta: most entries exactly 0
        return torch.randn(n, generator=gen).abs() * (torch.rand(n, generator=gen) < 0.03)
    if kind == "denormals":  # below the smallest normal, some zeros among them
        return torch.randint(0, 1 << 20, (n,), generator=gen, dtype=torch.int32).view(torch.float32)
    if kind == "extremes":  # max float, the smallest normal and denormal, zeros, ordinary values
        choices = torch.tensor([big, big, tiny, 1.4e-45, 0.0, 1.0, 3e-3])
        return choices[torch.randint(0, len(choices), (n,), generator=gen)]
    if kind == "bf16 delta":  # |fp32(E) - fp32(B)| of bf16 weights: pure values, a few crossing binades
        base = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
        expert = (base.float() + torch.randn(n, generator=gen) * 2e-4).to(torch.bfloat16)
        return (expert.float() - base.float()).abs()
    return torch.randn(n, generator=gen).abs() * 1e-3  # fp32: every entry has low bits


KINDS = ["all equal", "all zero", "many zeros", "denormals", "extremes", "bf16 delta", "fp32 delta"]


def selector_thresholds(values: torch.Tensor, cuts: list[int], densities) -> list:
    """Feed ``values`` to a selector in windows cut at ``cuts`` (all-zero windows as zero runs) and ask
    for windows again by copies, as analysis does after a window left memory."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < values.numel())), values.numel()]
    selector = ThresholdSelector(values.numel(), densities)
    runs = []
    for lo, hi in zip(bounds, bounds[1:]):
        if bool((values[lo:hi] == 0).all()) and lo % 2:  # some zero windows arrive without values
            selector.add_zeros(lo, hi - lo)
        else:
            selector.add(lo, values[lo:hi].clone())
        runs.append(lo)

    def values_of(run: int, lo: int, hi: int) -> torch.Tensor:
        return values[runs[run] + lo : runs[run] + hi].clone()

    return selector.thresholds(values_of)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 64 entries and the histogram path from 16 entries: every structure on small tensors."""
    monkeypatch.setattr(topk, "PIECE", 64)
    monkeypatch.setattr(topk, "_COUNT_SPAN", 3 * 64)
    monkeypatch.setattr(topk, "SORT_BELOW", 16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 1000, 4097])
def test_selector_equals_a_stable_sort_on_adversarial_inputs(small_pieces, kind, n):
    values = adversarial(kind, n, n)
    densities = [*DENSITY_GRID, 1.0, 0.333]
    gen = torch.Generator().manual_seed(n)
    cuts = torch.randint(0, max(1, n), (5,), generator=gen).tolist()
    for density, thr in zip(densities, selector_thresholds(values, cuts, densities)):
        assert (thr.k, thr.tau, thr.last_index) == stable_sort_reference(values, density), (kind, density)


@pytest.mark.parametrize("kind", ["all equal", "bf16 delta", "fp32 delta", "many zeros"])
@pytest.mark.parametrize("edge", ["first", "last"])
def test_kth_entry_on_a_window_edge(small_pieces, kind, edge):
    """Windows cut so that each density's k-th entry is the first (or last) entry of a window."""
    n = 3000
    values = adversarial(kind, n, 7)
    for density in DENSITY_GRID:
        _, _, position = stable_sort_reference(values, density)
        cut = position if edge == "first" else position + 1
        got = selector_thresholds(values, [cut, cut // 2, (cut + n) // 2], [density])
        assert [(t.k, t.tau, t.last_index) for t in got] == [stable_sort_reference(values, density)]


def test_large_tensor_through_the_default_pieces():
    """Several default pieces, zero runs between windows, impure (fp32) and pure (bf16) cuts."""
    n = 5 * PIECE + 321
    for kind in ("bf16 delta", "fp32 delta", "many zeros"):
        values = adversarial(kind, n, 3)
        values[PIECE : 2 * PIECE + 17] = 0.0
        cuts = [PIECE, 2 * PIECE + 17, 3 * PIECE - 1, 4 * PIECE + 5]
        for density, thr in zip(DENSITY_GRID, selector_thresholds(values, cuts, DENSITY_GRID)):
            assert (thr.k, thr.tau, thr.last_index) == stable_sort_reference(values, density), (kind, density)


def test_selector_refuses_gaps_and_missing_entries():
    selector = ThresholdSelector(10, [0.5])
    selector.add(0, torch.ones(4))
    with pytest.raises(ValueError, match="position order"):
        selector.add(5, torch.ones(5))
    with pytest.raises(ValueError, match="cover 4 of 10"):
        selector.thresholds(lambda run, lo, hi: torch.ones(hi - lo))


@pytest.mark.parametrize("cap", [1 << 22, 10])
def test_impure_entries_kept_then_collected(small_pieces, monkeypatch, cap):
    """A tensor whose first windows are bf16-like (few impure entries, kept from the first look) and whose
    last is fp32-like (most impure: collected in a second look, in batches under the cap)."""
    monkeypatch.setattr(topk, "_COLLECT_CAP", cap)
    values = torch.cat([adversarial("bf16 delta", 2000, 1), adversarial("fp32 delta", 1500, 2) * 1e-3])
    densities = [*DENSITY_GRID, 0.995, 1.0]
    for density, thr in zip(densities, selector_thresholds(values, [700, 1400, 2000, 2600], densities)):
        assert (thr.k, thr.tau, thr.last_index) == stable_sort_reference(values, density), density
