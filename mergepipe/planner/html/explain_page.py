"""`mergepipe explain --html`: the explanation of a plan or snapshot as one self-contained page.

Sections, top to bottom: the summary (budget, planned and realized expert
bytes, the reduction against reading every changed block, energy kept,
error bound, how an incremental merge's output got there, phase times),
what the merge scored (where it was evaluated), two heatmaps layers ×
experts (the share of each expert's changed blocks the plan reads; the
share of its weighted delta energy it keeps), bytes per expert, the lineage
graph, and the tensors whose omitted energy is largest.
Everything is computed from the ``Explanation`` alone (and the lineage nodes
the caller passes), so the page says exactly what ``explain --json`` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mergepipe.planner.explain import DIGEST_CHARS, value_text
from mergepipe.planner.explain import Explanation, TensorExplanation, copies_in_write, output_text
from mergepipe.planner.html.graph import lineage_graph, role_colour
from mergepipe.planner.html.page import document, key_values, legend, percent, section, table, tiles
from mergepipe.planner.html.svg import Bar, BarGroup, Cell, bar_chart, colour_legend, heatmap
from mergepipe.sizes import format_bytes

OTHER_ROW = "other"  # the heatmap row of tensors outside the transformer layers
TOP_TENSORS = 15  # rows of the "largest omitted energy" table: the ones worth a look
SERIES = (("changed", "#bcccdc"), ("planned", "#2f6fba"), ("realized", "#243b53"))


@dataclass
class LayerShare:
    """What one expert has in one layer (or outside layers): changed and read blocks, weighted delta
    energy and the part kept, and whether any of its tensors there is read from a delta store."""

    changed: int = 0
    read: int = 0
    energy: float = 0.0
    kept: float = 0.0
    store: bool = False


def layer_key(layer: int | None) -> str:
    """The heatmap row of a tensor's layer: its index, or ``other`` outside the layers."""
    return OTHER_ROW if layer is None else str(layer)


def layer_shares(result: Explanation) -> dict[tuple[str, str], LayerShare]:
    """(layer key, expert) -> its totals over the explanation's tensors."""
    shares: dict[tuple[str, str], LayerShare] = {}
    for t in result.tensors:
        for e in result.experts:
            share = shares.setdefault((layer_key(t.layer), e.expert), LayerShare())
            share.changed += t.changed.get(e.expert, 0)
            share.read += t.read.get(e.expert, 0)
            share.energy += t.energy.get(e.expert, 0.0)
            share.kept += t.kept_energy.get(e.expert, 0.0)
            share.store = share.store or e.expert in t.store
    return shares


def render_explain(result: Explanation, lineage: Mapping | None = None, top: int = TOP_TENSORS) -> str:
    """The whole page. ``lineage``: the snapshot's (or plan's) lineage nodes, as `lineage --format json`."""
    if result.snapshot_id is not None:
        what = str(lineage["label"]) if lineage is not None else result.snapshot_id
        subtitle = f"snapshot {result.snapshot_id} · plan {result.plan_id[:16]}"
    else:
        what, subtitle = f"plan {result.plan_id[:12]}", f"plan {result.plan_id} (not executed)"
    sections = [_summary(result), *_evaluations(result), _heatmaps(result), _bytes_per_expert(result)]
    if lineage is not None:
        sections.append(_lineage(lineage))
    sections.append(_omitted(result, top))
    return document(
        f"MergePipe explain: {what}", f"{subtitle} · operator {result.operator} · policy {result.policy}", sections
    )


