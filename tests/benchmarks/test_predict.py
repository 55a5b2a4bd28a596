"""The predict benchmark's summary over passes (medians, errors and spreads computed here by hand), and its
offline replay."""

from __future__ import annotations

from benchmarks.predict import Prediction, medians
from benchmarks.predict_replay import replay


def row(budget: str, predicted: float, wall: float, index: int) -> Prediction:
    return Prediction("ties", 8, budget, "energy", wall_seconds=wall, predicted_seconds={"total": predicted},
                      error=(predicted - wall) / wall, pass_index=index)


def test_medians_per_row_over_the_passes():
    rows = [row("10%", 2.0, 2.6, 0), row("100%", 6.0, 5.2, 0),
            row("10%", 2.2, 2.0, 1), row("100%", 6.4, 8.5, 1),
            row("10%", 2.1, 1.6, 2), row("100%", 6.2, 6.0, 2),
            Prediction("ties", 8, "50%", "energy", status="failed", pass_index=0)]  # no prediction: left out
    ten, full = medians(rows)
    assert (ten["budget"], ten["runs"]) == ("10%", 3)
    assert ten["predicted_seconds"] == 2.1 and ten["realized_seconds"] == 2.0
    assert abs(ten["error"] - 0.05) < 1e-12
    # single runs: (2.0-2.6)/2.6 = -23% (not), +10% (within), (2.1-1.6)/1.6 = +31% (not)
    assert ten["runs_within"] == 1
    assert abs(ten["spread"] - 2.6 / 1.6) < 1e-12
    assert full["predicted_seconds"] == 6.2 and full["realized_seconds"] == 6.0
    # single runs: +15% (within), (6.4-8.5)/8.5 = -25% (not), +3% (within)
    assert full["runs_within"] == 2 and abs(full["spread"] - 8.5 / 5.2) < 1e-12


def test_replay_predicts_a_served_run_as_served():
    """A served run's rows are replayed with the served start-up and no read-ahead (hand arithmetic, with
    overlap 1 the stream is the sum of its parts): own process 1.5 + (2 − 0.95) + 1 + 1 + 0.2 = 4.75 s,
    served 0.05 + 2 + 1 + 1 + 0.2 = 4.25 s."""
    rates = {"startup_seconds": 1.0, "exit_share": 0.5, "publish_seconds": 0.1, "sequential_read": 0.5e9,
             "random_read": 1e9, "write": 1e9, "flush": 1e10, "overlap": 1.0, "served_startup_seconds": 0.05,
             "compute_merged:ties": 1e9, "compute_expert:ties": 1e9}
    work = {"operator": "ties", "base_bytes": 10**9, "expert_bytes": 0, "merged_bytes": 10**9, "output_bytes": 10**9}
    row = {"operator": "ties", "k": 2, "budget": "0%", "policy": "energy", "work": work, "wall_seconds": 4.25,
           "realized_seconds": {}, "predicted_seconds": {}}
    for served, expected in ((True, 4.25), (False, 4.75)):
        result = {"calibration": {"rates": rates}, "rows": [row], "served": served}
        [(_, total, error)] = replay(result)
        assert abs(total - expected) < 1e-9
        assert abs(error - (expected - 4.25) / 4.25) < 1e-9
