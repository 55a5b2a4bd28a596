"""Small inline-SVG chart primitives: a colour scale, a heatmap with its legend, horizontal bars.

Labels are drawn in a monospace font so their width can be known without a
browser (``text_width``): names are laid out in full, never cut. Every drawn
value also sits in a ``data-*`` attribute of its shape, so tests (and people
reading the source) can check a chart against the numbers it claims to show.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mergepipe.planner.html.page import esc

FONT_PX = 12
CHAR_PX = 7.3  # advance of one monospace character at FONT_PX (DejaVu Sans Mono: 0.602 em), rounded up
EMPTY_FILL = "#e4e7eb"  # a heatmap cell with nothing to show
# Viridis at five stops: perceptually even, readable in grey and by colour-blind readers.
_STOPS = ((0x44, 0x01, 0x54), (0x3B, 0x52, 0x8B), (0x21, 0x91, 0x8C), (0x5E, 0xC9, 0x62), (0xFD, 0xE7, 0x25))


def text_width(text: str) -> float:
    """Width in pixels of ``text`` drawn in the charts' monospace font."""
    return len(text) * CHAR_PX


def scale_colour(value: float) -> str:
    """``#rrggbb`` for a share in [0, 1] (clamped) on the viridis scale: dark = 0, yellow = 1."""
    v = min(max(value, 0.0), 1.0) * (len(_STOPS) - 1)
    i = min(int(v), len(_STOPS) - 2)
    t = v - i
    rgb = (round(a + (b - a) * t) for a, b in zip(_STOPS[i], _STOPS[i + 1]))
    return "#" + "".join(f"{c:02x}" for c in rgb)


def _ink(fill: str) -> str:
    """Black or white text, whichever reads better on ``fill``."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


@dataclass(frozen=True)
class Cell:
    """One heatmap cell: a share in [0, 1] (None: nothing to measure, drawn grey), its text and tooltip."""

    value: float | None
    text: str
    tooltip: str


def _column_headers(columns: Sequence[str], left: float, width: float) -> tuple[list[str], float, float]:
    """The column names above a grid: level when they fit their column, else slanted (at 40°) so that
    long names stay whole without widening every cell. (svg elements, height of the header, width
    they reach to the right of the grid)."""
    if all(text_width(c) + 8 <= width for c in columns):
        return ([f'<text x="{left + (j + 0.5) * width:.1f}" y="{FONT_PX + 2}" text-anchor="middle" '
                 f'font-weight="bold">{esc(c)}</text>' for j, c in enumerate(columns)], FONT_PX + 12.0, 0.0)
    sin, cos = math.sin(math.radians(40)), math.cos(math.radians(40))
    top = max(text_width(c) for c in columns) * sin + FONT_PX + 6
    reach = max(left + (j + 0.5) * width + text_width(c) * cos for j, c in enumerate(columns))
    texts = [f'<text transform="translate({left + (j + 0.5) * width - 3:.1f} {top - 6:.1f}) rotate(-40)" '
             f'font-weight="bold">{esc(c)}</text>' for j, c in enumerate(columns)]
    return texts, top, max(reach - (left + width * len(columns)), 0.0) + 4


def heatmap(metric: str, rows: Sequence[tuple[str, str]], columns: Sequence[str],
            cells: Sequence[Sequence[Cell]], width: int = 64, cell_height: int = 22) -> str:
    """A rows × columns grid of coloured cells. ``rows`` are (key, label) pairs; each cell's rect carries
    ``data-metric``, ``data-row`` (the key), ``data-column`` and ``data-value`` (empty when None)."""
    left = max([text_width(label) for _, label in rows] + [40]) + 12
    headers, top, beyond = _column_headers(columns, left, width)
    total_w, total_h = left + width * len(columns) + 2 + beyond, top + cell_height * len(rows) + 2
    out = [f'<svg class="heatmap" data-metric="{esc(metric)}" width="{total_w:.0f}" height="{total_h:.0f}" '
           f'viewBox="0 0 {total_w:.0f} {total_h:.0f}" role="img">', *headers]
    for i, (key, label) in enumerate(rows):
        y = top + i * cell_height
        out.append(f'<text x="{left - 8:.1f}" y="{y + cell_height / 2 + 4:.1f}" text-anchor="end">{esc(label)}</text>')
        for j, (column, cell) in enumerate(zip(columns, cells[i])):
            x = left + j * width
            fill = EMPTY_FILL if cell.value is None else scale_colour(cell.value)
            value = "" if cell.value is None else f"{cell.value:.6f}"
            out.append(
                f'<g><title>{esc(cell.tooltip)}</title>'
                f'<rect class="cell" data-metric="{esc(metric)}" data-row="{esc(key)}" data-column="{esc(column)}" '
                f'data-value="{value}" x="{x:.1f}" y="{y:.1f}" width="{width - 1}" height="{cell_height - 1}" '
                f'fill="{fill}"/>'
                f'<text x="{x + width / 2:.1f}" y="{y + cell_height / 2 + 4:.1f}" text-anchor="middle" '
                f'fill="{_ink(fill)}">{esc(cell.text)}</text></g>'
            )
    out.append("</svg>")
    return "".join(out)


def colour_legend(empty_text: str, steps: int = 20, width: int = 260) -> str:
    """The heatmaps' scale as an SVG strip from 0% to 100%, and the grey of an empty cell."""
    step_w = width / steps
    strip = "".join(
        f'<rect class="scale" x="{10 + k * step_w:.2f}" y="4" width="{step_w + 0.5:.2f}" height="14" '
        f'fill="{scale_colour((k + 0.5) / steps)}"/>' for k in range(steps)
    )
    ticks = "".join(
        f'<text x="{10 + width * f:.1f}" y="32" text-anchor="middle">{int(f * 100)}%</text>'
        for f in (0.0, 0.25, 0.5, 0.75, 1.0)
    )
    grey_x = width + 40
    empty = (f'<rect x="{grey_x}" y="4" width="14" height="14" fill="{EMPTY_FILL}" stroke="#9aa5b1"/>'
             f'<text x="{grey_x + 20}" y="16">{esc(empty_text)}</text>')
    total = grey_x + 30 + text_width(empty_text)
    return (f'<svg class="colour-legend" width="{total:.0f}" height="38" viewBox="0 0 {total:.0f} 38" role="img">'
            f"{strip}{ticks}{empty}</svg>")


