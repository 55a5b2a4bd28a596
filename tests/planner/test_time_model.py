"""The time model (planner/planner.py): a least-squares fit of past merges shrunk toward a prior.

References are computed here independently: the plain relative least squares of the same rows by
``numpy.linalg.lstsq``, the objective's gradient by finite differences, the prior and the uncertainty by
hand, and synthetic histories drawn from known coefficients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mergepipe.planner import planner as seconds_module
from mergepipe.catalog.records import Timing
from mergepipe.spec.plan import Plan, Prediction, describe
from mergepipe.planner.planner import (
    PRIOR_FIXED_SECONDS,
    PRIOR_SPREAD,
    UNMEASURED_READ_RATE,
    Prior,
    TimeModel,
    fit,
)
from tests.spec.test_plan_json import make_plan

#: A machine where a merge costs 0.05 s, 2.4 ns per expert byte and 1.6 ns per output byte.
TRUE = np.array([0.05, 2.4e-9, 1.6e-9])
PRIOR = Prior(0.1, 3e-9, 2e-9)


def history(n: int, noise: float = 0.0, seed: int = 0, true: np.ndarray = TRUE) -> list[Timing]:
    """``n`` merges of varied shapes (10% to 100% budgets, small and large outputs) timed on ``true``, each off by
    a relative ``noise`` (normal)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        output = int(rng.choice([80e6, 1.2e9, 3e9]))
        experts = int(output * rng.uniform(0.1, 8.0))
        rows.append(Timing(experts, output, float(true @ [1, experts, output]) * (1 + noise * rng.standard_normal())))
    return rows


def objective(prior: Prior, rows: list[Timing], delta: np.ndarray) -> float:
    """What ``fit`` minimises (its docstring), computed directly."""
    coefficients = prior.coefficients * np.exp(delta)
    misses = [(t.seconds - coefficients @ [1, t.expert_bytes, t.output_bytes]) / t.seconds for t in rows]
    return float(np.sum(np.square(misses)) + (seconds_module.NOISE / prior.spread) ** 2 * np.sum(delta**2))


def test_with_no_history_the_prior_predicts_with_its_spread():
    model = fit(PRIOR, [])
    assert model.coefficients == (0.1, 3e-9, 2e-9) and model.merges == 0
    assert model.uncertainty == PRIOR_SPREAD
    assert model.seconds(10**9, 2 * 10**9) == pytest.approx(0.1 + 3.0 + 4.0)


def test_the_prior_prices_a_read_at_analysis_rate_and_adds_the_kernel_per_expert_byte():
    prior = Prior.measured(read_bytes_per_second=400e6, kernel_seconds_per_element=3e-9, element_bytes=2)
    assert prior.fixed_seconds == PRIOR_FIXED_SECONDS and prior.spread == PRIOR_SPREAD
    assert prior.seconds_per_expert_byte == pytest.approx(1 / 400e6 + 1.5e-9)
    assert prior.seconds_per_output_byte == pytest.approx(1 / 400e6)
    unmeasured = Prior.measured(None, None, 4)
    assert unmeasured.seconds_per_expert_byte == unmeasured.seconds_per_output_byte == pytest.approx(
        1 / UNMEASURED_READ_RATE)
    assert unmeasured.spread == 2 * PRIOR_SPREAD


def test_without_the_penalty_the_fit_is_the_relative_least_squares_of_its_rows(monkeypatch):
    monkeypatch.setattr(seconds_module, "NOISE", 1e-7)  # a prior worth nothing
    rows = history(40, noise=0.1, seed=3)
    x = np.array([(1.0, t.expert_bytes, t.output_bytes) for t in rows])
    y = np.array([t.seconds for t in rows])
    scale = np.array([1.0, 1e-9, 1e-9])  # columns of similar size for lstsq
    reference = np.linalg.lstsq(x * scale / y[:, None], np.ones(len(y)), rcond=None)[0] * scale
    assert np.allclose(fit(PRIOR, rows).coefficients, reference, rtol=1e-5)


def test_the_fit_minimises_its_objective():
    """The penalty on: the fitted δ is a stationary point of the objective (central differences)."""
    rows = history(5, noise=0.1, seed=4)
    model = fit(PRIOR, rows)
    delta = np.log(np.array(model.coefficients) / PRIOR.coefficients)
    for j in range(3):
        step = np.eye(3)[j] * 1e-5
        gradient = (objective(PRIOR, rows, delta + step) - objective(PRIOR, rows, delta - step)) / 2e-5
        assert abs(gradient) < 1e-6
    assert objective(PRIOR, rows, delta) < objective(PRIOR, rows, np.zeros(3))


def test_a_history_from_known_coefficients_is_recovered():
    """Sixty exact merges: the per-byte coefficients to 2%, the small fixed part (a fraction of every merge's
    seconds, so the prior keeps a little of its say) to 20%, and any merge's seconds to 1%."""
    model = fit(PRIOR, history(60))
    assert np.allclose(model.coefficients[1:], TRUE[1:], rtol=0.02)
    assert model.coefficients[0] == pytest.approx(TRUE[0], rel=0.2)
    for t in history(10, seed=1):
        assert model.seconds(t.expert_bytes, t.output_bytes) == pytest.approx(t.seconds, rel=0.02)


