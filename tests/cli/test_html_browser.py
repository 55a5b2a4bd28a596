"""`explain --html` and `diff --html` in a real headless browser: no console errors, the heatmap is
painted, and long names are never clipped.

Debian's `chromium` (installed by `.ci/run` when missing) renders the page
and takes a screenshot; the test finds the heatmap's cells in it by their
exact fill colours (read from the page's SVG) and checks that they cover the
cells' area and that the region is not blank. Skipped, saying why, where no
chromium binary or no Pillow is available. A control page with a deliberate
console error first shows that this chromium reports console messages at all.

Pages of a 60-character model id and a 120-character tensor name are measured
by the browser itself: a copy of each page, its Content-Security-Policy taken
out, gets a script that writes every chart's and every label's box (as laid
out, in the browser's fonts) into the DOM, which ``--dump-dom`` prints; the
screenshot at 1280 px then shows that nothing painted past the panels.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.app.reports import EMPTY_FILL
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.fixtures.cli import invoke
from tests.planner.support import build_catalog

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WINDOW = (1200, 1600)
CONSOLE = re.compile(r":CONSOLE[:(]|Uncaught|Refused to|net::ERR_")


def _browser() -> str:
    found = next((path for path in map(shutil.which, BROWSERS) if path), None)
    if found is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    return found


def render(browser: str, page: Path, shot: Path, profile: Path, window: tuple[int, int] = WINDOW) -> str:
    """Screenshot ``page`` in a fresh headless profile and a ``window`` (width, height); chromium's stderr
    (its console log)."""
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
         f"--window-size={window[0]},{window[1]}", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    return proc.stderr


@pytest.fixture(scope="module")
def report(tiny_family, tmp_path_factory):
    """An explain page of a 40% TIES merge of two experts, rendered by the browser."""
    browser = _browser()
    image = pytest.importorskip("PIL.Image", reason="Pillow reads the screenshot (installed by `make test`)")
    root = tmp_path_factory.mktemp("browser")
    db = build_catalog(root / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")},
                       base="base", experts=["e1", "e2"])
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="40%"))
        Engine(catalog).execute(plan, out=root / "m", model_id="m")
    page = root / "report.html"
    invoke(CliRunner(), ["explain", "--db", db, "m", "--html", page])
    log = render(browser, page, root / "report.png", root / "profile")
    pixels = np.asarray(image.open(root / "report.png").convert("RGB")).astype(int)
    return {"browser": browser, "root": root, "page": page.read_text(encoding="utf-8"), "log": log,
            "pixels": pixels}


def test_the_browser_reports_console_errors_of_a_broken_page(report):
    """The control: the same invocation does show a console error, so its absence below means something."""
    broken = report["root"] / "broken.html"
    broken.write_text("<!DOCTYPE html><html><body><p>x</p><script>console.error('probe'); missing();</script>"
                      "</body></html>")
    log = render(report["browser"], broken, report["root"] / "broken.png", report["root"] / "profile-broken")
    assert CONSOLE.search(log), "this chromium does not log console messages to stderr"


def test_the_report_renders_without_console_errors(report):
    assert report["pixels"].shape[:2] == (WINDOW[1], WINDOW[0])
    problems = [line for line in report["log"].splitlines() if CONSOLE.search(line)]
    assert not problems, problems


def test_the_heatmap_is_painted(report):
    """Every heatmap cell's colour covers most of the cell's area in the screenshot, and the heatmaps'
    region varies (cells of several colours, their labels): not blank."""
    cells = re.findall(r'<rect class="cell"[^>]*width="([\d.]+)" height="([\d.]+)" fill="(#[0-9a-f]{6})"',
                       report["page"])
    painted = [(float(w) * float(h), fill) for w, h, fill in cells if fill != EMPTY_FILL]
    assert len(painted) >= 4
    pixels = report["pixels"]
    found = np.zeros(pixels.shape[:2], dtype=bool)
    for fill in {f for _, f in painted}:
        rgb = np.array([int(fill[i:i + 2], 16) for i in (1, 3, 5)])
        match = (pixels == rgb).all(axis=2)
        area = sum(a for a, f in painted if f == fill)
        assert match.sum() >= 0.6 * area, (fill, int(match.sum()), area)
        found |= match
    ys, xs = np.nonzero(found)
    region = pixels[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    assert ys.max() < WINDOW[1] and region.std() > 20
    assert len({tuple(p) for p in region.reshape(-1, 3)[::7]}) > 10


# ------------------------------------------------------------------ long names, measured by the browser

LONG_TENSOR = "model.layers.0.mlp.down_proj." + "x" * 84 + ".weight"  # 120 characters, in layer 0
LONG_MODEL = "acme-research/llama-3.1-8b-instruct-dpo-merged-experiment-v1"  # 60 characters
RENAMED = "model.layers.0.mlp.down_proj.weight"
BACKGROUND = (0xF5, 0xF7, 0xFA)  # the page's --bg, around the panels
WIDE = (1280, 1600)  # a laptop's window
# Writes what the browser laid out: each chart's box, its panel's, and the box of every text in it.
PROBE = """<script>
const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const out = {innerWidth, scrollWidth: document.documentElement.scrollWidth, charts: [],
             scrolls: [...document.querySelectorAll(".scroll")].map((e) => [e.scrollWidth, e.clientWidth])};
