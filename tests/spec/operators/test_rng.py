"""Counter-based random numbers: a pure function of (seed, expert, tensor, index)."""

from __future__ import annotations

from itertools import pairwise

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.spec.operators.base import ElementRng


def uniform(rng: ElementRng, start: int, count: int) -> torch.Tensor:
    """The documented uniforms: 53 random bits times 2**-53."""
    return rng.bits(start, count).to(torch.float64) * 2.0**-53


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(0, 10_000),
    cuts=st.lists(st.integers(0, 300), min_size=0, max_size=6),
    total=st.integers(0, 300),
)
def test_a_range_equals_its_sub_ranges_concatenated(start, cuts, total):
    rng = ElementRng(7, "expert", "tensor")
    whole = uniform(rng, start, total)
    points = sorted({0, total, *[c for c in cuts if c <= total]})
    parts = [uniform(rng, start + a, b - a) for a, b in pairwise(points)]
    joined = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    assert torch.equal(joined, whole)


def test_uniform_values_and_type():
    u = uniform(ElementRng(0, "e", "t"), 3, 100_000)
    assert u.dtype == torch.float64 and u.shape == (100_000,)
    assert (u >= 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    # 53 random bits: values are multiples of 2**-53
    assert torch.equal(u * 2.0**53, torch.round(u * 2.0**53))


def test_streams_differ_by_seed_expert_and_tensor():
    a = uniform(ElementRng(1, "e1", "w"), 0, 64)
    for other in (ElementRng(2, "e1", "w"), ElementRng(1, "e2", "w"), ElementRng(1, "e1", "w2")):
        assert not torch.equal(a, uniform(other, 0, 64))
    assert torch.equal(a, uniform(ElementRng(1, "e1", "w"), 0, 64))


def test_key_fields_do_not_run_together():
    assert not torch.equal(uniform(ElementRng(1, "ab", "c"), 0, 8), uniform(ElementRng(1, "a", "bc"), 0, 8))


def test_pinned_values():
    """The stream is part of the on-disk meaning of a merge: pin it."""
    u = uniform(ElementRng(0, "expert", "model.layers.0.mlp.up_proj.weight"), 0, 3)
    assert u.tolist() == PINNED


PINNED = [0.4531643710679414, 0.4570868267866769, 0.6423644892830841]