def _summary(result: Explanation) -> str:
    full, planned = result.full_expert_bytes, result.planned_expert_bytes
    reduction = 1 - planned / full if full else 0.0
    headline = tiles(
        [
            (format_bytes(planned), "expert bytes planned"),
            (percent(reduction), "less than reading every changed block"),
            (percent(result.retained_energy), "of the weighted delta energy kept"),
            (percent(result.error_share), "of the task vectors (norm) left out"),
        ]
    )
    realized = result.realized_expert_bytes
    rows = [
        (
            "budget",
            format_bytes(result.budget_bytes)
            + (f" ({percent(result.budget_bytes / full)} of a full read)" if full else ""),
        ),
        (
            "expert bytes",
            f"planned {format_bytes(planned)} of {format_bytes(full)} changed"
            + ("" if realized is None else f"; realized {format_bytes(realized)}"),
        ),
        ("reduction vs full read", f"{percent(reduction)} ({format_bytes(full - planned)} not read)"),
        ("retained delta energy", percent(result.retained_energy)),
        (
            "error bound",
            f"{result.error_bound:.6g} ({result.error_bound_kind}, on the fp32 result before rounding "
            f"to the output dtype); {percent(result.error_share)} of the weighted task vectors (norm) "
            "left out",
        ),
    ]
    if result.estimate is not None:
        rows.append(
            (
                "deviation estimate",
                f"{result.estimate:.6g} (first order: the weighted norm of what the plan leaves out; not a bound)",
            )
        )
    if result.reused_from is not None:
        saved = sum(e.reused_bytes for e in result.experts)
        rows.append(
            (
                "incremental",
                f"{format_bytes(result.reused_output_bytes)} of output copied from "
                f"'{result.reused_from}'; {format_bytes(saved)} of the planned expert bytes "
                f"reused, {format_bytes(planned - saved)} recomputed",
            )
        )
        if result.updated_output_bytes:
            rows.append(
                (
                    "delta updates",
                    f"{format_bytes(result.updated_output_bytes)} of output updated from "
                    f"the previous output (within {result.update_bound:.4g})",
                )
            )
    if (made := output_text(result)) is not None:
        rows.append(("output", made))
    if result.seconds:
        copied = copies_in_write(result.output_bytes_by_method)
        copies = " (write includes any kernel copies of reused blocks)" if copied else ""
        rows.append(
            ("phase times", " · ".join(f"{phase} {secs:.3g} s" for phase, secs in result.seconds.items()) + copies)
        )
    elif result.snapshot_id is None:
        rows.append(("phase times", "none: a plan that has not been executed"))
    return section("Summary", headline + key_values(rows), anchor="summary")


def _evaluations(result: Explanation) -> list[str]:
    """The merge's scores, by data and metric: one section, or none when it was never evaluated."""
    if not result.evaluations:
        return []
    rows = [
        [
            r.data_name,
            r.data_digest[:DIGEST_CHARS],
            r.metric,
            value_text(r.value),
            "-" if r.tokens is None else str(r.tokens),
        ]
        for r in result.evaluations
    ]
    return [
        section(
            "Evaluations",
            table(["data", "data digest", "metric", "value", "tokens"], rows, numeric=(3, 4)),
            "Stored under the plan's digest: a plan evaluated in memory and its snapshot share them. "
            "Scores compare only on the same data digest.",
            anchor="evaluations",
        )
    ]


def _heatmaps(result: Explanation) -> str:
    shares = layer_shares(result)
    layers = sorted({t.layer for t in result.tensors if t.layer is not None})
    rows = [(str(n), f"layer {n}") for n in layers]
    if any(t.layer is None for t in result.tensors):
        rows.append((OTHER_ROW, OTHER_ROW))
    experts = [e.expert for e in result.experts]
    read_cells, energy_cells = [], []
    for key, label in rows:
        read_row, energy_row = [], []
        for expert in experts:
            read, energy = _cells(label, expert, shares[key, expert])
            read_row.append(read)
            energy_row.append(energy)
        read_cells.append(read_row)
        energy_cells.append(energy_row)
    charts = (
        f"<div><h3>share of changed blocks read</h3>{heatmap('read', rows, experts, read_cells)}</div>"
        f"<div><h3>share of delta energy kept</h3>{heatmap('energy', rows, experts, energy_cells)}</div>"
    )
    note = (
        "Per layer and expert: the share of the expert's changed blocks the plan reads, and the share of "
        "its weighted delta energy Σ (w‖Δ‖)² the plan keeps. 'other': tensors outside the transformer "
        "layers (embeddings, final norm, head). * read from the expert's delta store (sketches or exact "
        "entries) instead of blocks."
    )
    return section(
        "Layers × experts",
        f'<div class="charts">{charts}</div>' + colour_legend("no changed block"),
        note,
        anchor="heatmaps",
    )


