"""Replay a ``benchmarks.predict`` run through the cost model as it is now, without merging again.

Usage: ``python -m benchmarks.predict_replay RESULTS.json``.

A predict run keeps, per row, the bytes its plan moved (``work``), the
phases the merge realized and the wall seconds of its process, and the rates
``calibrate`` measured before the first row. Starting from those rates, this
predicts each row with ``spec/seconds.predict`` and then refines the rates
with what the row realized (``observe``, ``refine``), as every merge does,
and prints predicted vs realized. The realized seconds do not depend on the
model, so a change to the model's arithmetic or to its refinement can be
judged on recorded merges in a second instead of a 7-minute run (the first
row of each result also checks the replay: it must predict what the run did,
when the model is unchanged).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mergepipe.spec.refinement import observe, refine
from mergepipe.spec.seconds import Rates, Work, predict

TARGET = 0.20


def replay(result: dict) -> list[tuple[dict, float, float]]:
    """``(row, predicted total, error)`` for every row with a recorded work, in the run's order."""
    rates = Rates.from_values(result["calibration"]["rates"])
    if rates is None:
        raise SystemExit("this result has no calibrated rates (recorded since benchmarks.predict keeps them)")
    served = bool(result.get("served"))  # a served run's start-up is the served one, and no read-ahead
    out = []
    for row in result["rows"]:
        if not row.get("work") or not row.get("wall_seconds"):
            continue
        work = Work.from_json(row["work"])
        seconds = predict(work, rates, served)
        if seconds is None:
            continue
        out.append((row, seconds["total"], (seconds["total"] - row["wall_seconds"]) / row["wall_seconds"]))
        rates, _ = refine(rates, observe(work, rates, row["realized_seconds"], served))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    rows = replay(json.loads(args.results.read_text()))
    print(f"{'op':16} {'K':>2} {'budget':>10} {'policy':8} {'run s':>6} {'replay s':>8} {'wall s':>6} {'error':>6}")
    for row, total, error in rows:
        recorded = row["predicted_seconds"].get("total", float("nan"))
        print(f"{row['operator']:16} {row['k']:>2} {row['budget']:>10} {row['policy']:8} {recorded:6.1f} "
              f"{total:8.1f} {row['wall_seconds']:6.1f} {100 * error:+5.0f}%")
    within = sum(abs(e) <= TARGET for _, _, e in rows)
    worst = max((abs(e) for _, _, e in rows), default=0.0)
    print(f"within ±{100 * TARGET:.0f}%: {within} of {len(rows)} rows; largest error {100 * worst:.0f}%")


if __name__ == "__main__":
    main()
