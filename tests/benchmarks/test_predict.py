"""The predict benchmark's summary over passes: medians, errors and spreads computed here by hand."""

from __future__ import annotations

from benchmarks.predict import Prediction, medians


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