for (const svg of document.querySelectorAll("main svg")) {
  out.charts.push({kind: svg.getAttribute("class"), natural: Number(svg.getAttribute("width")), box: box(svg),
                   panel: box(svg.closest("section")),
                   texts: [...svg.querySelectorAll("text")].map((t) => [t.textContent, box(t)])});
}
const pre = document.createElement("pre");
pre.id = "probe";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def measure(browser: str, page: Path, window: tuple[int, int], profile: Path) -> dict:
    """What ``PROBE`` finds in ``page`` laid out in a ``window`` (width, height)."""
    probe = page.with_name(f"{page.stem}-probe-{window[0]}.html")
    text = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page.read_text(encoding="utf-8"))
    probe.write_text(text.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}", "--dump-dom",
         probe.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert proc.returncode == 0 and found, proc.stderr[-2000:]
    return json.loads(html.unescape(found.group(1)))


def _inside(inner: list[float], outer: list[float], slack: float = 0.5) -> bool:
    return (inner[0] >= outer[0] - slack and inner[1] >= outer[1] - slack
            and inner[2] <= outer[2] + slack and inner[3] <= outer[3] + slack)


def _renamed_copy(source: Path, dest: Path) -> Path:
    """``source``'s checkpoint with one tensor under ``LONG_TENSOR``'s name."""
    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    tensors[LONG_TENSOR] = tensors.pop(RENAMED)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def long_names(tiny_family, tmp_path_factory):
    """`explain --html` and `diff --html` of two versions of a merge of ``LONG_MODEL`` and ``math@2``
    (models with ``LONG_TENSOR``) into ``LONG_MODEL``-merged; the pages' paths."""
    browser = _browser()
    root = tmp_path_factory.mktemp("long-names")
    copies = {name: _renamed_copy(tiny_family[name], root / name) for name in ("base", "e1", "e2")}
    out = f"{LONG_MODEL}-merged"
    db = root / "c.db"
    with Catalog.create(db, 2048) as catalog:
        register_model(catalog, "base", copies["base"])
        register_model(catalog, LONG_MODEL, copies["e1"])
        register_model(catalog, "math", copies["e1"])
        register_model(catalog, "math", copies["e2"], new_version=True)
        analyze(catalog, [LONG_MODEL, "math@2"], base_id="base", progress=False)
        for k, (operator, budget) in enumerate((("ties", "40%"), ("task_arithmetic", "60%"))):
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=[LONG_MODEL, "math@2"], operator=operator,
                                                      budget=budget))
            Engine(catalog).execute(plan, out=root / f"m{k}", model_id=out)
    pages = {"explain": root / "explain.html", "diff": root / "diff.html"}
    invoke(CliRunner(), ["explain", "--db", db, out, "--html", pages["explain"]])
    invoke(CliRunner(), ["diff", "--db", db, f"{out}@1", out, "--top", "1000", "--html", pages["diff"]])
    return {"browser": browser, "root": root, **pages}


@pytest.mark.parametrize("which", ["explain", "diff"])
@pytest.mark.parametrize("width", [WIDE[0], 640])
def test_long_names_are_never_clipped(long_names, which, width):
    """Every label lies inside its chart and every chart inside its panel, as the browser lays them out;
    at 1280 px the charts are drawn at their own size and nothing scrolls, at 640 px they scale down."""
    page = long_names[which]
    text = page.read_text(encoding="utf-8")
    assert LONG_MODEL in text and (which == "explain" or LONG_TENSOR in text)
    layout = measure(long_names["browser"], page, (width, WIDE[1]), long_names["root"] / f"profile-{which}-{width}")
    assert layout["innerWidth"] == width and layout["scrollWidth"] <= width
    assert layout["charts"]
    for chart in layout["charts"]:
        assert _inside(chart["box"], chart["panel"]), chart
        for label, box in chart["texts"]:
            assert _inside(box, chart["box"]), (chart["kind"], label, box, chart["box"])
        drawn = chart["box"][2] - chart["box"][0]
        assert drawn == pytest.approx(chart["natural"], abs=0.5) if width == WIDE[0] else drawn <= chart["natural"]
    if width == WIDE[0]:
        assert all(scroll <= client for scroll, client in layout["scrolls"]), layout["scrolls"]
    else:
        assert any(c["box"][2] - c["box"][0] < c["natural"] - 1 for c in layout["charts"])
    labels = [label for chart in layout["charts"] for label, _ in chart["texts"]]
    assert any("…" in label for label in labels)  # the long names were drawn, shortened in the middle


@pytest.mark.parametrize("which", ["explain", "diff"])
def test_long_names_paint_nothing_past_the_panels_at_1280_px(long_names, which):
    """The screenshot: the charts' colours are painted, and the margin right of the panels (below the
    header) is the page's background everywhere: nothing sticks out."""
    image = pytest.importorskip("PIL.Image", reason="Pillow reads the screenshot (installed by `make test`)")
    root = long_names["root"]
    shot = root / f"{which}-1280.png"
    render(long_names["browser"], long_names[which], shot, root / f"profile-shot-{which}", WIDE)
    pixels = np.asarray(image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[:2] == (WIDE[1], WIDE[0])
    assert ((pixels == (0x2F, 0x6F, 0xBA)).all(axis=2)).sum() > 500  # bars of "planned" / "blocks differ"
    background = (pixels == BACKGROUND).all(axis=2)
    below_header = int(np.argmax(background[:, 0]))
    assert below_header > 0
    # main is 1160 px at most, centred: its panels end 20 px (its padding) inside its right edge
    margin = background[below_header:, (WIDE[0] + 1160) // 2 - 20 + 2:]
    assert margin.all(), np.argwhere(~margin)[:5]
