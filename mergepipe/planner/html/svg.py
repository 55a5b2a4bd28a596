"""Small inline-SVG chart primitives: a colour scale, a heatmap with its legend, horizontal bars.

Labels are drawn in a monospace font so their width can be known without a
browser (``text_width``), and every chart is sized from its labels: nothing is
clipped at a fixed width. A label longer than its cap is shortened in the
middle (``Label``: the start and end of a tensor name or model id are the parts
that tell them apart) and keeps its full text as a tooltip; the page's CSS
scales a chart wider than the window down through its ``viewBox``. Every drawn
value also sits in a ``data-*`` attribute of its shape, so tests (and people
reading the source) can check a chart against the numbers it claims to show.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from mergepipe.errors import visible
from mergepipe.planner.html.page import PANEL_PX, esc, shorten

FONT_PX = 12
CHAR_PX = 7.3  # advance of one monospace character at FONT_PX (DejaVu Sans Mono: 0.602 em), rounded up
LABEL_CHARS = 48  # a row label (tensor, expert) in full up to here: a whole Llama tensor name, most model ids
VALUE_CHARS = 56  # the text beside a bar (a size or change, then its experts): fits a panel beside MIN_BAR_PX
MIN_BAR_PX = 260  # bars are shortened to this to fit long labels in a panel, no further: past it, the chart scales
NAME_CHARS = 32  # names set side by side (slanted column headers, lineage boxes): several fit one window
EMPTY_FILL = "#e4e7eb"  # a heatmap cell with nothing to show
# Viridis at five stops: perceptually even, readable in grey and by colour-blind readers.
_STOPS = ((0x44, 0x01, 0x54), (0x3B, 0x52, 0x8B), (0x21, 0x91, 0x8C), (0x5E, 0xC9, 0x62), (0xFD, 0xE7, 0x25))


def _cells(char: str) -> int:
    """Monospace cells of one character: none for a combining mark, two for a wide (CJK, emoji) one."""
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def text_width(text: str) -> float:
    """Width in pixels of ``text`` as the page shows it, drawn in the charts' monospace font."""
    return sum(map(_cells, visible(text))) * CHAR_PX


@dataclass(frozen=True)
class Label:
    """A text as a chart draws it: ``full`` as the page shows it, ``shown`` the same or, past a cap, its start
    and end joined by an ellipsis (``page.shorten``)."""

    full: str
    shown: str

    @classmethod
    def of(cls, text: str, cap: int) -> Label:
        return cls(visible(text), shorten(text, cap))

    @property
    def width(self) -> float:
        return text_width(self.shown)

    def svg(self, attrs: str) -> str:
        """``<text {attrs}>``; when shortened, in a ``<g>`` whose ``<title>`` (the tooltip) is the full text."""
        text = f"<text {attrs}>{esc(self.shown)}</text>"
        return text if self.shown == self.full else f"<g><title>{esc(self.full)}</title>{text}</g>"


def scale_colour(value: float) -> str:
    """``#rrggbb`` for a share in [0, 1] (clamped) on the viridis scale: dark = 0, yellow = 1."""
    v = min(max(value, 0.0), 1.0) * (len(_STOPS) - 1)
    i = min(int(v), len(_STOPS) - 2)
    t = v - i
    rgb = (round(a + (b - a) * t) for a, b in zip(_STOPS[i], _STOPS[i + 1]))
    return "#" + "".join(f"{c:02x}" for c in rgb)


def _ink(fill: str) -> str:
    """Black or white text, whichever reads better on ``fill``."""
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


@dataclass(frozen=True)
class Cell:
    """One heatmap cell: a share in [0, 1] (None: nothing to measure, drawn grey), its text and tooltip."""

    value: float | None
    text: str
    tooltip: str


def svg_open(attrs: str, width: float, height: float) -> str:
    """The opening tag of a chart drawn on ``width`` × ``height`` pixels (rounded up, never cutting the last
    one): its natural size and the ``viewBox`` that lets the page's CSS scale it down to a narrow window."""
    w, h = math.ceil(width), math.ceil(height)
    return f'<svg {attrs} width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img">'


def _column_headers(columns: Sequence[Label], left: float, width: float) -> tuple[list[str], float, float]:
    """The column names above a grid: level when they fit their column, else slanted (at 40°) so that
    long names need no wider cells. (svg elements, height of the header, width they reach to the right
    of the grid)."""
    if all(c.width + 8 <= width for c in columns):
        return (
            [
                c.svg(f'x="{left + (j + 0.5) * width:.1f}" y="{FONT_PX + 2}" text-anchor="middle" font-weight="bold"')
                for j, c in enumerate(columns)
            ],
            FONT_PX + 12.0,
            0.0,
        )
    sin, cos = math.sin(math.radians(40)), math.cos(math.radians(40))
    top = max(c.width for c in columns) * sin + FONT_PX + 6
    reach = max(left + (j + 0.5) * width + c.width * cos for j, c in enumerate(columns))
    texts = [
        c.svg(f'transform="translate({left + (j + 0.5) * width - 3:.1f} {top - 6:.1f}) rotate(-40)" font-weight="bold"')
        for j, c in enumerate(columns)
    ]
    return texts, top, max(reach - (left + width * len(columns)), 0.0) + 4


