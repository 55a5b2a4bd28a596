"""Sketch stages computed in fp32 passes give the bits of the stage as defined (``_stage_as_defined``)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from mergepipe.analysis import deltastore as sketch
from mergepipe.analysis.deltastore import Sketcher, SketchBuffers, _stage, _stage_as_defined

F32_MAX = float(np.finfo(np.float32).max)


def _adversarial_rows(cols: int, seed: int) -> torch.Tensor:
    """Rows of residuals that probe the fp32 threshold: wide and narrow magnitudes, entries equal to half the
    row's mean, subnormals, values near the fp32 maximum, zeros and -0, rows of one or no non-zero entry."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(cols, generator=gen) * torch.exp(torch.randn(cols, generator=gen) * 6) for _ in range(40)]
    rows += [(torch.randn(cols, generator=gen) * 1e-3).to(torch.bfloat16).float() for _ in range(20)]
    rows += [torch.randint(-3, 4, (cols,), generator=gen).float() * 2.0**-20 for _ in range(20)]  # many ties
    tie = torch.zeros(cols)
    tie[:2] = torch.tensor([3.0, -1.0])[:cols]  # mean 2: |-1| is exactly half of it, and not kept
    rows += [tie, torch.zeros(cols), -torch.zeros(cols), torch.full((cols,), 1e-45),
             torch.full((cols,), -F32_MAX), torch.randn(cols, generator=gen) * 1e-39]
    one = torch.zeros(cols)
    one[cols // 2] = -0.25
    rows.append(one)
    out = torch.stack(rows)
    out[torch.rand(out.shape, generator=gen) < 0.2] = 0.0
    return out


def _as_defined_stage(residual, work):
    return (*_stage_as_defined(residual), False)


@pytest.mark.parametrize("cols", [1, 5, 37, 640])
def test_a_finite_stage_in_fp32_passes_is_the_stage_as_defined_bit_for_bit(cols):
    for seed in range(3):
        residual = _adversarial_rows(cols, seed)
        work = SketchBuffers().rows(*residual.shape)
        q, scale, finite = _stage(residual, work)
        q_ref, scale_ref = _stage_as_defined(residual)
        assert finite
        assert torch.equal(q, q_ref)
        assert torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32))  # -0 and +0 apart


def test_row_counts_past_fp32_s_exact_integers_are_counted_in_float64(monkeypatch):
    monkeypatch.setattr(sketch, "_COUNT_EXACT", 4)  # as a row of 2^24 entries or more would
    residual = _adversarial_rows(37, 7)
    q, scale, _ = _stage(residual, SketchBuffers().rows(*residual.shape))
    q_ref, scale_ref = _stage_as_defined(residual)
    assert torch.equal(q, q_ref) and torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_residual_with_nan_or_inf_is_staged_as_defined(bad):
    residual = _adversarial_rows(37, 1)
    residual[3, 4] = bad
    q, scale, finite = _stage(residual, SketchBuffers().rows(*residual.shape))
    q_ref, scale_ref = _stage_as_defined(residual)
    assert not finite
    assert torch.equal(q, q_ref) and torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32))


def _sketch(delta: torch.Tensor) -> list[sketch.SketchStage]:
    sketcher = Sketcher(tuple(delta.shape))
    for rows in delta.split(7) if delta.dim() >= 2 else [delta]:  # fed in runs, as a banded build does
        sketcher.add(rows)
    return sketcher.finish()


@pytest.mark.parametrize("shape", [(1,), (4099,), (93, 37), (300, 640), (2, 3, 5)])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_a_sketch_is_the_same_bytes_and_energies_as_one_of_stages_as_defined(shape, bad, monkeypatch):
    monkeypatch.setattr(sketch, "GROUP_ELEMENTS", 3000)  # several row groups, the last one shorter
    gen = torch.Generator().manual_seed(sum(shape))
    delta = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    delta[torch.rand(shape, generator=gen) < 0.3] = 0.0
    if bad is not None:
        delta.view(-1)[len(delta.view(-1)) // 2] = bad
    fast = _sketch(delta)
    monkeypatch.setattr(sketch, "_stage", _as_defined_stage)
    defined = _sketch(delta)
    assert [s.payload for s in fast] == [s.payload for s in defined]
    assert [_bits(s.residual, s.norm) for s in fast] == [_bits(s.residual, s.norm) for s in defined]


def _bits(*values: float) -> bytes:
    """The float64 bits of ``values`` (NaNs compare equal by bits, unlike floats)."""
    return struct.pack(f"<{len(values)}d", *values)