@pytest.mark.parametrize("off", [10.0, 0.1])
def test_one_merge_moves_a_bad_prior_most_of_the_way_without_nonsense(off):
    """A prior ten times too high or too low: after one merge every coefficient is still positive and the
    prediction of that merge has moved more than halfway to it (in ratio)."""
    prior = Prior(*(PRIOR.coefficients * off))
    (row,) = history(1, noise=0.05, seed=5)
    model = fit(prior, [row])
    assert all(c > 0 for c in model.coefficients)
    before = abs(math.log(prior.coefficients @ [1, row.expert_bytes, row.output_bytes] / row.seconds))
    after = abs(math.log(model.seconds(row.expert_bytes, row.output_bytes) / row.seconds))
    assert after < before / 2


@pytest.mark.parametrize("off", [3.0, 1 / 3])
@pytest.mark.parametrize("seed", range(5))
def test_three_merges_of_one_base_decide_the_next(off, seed):
    """A prior three times off and three merges of one base, at 100%, 10% and 50% of eight experts' bytes (the
    usual history), each off by 5%: a fourth merge of that base, at 25%, is predicted within 25%."""
    rng = np.random.default_rng(seed)
    output = 1_200_000_000
    rows = [Timing(int(output * f), output, float(TRUE @ [1, output * f, output]) * (1 + 0.05 * rng.standard_normal()))
            for f in (8.0, 0.8, 4.0, 2.0)]
    model = fit(Prior(*(PRIOR.coefficients * off)), rows[:3])
    assert model.seconds(rows[3].expert_bytes, output) == pytest.approx(rows[3].seconds, rel=0.25)


def test_the_uncertainty_pools_the_residuals_with_the_prior_spread():
    rows = history(6, noise=0.1, seed=6)
    model = fit(PRIOR, rows)
    residuals = [1 - model.seconds(t.expert_bytes, t.output_bytes) / t.seconds for t in rows]
    expected = math.sqrt((PRIOR_SPREAD**2 + sum(r * r for r in residuals)) / (1 + len(rows)))
    assert model.uncertainty == pytest.approx(expected) and model.merges == 6


def test_merges_without_seconds_are_left_out():
    assert fit(PRIOR, [Timing(10, 10, 0.0)]) == fit(PRIOR, [])


def test_expert_bytes_within_inverts_the_prediction():
    model = TimeModel((0.5, 2e-9, 1e-9), 0.2, 3)
    within = model.expert_bytes_within(10.0, 2 * 10**9)
    assert within == pytest.approx((10.0 - 0.5 - 2.0) / 2e-9)
    assert model.seconds(int(within), 2 * 10**9) == pytest.approx(10.0)
    assert model.expert_bytes_within(2.0, 2 * 10**9) < 0  # reading nothing takes 2.5 s
    assert TimeModel((0.5, 0.0, 0.0), 0.2, 3).expert_bytes_within(1.0, 0) == math.inf


def test_a_prediction_round_trips_and_one_of_the_former_model_reads_as_none():
    model = TimeModel((0.5, 2e-9, 1e-9), 0.25, 3)
    prediction = model.predict("host/2 cpus/cpu", 10**9, 2 * 10**9)
    assert prediction.seconds == pytest.approx(0.5 + 2.0 + 2.0)
    assert prediction.terms == pytest.approx({"fixed": 0.5, "experts": 2.0, "output": 2.0})
    assert Prediction.from_json(prediction.to_json()) == prediction
    assert prediction.flat() == pytest.approx({"total": 4.5, "uncertainty": 0.25, "fixed": 0.5, "experts": 2.0,
                                               "output": 2.0, "merges": 3.0})
    former = {"machine": "m", "work": {}, "phases": {"startup": 1.0, "total": 3.0}}
    stored = make_plan(seconds=prediction).to_json()
    assert Plan.from_json(stored).seconds == prediction
    assert Plan.from_json({**stored, "seconds": former}).seconds is None  # carried, not hashed: the digest holds
    with pytest.raises(ValueError, match="terms"):
        Prediction.from_json({**prediction.to_json(), "terms": {"fixed": 1.0}})


def test_described_for_people():
    prediction = TimeModel((0.5, 2e-9, 1e-9), 0.35, 0).predict("m", 10**9, 2 * 10**9)
    text = describe(prediction.flat())
    assert text.startswith("4.5 s ± 35%, start-up excluded (fixed 0.5 + experts 2 + output 2 s; prior only")
    assert "fitted to 3 merges here" in describe(TimeModel((0.5, 0, 0), 0.1, 3).predict("m", 0, 0).flat())
    assert describe({"startup": 1.0, "total": 3.25}) == "3.25 s"  # a manifest of the former model
    assert describe(None) == "none"