@dataclass(frozen=True)
class Bar:
    """One bar: its series (e.g. "planned"), value (inf allowed: drawn full length, hatched), label and colour."""

    series: str
    value: float
    text: str
    colour: str


@dataclass(frozen=True)
class BarGroup:
    """The bars drawn for one label (an expert, a tensor), one under the other."""

    label: str
    bars: tuple[Bar, ...]


def bar_chart(name: str, groups: Sequence[BarGroup], length: int = 520, bar_height: int = 14) -> str:
    """Horizontal bars, proportional to their values (the largest finite value spans ``length`` pixels).

    Each bar's rect carries ``data-group``, ``data-series`` and ``data-value``; an infinite value is drawn
    at full length in a hatched red, its text saying why.
    """
    finite = [b.value for g in groups for b in g.bars if math.isfinite(b.value)]
    top_value = max(finite + [0.0])
    left = max([text_width(g.label) for g in groups] + [40]) + 14
    text_room = max([text_width(b.text) for g in groups for b in g.bars] + [0]) + 16
    group_h = bar_height * max([len(g.bars) for g in groups] + [1]) + 10
    total_w, total_h = left + length + text_room, group_h * len(groups) + 4
    hatch = f"hatch-{name}"  # one pattern per chart: ids stay unique on a page with several charts
    out = [f'<svg class="bars" data-chart="{esc(name)}" width="{total_w:.0f}" height="{total_h}" '
           f'viewBox="0 0 {total_w:.0f} {total_h}" role="img">']
    if len(finite) < sum(len(g.bars) for g in groups):
        out.append(f'<defs><pattern id="{esc(hatch)}" width="6" height="6" patternUnits="userSpaceOnUse" '
                   'patternTransform="rotate(45)"><rect width="3" height="6" fill="#d64545"/></pattern></defs>')
    for i, group in enumerate(groups):
        y0 = 4 + i * group_h
        label_y = y0 + bar_height * len(group.bars) / 2 + 4
        out.append(f'<text x="{left - 8:.1f}" y="{label_y:.1f}" text-anchor="end">{esc(group.label)}</text>')
        for k, bar in enumerate(group.bars):
            y = y0 + k * bar_height
            infinite = not math.isfinite(bar.value)
            w = length if infinite else (bar.value / top_value * length if top_value > 0 else 0.0)
            fill = f"url(#{esc(hatch)})" if infinite else esc(bar.colour)
            out.append(
                f'<g><title>{esc(group.label)}: {esc(bar.series)} {esc(bar.text)}</title>'
                f'<rect class="bar" data-group="{esc(group.label)}" data-series="{esc(bar.series)}" '
                f'data-value="{bar.value!r}" x="{left}" y="{y}" width="{w:.3f}" height="{bar_height - 2}" '
                f'fill="{fill}"/>'
                f'<text x="{left + w + 6:.1f}" y="{y + bar_height - 4}" fill="#52606d">{esc(bar.text)}</text></g>'
            )
    out.append("</svg>")
    return "".join(out)
