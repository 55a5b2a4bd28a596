"""The `bisect --html` page: GOOD and BAD, the culprits found, and every probe the search evaluated.

It renders ``Bisection.summary()`` (``app/bisecting.py``), plain values, as the JSON output shows them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mergepipe.planner.html.page import document, key_values, section, table


def render_bisect(result: Mapping[str, Any]) -> str:
    good, bad, data = result["good"], result["bad"], result["data"]
    summary = key_values(
        [
            ("GOOD", f"{good['target']}: loss {good['loss']:.4f}"),
            ("BAD", f"{bad['target']}: loss {bad['loss']:.4f}"),
            ("data", f"{data['name']} ({data['tokens']} tokens)"),
            (
                "regression",
                f"a loss above {good['loss'] + result['tolerance']:.4f} (GOOD + tolerance {result['tolerance']:.4g})",
            ),
            ("evaluations", f"{len(result['probes'])} probes, {result['evaluations_computed']} computed by this run"),
        ]
    )
    culprits = table(["culprit changes"], [[" + ".join(group)] for group in result["culprits"]])
    sections = [section("Summary", summary), section("Culprits", culprits)]
    if result["tensors"]:
        rows = [[g["group"], str(len(g["tensors"])), ", ".join(g["tensors"])] for g in result["tensors"]]
        sections.append(section("Tensors", table(["group", "tensors", "names"], rows, numeric=(1,), names=(0, 2))))
    probes = [
        [
            p["stage"],
            p["what"],
            f"{p['loss']:.4f}",
            f"{p['loss'] - good['loss']:+.4f}",
            "yes" if p["regresses"] else "no",
            "computed" if p["computed"] else "stored",
        ]
        for p in result["probes"]
    ]
    sections.append(
        section(
            "Probes",
            table(
                ["stage", "taken from BAD", "loss", "vs GOOD", "regresses", "result"],
                probes,
                numeric=(2, 3),
                names=(1,),
            ),
            note="In the order the search evaluated them.",
        )
    )
    return document("MergePipe bisect", f"{good['target']} -> {bad['target']}", sections)
