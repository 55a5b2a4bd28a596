"""The page around the charts: document shell, sections and tables.

Every piece of text that reaches the page goes through ``esc`` (``html.escape``
with quotes), here or in the chart primitives: model ids and tensor names come
from files people made. The Content-Security-Policy makes the promise "no
network" hold in the browser too: the page may not fetch anything. Nothing may
stick out of its panel, nor be cut at its edge: charts scale down to a narrow
window (``svg`` below), long names in text and table cells wrap anywhere, and a
name too long for a column header is shortened in the middle (``shorten``) with
the whole name as its tooltip.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from mergepipe.errors import visible


# No script, no fetch of any kind; inline styles only (the charts are inline SVG).
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
PANEL_PX = 1082  # a panel's content on a wide window: main's 1160 px less its padding, the panel's and its border
HEADER_CHARS = 24  # a table's column header (an expert's id) in full up to here: several experts fit side by side
ELLIPSIS = "…"

_CSS = """
:root { --ink: #1f2933; --muted: #616e7c; --line: #d9e2ec; --panel: #ffffff; --bg: #f5f7fa; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink);
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; }
header { background: #243b53; color: #fff; padding: 18px 32px; }
header h1 { margin: 0; font-size: 22px; font-weight: 600; overflow-wrap: anywhere; }
header p { margin: 4px 0 0; color: #bcccdc; overflow-wrap: anywhere; }
main { max-width: 1160px; margin: 0 auto; padding: 16px 20px 40px; }
section { background: var(--panel); border: 1px solid var(--line); border-radius: 6px;
          padding: 14px 18px; margin: 14px 0; }
h2 { font-size: 16px; margin: 0 0 8px; }
h3 { font-size: 14px; margin: 0 0 6px; }
p.note { color: var(--muted); margin: 6px 0 0; font-size: 13px; }
.mono, code { font-family: "DejaVu Sans Mono", ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; }
table { border-collapse: collapse; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; }
td.num, th.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.name { overflow-wrap: anywhere; min-width: 36ch; }
table.kv th { width: 190px; }
table.kv td, ul.lines li { overflow-wrap: anywhere; }
.charts { display: flex; flex-wrap: wrap; gap: 28px; align-items: flex-start; }
.charts > div { min-width: 0; }
.scroll { overflow-x: auto; }
.legend { display: flex; flex-wrap: wrap; gap: 16px; align-items: center; color: var(--muted);
          font-size: 13px; margin-top: 8px; }
.swatch { display: inline-block; width: 14px; height: 14px; border-radius: 2px; vertical-align: -2px;
          margin-right: 5px; border: 1px solid rgba(0, 0, 0, 0.15); }
ul.lines { margin: 0; padding-left: 20px; }
.tiles { display: flex; flex-wrap: wrap; gap: 12px; margin-bottom: 12px; }
.tile { border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; min-width: 170px; background: #f8fafc; }
.tile b { display: block; font-size: 20px; font-weight: 600; }
.tile span { color: var(--muted); font-size: 12.5px; }
svg { display: block; max-width: 100%; height: auto; }  /* drawn at its size, scaled down to fit */
svg text { font-family: "DejaVu Sans Mono", ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
"""


def esc(text: object) -> str:
    """Text (or a number) safe inside an element or a quoted attribute, control characters shown as
    ``<U+202E>`` (``errors.visible``, what charts measure)."""
    return html.escape(visible(text), quote=True)


def shorten(text: object, cap: int) -> str:
    """``text`` as shown, or, past ``cap`` characters, its start and end joined by an ellipsis: the parts
    that tell tensor names (layer ... module) and model ids (organisation ... version) apart."""
    full = visible(text)
    if len(full) <= cap:
        return full
    head = (cap - 1) // 2
    return full[:head] + ELLIPSIS + full[len(full) - (cap - 1 - head) :]


def document(title: str, subtitle: str, sections: Sequence[str]) -> str:
    """A whole page: head (charset, CSP, style), a header, then the sections in order."""
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{esc(title)}</title>",
            f"<style>{_CSS}</style>",
            "</head>",
            "<body>",
            f"<header><h1>{esc(title)}</h1><p>{esc(subtitle)}</p></header>",
            "<main>",
            *sections,
            "</main>",
            "</body>",
            "</html>",
            "",
        ]
    )


def section(title: str, content: str, note: str | None = None, anchor: str | None = None) -> str:
    """A titled panel; ``content`` is markup already escaped, ``note`` plain text shown under it."""
    ident = f' id="{esc(anchor)}"' if anchor else ""
    tail = f'<p class="note">{esc(note)}</p>' if note else ""
    return f"<section{ident}><h2>{esc(title)}</h2>{content}{tail}</section>"


def key_values(rows: Sequence[tuple[str, str]]) -> str:
    """A two-column table of plain-text labels and values."""
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = (), names: Sequence[int] = (0,)
) -> str:
    """A table of plain text; columns in ``numeric`` align right, those in ``names`` wrap anywhere
    (long tensor names are wrapped, never cut); a header longer than ``HEADER_CHARS`` is shortened."""

    def cls(i: int) -> str:
        kind = "num" if i in numeric else "name mono" if i in names else ""
        return f' class="{kind}"' if kind else ""

    def header(i: int, text: str) -> str:
        shown = shorten(text, HEADER_CHARS)
        tooltip = "" if shown == visible(text) else f' title="{esc(text)}"'
        return f"<th{cls(i) if i in numeric else ''}{tooltip}>{esc(shown)}</th>"

    head = "".join(header(i, h) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{esc(v)}</td>" for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def legend(items: Sequence[tuple[str, str]], extra: str = "") -> str:
    """Colour swatches with their meaning (colour, plain text), then optional markup."""
    spans = "".join(f'<span><span class="swatch" style="background:{esc(c)}"></span>{esc(t)}</span>' for c, t in items)
    return f'<div class="legend">{spans}{extra}</div>'


def tiles(items: Sequence[tuple[str, str]]) -> str:
    """Headline numbers: (value, what it is) in plain text."""
    body = "".join(f'<div class="tile"><b>{esc(v)}</b><span>{esc(t)}</span></div>' for v, t in items)
    return f'<div class="tiles">{body}</div>'


def percent(share: float) -> str:
    """A share in [0, 1] as people read it: whole percents, one decimal near 0% and 100% so that
    "100%" and "0%" only ever mean exactly that."""
    p = 100 * share
    if p in (0.0, 100.0) or 1 <= p <= 99:
        return f"{p:.0f}%"
    if p < 1:
        return f"{math.ceil(p * 10) / 10:.1f}%" if p >= 0.1 else "<0.1%"
    return f"{math.floor(p * 10) / 10:.1f}%" if p <= 99.9 else ">99.9%"
