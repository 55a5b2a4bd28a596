"""``linear`` with the base among the averaged models (``base_weight``): mergekit's Σ wi Mi / Σw, or Σ wi Mi
without ``normalize``, over the models Mi = B + Δi with M0 = B, against a float64 reference written from that
formula (not from the package's coefficients)."""

from __future__ import annotations

import pytest
import torch

from mergepipe.spec.operators.kernels import merge
from tests.spec.operators.table import context, make_inputs, params_for, run_blocks

IDS = ["a", "b", "c"]


def mergekit_linear(base: torch.Tensor, deltas: list[torch.Tensor | None], weights: list[float], base_weight: float,
                    normalize: bool) -> torch.Tensor:
    """Σ wi Mi (/ Σw) in float64 over [B, B + Δ1, ...]: the base is the first model; an unread Δ is 0."""
    models = [base.double()] + [base.double() + (0 if d is None else d.double()) for d in deltas]
    every = [base_weight, *weights]
    total = sum(w * m for w, m in zip(every, models))
    return total / sum(every) if normalize else total


def close(got: torch.Tensor, want: torch.Tensor, steps: int = 4) -> None:
    """Within ``steps`` float32 steps of the largest magnitude."""
    step = 2.0**-23 * max(float(want.abs().max()), 1e-30)
    assert float((got.double() - want).abs().max()) <= steps * step


@pytest.mark.parametrize("shape", [(29, 17), (40,), (3, 5, 2)], ids=str)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("base_weight", [0.0, 0.4, 2.5])
def test_linear_with_a_base_weight_is_mergekits_weighted_mean_of_the_models(shape, normalize, base_weight):
    weights = [1.0, 0.3, 0.7]
    base, deltas = make_inputs(shape, 3, seed=5, scale=0.3, quantize=False)
    params = params_for("linear", [{"weight": w} for w in weights], {"normalize": normalize,
                                                                      "base_weight": base_weight}, IDS)
    got = merge(base, list(deltas), context("linear", shape, IDS, params))
    close(got, mergekit_linear(base, deltas, weights, base_weight, normalize))


def test_an_unread_block_is_delta_zero_and_the_base_weight_stays_in_the_sum():
    base, deltas = make_inputs((24, 9), 2, seed=7, scale=0.3, quantize=False)
    params = params_for("linear", [{"weight": 1.0}, {"weight": 3.0}], {"base_weight": 2.0}, IDS[:2])
    ctx = context("linear", (24, 9), IDS[:2], params)
    got = run_blocks(base, deltas, ctx, rows_per_block=8, unread=frozenset({(1, 1)}))
    partial = deltas[1].clone()
    partial[8:16] = 0
    close(got, mergekit_linear(base, [deltas[0], partial], [1.0, 3.0], 2.0, True))


def test_expert_order_does_not_change_the_bits():
    base, deltas = make_inputs((31, 6), 3, seed=9, scale=0.3, quantize=False)
    settings = [{"weight": 0.2}, {"weight": 1.3}, {"weight": 0.6}]
    outs = []
    for order in ([0, 1, 2], [2, 0, 1]):
        ids = [IDS[i] for i in order]
        params = params_for("linear", [settings[i] for i in order], {"base_weight": 0.9, "normalize": False}, ids)
        outs.append(merge(base, [deltas[i] for i in order], context("linear", (31, 6), ids, params)))
    assert torch.equal(outs[0], outs[1])
