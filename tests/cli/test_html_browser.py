"""`explain --html` in a real headless browser: no console errors, and the heatmap is painted.

Debian's `chromium` (installed by `.ci/run` when missing) renders the page
and takes a screenshot; the test finds the heatmap's cells in it by their
exact fill colours (read from the page's SVG) and checks that they cover the
cells' area and that the region is not blank. Skipped, saying why, where no
chromium binary or no Pillow is available. A control page with a deliberate
console error first shows that this chromium reports console messages at all.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.html.svg import EMPTY_FILL
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


def render(browser: str, page: Path, shot: Path, profile: Path) -> str:
    """Screenshot ``page`` in a fresh headless profile; chromium's stderr (its console log)."""
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
         f"--window-size={WINDOW[0]},{WINDOW[1]}", page.resolve().as_uri()],
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
