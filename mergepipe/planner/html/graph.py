"""The lineage graph as SVG boxes and arrows: each model once, parents to the left of their children.

Input is the nested node form `mergepipe lineage --format json` prints
(``{"id", "label", "role", "parents": [...]}``). The same model can appear
under several children (a base under the snapshot and under its previous
version), so nodes are merged by id and placed in the column of their
longest path to the root: every arrow then points right. A long label is
shortened in the middle in its box (the version after ``@`` stays) and shown
whole in the box's tooltip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mergepipe.errors import visible
from mergepipe.planner.html.page import esc
from mergepipe.planner.html.svg import NAME_CHARS, Label, svg_open

# Arrow colour by the parent's role; a role not listed is drawn grey.
ROLE_COLOURS = {"base": "#52606d", "expert": "#2f6fba", "previous version": "#d9822b", "built --from": "#8e44ad"}
_OTHER = "#9aa5b1"
_BOX_H, _ROW_H, _GAP = 30, 42, 110


@dataclass
class _Graph:
    labels: dict[str, Label] = field(default_factory=dict)
    depth: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    edges: list[tuple[str, str, str]] = field(default_factory=list)  # (parent, child, role)


def role_colour(role: str) -> str:
    """The arrow colour of an edge whose role is ``role`` (``built --from`` wins over other roles)."""
    if "built --from" in role:
        return ROLE_COLOURS["built --from"]
    return ROLE_COLOURS.get(role, _OTHER)


def _collect(node: Mapping, path: tuple[str, ...], graph: _Graph) -> None:
    """Merge ``node`` and its parents into ``graph`` (depth: the longest path to the root). A parent already
    on ``path`` (a cycle: not in lineage nodes, but the drawing must not loop) is left out."""
    ident = str(node["id"])
    if ident not in graph.labels:
        graph.labels[ident] = Label.of(str(node["label"]), NAME_CHARS)
        graph.order.append(ident)
    graph.depth[ident] = max(graph.depth.get(ident, 0), len(path))
    for parent in node["parents"]:
        edge = (str(parent["id"]), ident, str(parent["role"]))
        if edge[0] in path or edge[0] == ident:
            continue
        if edge not in graph.edges:
            graph.edges.append(edge)
        _collect(parent, (*path, ident), graph)


def _layout(graph: _Graph) -> tuple[dict[str, tuple[float, float, float]], float, float]:
    """(x, y, width) of every box, and the drawing's width and height."""
    last = max(graph.depth.values())
    columns: list[list[str]] = [[] for _ in range(last + 1)]
    for ident in graph.order:
        columns[last - graph.depth[ident]].append(ident)
    widths = [max(graph.labels[i].width + 24 for i in column) for column in columns]
    tallest = max(len(column) for column in columns)
    boxes, x = {}, 8.0
    for column, width in zip(columns, widths):
        offset = (tallest - len(column)) * _ROW_H / 2
        for k, ident in enumerate(column):
            boxes[ident] = (x, 8 + offset + k * _ROW_H, width)
        x += width + _GAP
    return boxes, x - _GAP + 8, 16 + tallest * _ROW_H - (_ROW_H - _BOX_H)


def lineage_graph(root: Mapping) -> str:
    """The SVG of ``root`` and all its ancestors; the root's box is drawn bold.

    Boxes carry ``data-id``; arrows ``data-parent``, ``data-child`` and ``data-role``.
    """
    graph = _Graph()
    _collect(root, (), graph)
    boxes, width, height = _layout(graph)
    out = [svg_open('class="lineage"', width, height)]
    ports, lanes = _ports(graph, boxes), _lanes(graph, boxes)
    for edge in graph.edges:  # arrows first, under the boxes
        out.append(_arrow(graph, boxes, lanes, edge, *ports[edge]))
    root_id = str(root["id"])
    for ident in graph.order:
        x, y, w = boxes[ident]
        strong = ident == root_id
        fill, stroke, bold = ("#dceefb", "#243b53", ' font-weight="bold"') if strong else ("#f5f7fa", "#9fb3c8", "")
        label = graph.labels[ident]
        tooltip = ident if label.full == visible(ident) else f"{label.full} ({ident})"
        out.append(
            f"<g><title>{esc(tooltip)}</title>"
            f'<rect class="node" data-id="{esc(ident)}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{_BOX_H}" '
            f'rx="4" fill="{fill}" stroke="{stroke}" stroke-width="{2 if strong else 1}"/>'
            f'<text x="{x + w / 2:.1f}" y="{y + _BOX_H / 2 + 4:.1f}" text-anchor="middle"'
            f"{bold}>{esc(label.shown)}</text></g>"
        )
    out.append("</svg>")
    return "".join(out)