def heatmap(
    metric: str,
    rows: Sequence[tuple[str, str]],
    columns: Sequence[str],
    cells: Sequence[Sequence[Cell]],
    width: int = 64,
    cell_height: int = 22,
) -> str:
    """A rows × columns grid of coloured cells. ``rows`` are (key, label) pairs; each cell's rect carries
    ``data-metric``, ``data-row`` (the key), ``data-column`` and ``data-value`` (empty when None)."""
    labels = [Label.of(label, LABEL_CHARS) for _, label in rows]
    left = max([label.width for label in labels] + [40]) + 12
    headers, top, beyond = _column_headers([Label.of(c, NAME_CHARS) for c in columns], left, width)
    out = [
        svg_open(
            f'class="heatmap" data-metric="{esc(metric)}"',
            left + width * len(columns) + 2 + beyond,
            top + cell_height * len(rows) + 2,
        ),
        *headers,
    ]
    for i, ((key, _), label) in enumerate(zip(rows, labels)):
        y = top + i * cell_height
        out.append(label.svg(f'x="{left - 8:.1f}" y="{y + cell_height / 2 + 4:.1f}" text-anchor="end"'))
        for j, (column, cell) in enumerate(zip(columns, cells[i])):
            x = left + j * width
            fill = EMPTY_FILL if cell.value is None else scale_colour(cell.value)
            value = "" if cell.value is None else f"{cell.value:.6f}"
            out.append(
                f"<g><title>{esc(cell.tooltip)}</title>"
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
        f'fill="{scale_colour((k + 0.5) / steps)}"/>'
        for k in range(steps)
    )
    ticks = "".join(
        f'<text x="{10 + width * f:.1f}" y="32" text-anchor="middle">{int(f * 100)}%</text>'
        for f in (0.0, 0.25, 0.5, 0.75, 1.0)
    )
    grey_x = width + 40
    empty = (
        f'<rect x="{grey_x}" y="4" width="14" height="14" fill="{EMPTY_FILL}" stroke="#9aa5b1"/>'
        f'<text x="{grey_x + 20}" y="16">{esc(empty_text)}</text>'
    )
    return svg_open('class="colour-legend"', grey_x + 30 + text_width(empty_text), 38) + f"{strip}{ticks}{empty}</svg>"


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
    """Horizontal bars, proportional to their values: the largest finite value spans ``length`` pixels, or
    less (down to ``MIN_BAR_PX``) where long labels need the room to keep the chart within a panel.

    The svg's ``data-length`` is that full length; each bar's rect carries ``data-group``, ``data-series``
    and ``data-value``; an infinite value is drawn at full length in a hatched red, its text saying why.
    A bar's tooltip holds its label and text in full.
    """
    finite = [b.value for g in groups for b in g.bars if math.isfinite(b.value)]
    top_value = max(finite + [0.0])
    labels = [Label.of(g.label, LABEL_CHARS) for g in groups]
    texts = [[Label.of(b.text, VALUE_CHARS) for b in g.bars] for g in groups]
    left = max([label.width for label in labels] + [40]) + 14
    text_room = max([t.width for row in texts for t in row] + [0]) + 16
    length = min(length, max(math.floor(PANEL_PX - left - text_room), MIN_BAR_PX))
    group_h = bar_height * max([len(g.bars) for g in groups] + [1]) + 10
    hatch = f"hatch-{name}"  # one pattern per chart: ids stay unique on a page with several charts
    out = [
        svg_open(
            f'class="bars" data-chart="{esc(name)}" data-length="{length}"',
            left + length + text_room,
            group_h * len(groups) + 4,
        )
    ]
    if len(finite) < sum(len(g.bars) for g in groups):
        out.append(
            f'<defs><pattern id="{esc(hatch)}" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="3" height="6" fill="#d64545"/></pattern></defs>'
        )
    for i, (group, label) in enumerate(zip(groups, labels)):
        y0 = 4 + i * group_h
        label_y = y0 + bar_height * len(group.bars) / 2 + 4
        out.append(label.svg(f'x="{left - 8:.1f}" y="{label_y:.1f}" text-anchor="end"'))
        for k, (bar, text) in enumerate(zip(group.bars, texts[i])):
            y = y0 + k * bar_height
            infinite = not math.isfinite(bar.value)
            w = length if infinite else (bar.value / top_value * length if top_value > 0 else 0.0)
            fill = f"url(#{esc(hatch)})" if infinite else esc(bar.colour)
            out.append(
                f"<g><title>{esc(group.label)}: {esc(bar.series)} {esc(bar.text)}</title>"
                f'<rect class="bar" data-group="{esc(group.label)}" data-series="{esc(bar.series)}" '
                f'data-value="{bar.value!r}" x="{left}" y="{y}" width="{w:.3f}" height="{bar_height - 2}" '
                f'fill="{fill}"/>'
                f'<text x="{left + w + 6:.1f}" y="{y + bar_height - 4}" fill="#52606d">{esc(text.shown)}</text></g>'
            )
    out.append("</svg>")
    return "".join(out)
