"""The `search --html` page: every trial's objective, the best so far over the trials, the parameters'
importance, and the published best. It renders ``SearchResult.summary()`` (``app/searching.py``): plain
values, as the JSON output shows them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mergepipe.planner.explain import params_text
from mergepipe.planner.html.page import document, key_values, section, table

_WIDTH, _HEIGHT, _PAD = 640, 220, 36


def render_search(result: Mapping[str, Any], importances: Mapping[str, float]) -> str:
    trials, best = result["trials"], result["best"]
    complete = [t for t in trials if t["objective"] is not None]
    rows = [
        ("study", result["study"]),
        (
            "trials",
            f"{len(trials)}: {len(complete)} complete, "
            f"{sum(t['state'] == 'pruned' for t in trials)} pruned, "
            f"{sum(t['state'] == 'failed' for t in trials)} failed",
        ),
    ]
    if best is not None:
        rows.append(("best", f"trial {best['number']}: {best['objective']:.5g} ({params_text(best['params'])})"))
    if result["published"] is not None:
        published = result["published"]
        rows.append(
            ("published", f"snapshot {published['snapshot_id']} as '{published['model_id']}' at {published['out']}")
        )
    sections = [section("Summary", key_values(rows))]
    if complete:
        sections.append(
            section(
                "Objective per trial",
                _chart(complete),
                note="Dots: each complete trial's objective (lower is better); line: the best so far.",
            )
        )
    if importances:
        sections.append(
            section(
                "Parameter importance",
                table(["parameter", "importance"], [[k, f"{v:.3f}"] for k, v in importances.items()], numeric=(1,)),
                note="fANOVA over the complete trials (Optuna).",
            )
        )
    sections.append(
        section(
            "Trials",
            table(
                ["trial", "state", "objective", "parameters", "expert MB read", "seconds"],
                [
                    [
                        str(t["number"]),
                        t["state"],
                        "" if t["objective"] is None else f"{t['objective']:.5g}",
                        params_text(t["params"]),
                        "" if t["expert_bytes"] is None else f"{t['expert_bytes'] / 1e6:.1f}",
                        "" if t["seconds"] is None else f"{t['seconds']:.1f}",
                    ]
                    for t in trials
                ],
                numeric=(0, 2, 4, 5),
                names=(3,),
            ),
        )
    )
    return document("MergePipe search", result["study"], sections)


def _chart(complete: list[Mapping[str, Any]]) -> str:
    """An inline SVG: each trial's objective (dots) and the best so far (a step line)."""
    values = [t["objective"] for t in complete]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    last = max(t["number"] for t in complete) or 1

    def x(number: int) -> float:
        return _PAD + (_WIDTH - 2 * _PAD) * number / last

    def y(value: float) -> float:
        return _HEIGHT - _PAD - (_HEIGHT - 2 * _PAD) * (value - low) / span

    dots = "".join(
        f'<circle cx="{x(t["number"]):.1f}" cy="{y(t["objective"]):.1f}" r="3" fill="#4c78a8"/>' for t in complete
    )
    best, points = float("inf"), []
    for t in complete:
        best = min(best, t["objective"])
        points.append(f"{x(t['number']):.1f},{y(best):.1f}")
    line = f'<polyline points="{" ".join(points)}" fill="none" stroke="#e45756" stroke-width="2"/>'
    labels = (
        f'<text x="4" y="{y(high) + 4:.1f}">{high:.4g}</text>'
        f'<text x="4" y="{y(low) + 4:.1f}">{low:.4g}</text>'
        f'<text x="{x(last) - 30:.1f}" y="{_HEIGHT - 8}">trial {last}</text>'
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}">{dots}{line}{labels}</svg>'
    )
