"""`mergepipe diff --html`: what differs between two snapshots, as one self-contained page.

The input differences (experts added, removed or at another version,
parameters, seed, budget, policy), then a bar chart of the tensors' relative
change ``‖B − A‖ / ‖A‖``, largest first, and a table naming the experts whose
planned block reads differ for each of those tensors (beside its bar): where
to look first when a new version behaves differently. Unchanged tensors are
counted, not drawn. Where both were evaluated on the same data, a table of
their scores and B − A comes after the inputs.
"""

from __future__ import annotations

import math

from mergepipe.planner.explain import SnapshotDiff, TensorChange
from mergepipe.planner.explain import DIGEST_CHARS, delta_text, value_text
from mergepipe.planner.html.page import document, esc, legend, section, table, tiles
from mergepipe.planner.html.svg import Bar, BarGroup, bar_chart

TOP_TENSORS = 20  # bars drawn by default: the changes worth a look
CHANGED = "#2f6fba"
SAME_READS = "#9fb3c8"


def render_diff(result: SnapshotDiff, top: int = TOP_TENSORS) -> str:
    """The whole page; the chart shows the ``top`` changed tensors with the largest relative change."""
    changed = [t for t in result.tensors if t.relative_change != 0]
    largest = changed[:top]
    finite = [t.relative_change for t in result.tensors if math.isfinite(t.relative_change)]
    headline = tiles(
        [
            (str(len(result.inputs)), "input differences"),
            (f"{len(changed)} of {len(result.tensors)}", "tensors changed"),
            (_change(max(finite)) if finite else "-", "largest finite relative change"),
        ]
    )
    inputs = (
        ('<ul class="lines">' + "".join(f'<li class="mono">{esc(line)}</li>' for line in result.inputs) + "</ul>")
        if result.inputs
        else "<p>The same experts, versions, parameters and budget.</p>"
    )
    sections = [
        section("Inputs", headline + inputs, anchor="inputs"),
        *_evaluations(result),
        _chart(largest, len(changed), len(result.tensors)),
    ]
    return document("MergePipe diff", f"{result.a} → {result.b}", sections)


def _evaluations(result: SnapshotDiff) -> list[str]:
    """A's and B's scores on data both were evaluated on, and B − A: one section, or none."""
    if not result.evaluations:
        return []
    rows = [
        [c.data_name, c.data_digest[:DIGEST_CHARS], c.metric, value_text(c.a), value_text(c.b), delta_text(c.delta)]
        for c in result.evaluations
    ]
    return [
        section(
            "Evaluations",
            table(["data", "data digest", "metric", "A", "B", "B − A"], rows, numeric=(3, 4, 5)),
            "Each metric of A and B on the same data (equal data digests); B − A.",
            anchor="evaluations",
        )
    ]


def _chart(largest: list[TensorChange], changed: int, total: int) -> str:
    groups = [
        BarGroup(
            t.tensor, (Bar("relative change", t.relative_change, _label(t), CHANGED if t.experts else SAME_READS),)
        )
        for t in largest
    ]
    note = (
        f"The {len(largest)} largest changes of {changed} changed tensors ({total - changed} of {total} "
        "unchanged, not drawn); bars are proportional to ‖B − A‖ / ‖A‖ (a hatched red bar: A is all zeros "
        "or the shapes differ). Beside each bar: the experts whose planned blocks differ between the two "
        "snapshots (other blocks read, or other content in them)."
    )
    if not groups:
        return section("Relative change per tensor", "<p>Every tensor is bit-identical in A and B.</p>", anchor="chart")
    return section(
        "Relative change per tensor",
        f"<div>{bar_chart('relative-change', groups)}</div>"
        + legend(
            [
                (CHANGED, "some expert's planned blocks differ"),
                (SAME_READS, "the same planned blocks: an input or parameter changed"),
            ]
        ),
        note,
        anchor="chart",
    )


def _label(t: TensorChange) -> str:
    return _change(t.relative_change) + (f"  ({', '.join(t.experts)})" if t.experts else "")


def _change(value: float) -> str:
    """A relative change as the terminal table shows it; infinity spelled out."""
    return "∞ (A is zero or shapes differ)" if math.isinf(value) else f"{value:.3e}"