def _ports(graph: _Graph, boxes: dict) -> dict[tuple[str, str, str], tuple[float, float]]:
    """Where each arrow leaves its parent's box and enters its child's (y): the arrows of one box are
    spread over its height in the order of the boxes at their other end, so they do not cross there."""

    def spread(edges: list, own: int, other: int) -> dict:
        out = {}
        groups: dict[str, list] = {}
        for edge in edges:
            groups.setdefault(edge[own], []).append(edge)
        for ident, group in groups.items():
            group.sort(key=lambda e: boxes[e[other]][1])
            step = min(6.0, (_BOX_H - 8) / max(len(group) - 1, 1))
            middle = boxes[ident][1] + _BOX_H / 2
            out.update({e: middle + (k - (len(group) - 1) / 2) * step for k, e in enumerate(group)})
        return out

    leave, enter = spread(graph.edges, 0, 1), spread(graph.edges, 1, 0)
    return {edge: (leave[edge], enter[edge]) for edge in graph.edges}


def _lanes(graph: _Graph, boxes: dict) -> list[tuple[float, float, list[float]]]:
    """Per column from the left: its x, width, and the heights of the free lanes between its boxes (and
    above and below them), where an arrow that skips the column passes without crossing a box."""
    last = max(graph.depth.values())
    out = []
    for column in range(last + 1):
        members = [boxes[i] for i in graph.order if last - graph.depth[i] == column]
        ys = sorted(y for _, y, _ in members)
        half_gap = (_ROW_H - _BOX_H) / 2
        out.append((members[0][0], members[0][2], [ys[0] - half_gap, *(y + _BOX_H + half_gap for y in ys)]))
    return out


def _arrow(graph: _Graph, boxes: dict, lanes: list, edge: tuple[str, str, str], sy: float, ey: float) -> str:
    """One arrow from the right side of the parent's box to the left side of the child's, coloured by role;
    across a column it skips, it runs along the free lane nearest its straight course."""
    parent, child, role = edge
    last = max(graph.depth.values())
    px, _, pw = boxes[parent]
    start, end = (px + pw, sy), (boxes[child][0] - 7, ey)
    first, stop = last - graph.depth[parent] + 1, last - graph.depth[child]
    d, here = f"M {start[0]:.1f} {start[1]:.1f}", start
    for column in range(first, stop):
        x, width, free = lanes[column]
        course = sy + (ey - sy) * (column - first + 1) / (stop - first + 1)
        lane = min(free, key=lambda y: abs(y - course))
        d += _curve(here, (x - 8, lane)) + f" L {x + width + 8:.1f} {lane:.1f}"
        here = (x + width + 8, lane)
    d += _curve(here, end)
    colour = role_colour(role)
    dashed = ' stroke-dasharray="6 4"' if "built --from" in role else ""
    ex = end[0] + 7
    return (
        f"<g><title>{esc(graph.labels[parent].full)} → {esc(graph.labels[child].full)} ({esc(role)})</title>"
        f'<path class="edge" data-parent="{esc(parent)}" data-child="{esc(child)}" data-role="{esc(role)}" '
        f'd="{d}" fill="none" stroke="{colour}" stroke-width="1.5"{dashed}/>'
        f'<polygon points="{ex:.1f},{ey:.1f} {ex - 7:.1f},{ey - 3.5:.1f} {ex - 7:.1f},{ey + 3.5:.1f}" '
        f'fill="{colour}"/></g>'
    )


def _curve(a: tuple[float, float], b: tuple[float, float]) -> str:
    """A cubic from ``a`` to ``b`` leaving and arriving horizontally."""
    bend = max((b[0] - a[0]) / 2, 20)
    return f" C {a[0] + bend:.1f} {a[1]:.1f}, {b[0] - bend:.1f} {b[1]:.1f}, {b[0]:.1f} {b[1]:.1f}"