def _cells(label: str, expert: str, share: LayerShare) -> tuple[Cell, Cell]:
    """The two cells of one (layer, expert): blocks read, energy kept."""
    mark = "*" if share.store else ""
    where = f"{label} · {expert}"
    if share.changed:
        read_share = share.read / share.changed
        read = Cell(
            read_share,
            percent(read_share) + mark,
            f"{where}: {share.read} of {share.changed} changed blocks read ({percent(read_share)})",
        )
    else:
        read = Cell(None, "–", f"{where}: no changed block")
    if share.energy > 0:
        kept_share = share.kept / share.energy
        energy = Cell(
            kept_share, percent(kept_share) + mark, f"{where}: {percent(kept_share)} of its weighted delta energy kept"
        )
    else:
        energy = Cell(None, "–", f"{where}: no delta energy")
    return read, energy


def _bytes_per_expert(result: Explanation) -> str:
    series = SERIES if result.realized_expert_bytes is not None else SERIES[:2]
    groups = []
    for e in result.experts:
        values = {"changed": e.full_bytes, "planned": e.planned_bytes}
        if e.realized_bytes is not None:  # known for every expert once the plan was executed (series then has it)
            values["realized"] = e.realized_bytes
        groups.append(
            BarGroup(e.expert, tuple(Bar(s, float(values[s]), format_bytes(values[s]), colour) for s, colour in series))
        )
    labels = {"changed": "changed bytes (a full read)", "planned": "planned", "realized": "realized (read)"}
    return section(
        "Bytes per expert",
        f"<div>{bar_chart('bytes', groups)}</div>" + legend([(colour, labels[s]) for s, colour in series]),
        "Bars are proportional to bytes."
        + (
            " Realized bytes are below planned ones where an incremental merge copied blocks from the "
            "previous snapshot instead of reading them."
            if result.reused_from is not None
            else ""
        ),
        anchor="bytes",
    )


def _lineage(lineage: Mapping) -> str:
    roles = sorted({str(p["role"]) for p in _walk(lineage)})
    return section(
        "Lineage",
        f"<div>{lineage_graph(lineage)}</div>" + legend([(role_colour(r), r) for r in roles]),
        "Arrows point from a parent to the model made from it; the bold box is this snapshot "
        "(or plan). A model used twice is drawn once.",
        anchor="lineage",
    )


def _walk(node: Mapping) -> list[Mapping]:
    """Every node under ``node`` (not itself)."""
    out = []
    for parent in node["parents"]:
        out += [parent, *_walk(parent)]
    return out


def _omitted(result: Explanation, top: int) -> str:
    total = sum(sum(t.energy.values()) for t in result.tensors)
    left = sorted(
        ((sum(t.energy.values()) - sum(t.kept_energy.values()), t) for t in result.tensors),
        key=lambda pair: (-pair[0], pair[1].tensor),
    )
    left = [(omitted, t) for omitted, t in left if omitted > 0][:top]
    if not left:
        return section(
            "Largest omitted energy",
            "<p>Nothing omitted: the plan keeps every expert's whole delta energy.</p>",
            anchor="omitted",
        )
    experts = [e.expert for e in result.experts]
    rows = [
        [
            t.tensor,
            "-" if t.layer is None else str(t.layer),
            percent(omitted / total),
            percent(t.retained_energy),
            format_bytes(t.planned_bytes),
            *(_read_of(t, e) for e in experts),
        ]
        for omitted, t in left
    ]
    headers = ["tensor", "layer", "omitted", "kept in tensor", "planned bytes", *experts]
    return section(
        f"Largest omitted energy (top {len(left)})",
        f'<div class="scroll">{table(headers, rows, numeric=range(1, len(headers)))}</div>',
        "Omitted: the tensor's weighted delta energy Σ (w‖Δ‖)² the plan leaves out, as a share of "
        "all experts' energy over all tensors. Per expert: blocks read / changed, or the delta-store "
        "level read. The full per-tensor table: `mergepipe explain` or `--json`.",
        anchor="omitted",
    )


def _read_of(t: TensorExplanation, expert: str) -> str:
    return t.store.get(expert) or f"{t.read.get(expert, 0)}/{t.changed.get(expert, 0)}"
