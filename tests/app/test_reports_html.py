"""`explain --html` and `diff --html`: the pages show the numbers the data says, escaped, self-contained.

Expected values are computed here from the checkpoints' bytes (changed blocks
by byte comparison, block delta norms with torch in fp64) and from the plan,
never from the explanation; the pages are parsed with the standard library.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import re
from html.parser import HTMLParser

import pytest
from safetensors.torch import load_file

from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import ConfigError
from mergepipe.app.reports import MIN_BAR_PX, ExpertExplanation, Explanation, SnapshotDiff, TensorChange
from mergepipe.app.reports import TensorExplanation, render_diff, render_explain
from mergepipe.planner.planner import Planner
from mergepipe.txn.outpath import write_report
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import layer_of, load_tensors
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import block_ranges, build_catalog, changed_blocks, raw_layout, subprocess_env

BLOCK_BYTES = 2048
WEIGHTS = {"e1": 1.0, "e2": 0.5}
BAR_LENGTH = 520  # the charts' full bar length in pixels


class Page(HTMLParser):
    """Every element (tag, attributes, the attributes of the enclosing <svg>) and all text of a page."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict, dict]] = []
        self.text: list[str] = []
        self._svgs: list[dict] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs, self._svgs[-1] if self._svgs else {}))
        if tag == "svg":
            self._svgs.append(attrs)

    def handle_endtag(self, tag):
        if tag == "svg":
            self._svgs.pop()

    def handle_data(self, data):
        self.text.append(data)

    def rects(self, cls: str) -> list[tuple[dict, dict]]:
        return [(a, svg) for tag, a, svg in self.elements if tag == "rect" and a.get("class") == cls]


def assert_self_contained(text: str) -> None:
    """No network reference of any kind: one file that renders offline."""
    lowered = text.lower()
    for needle in ("http://", "https://", "<script", "<link", "<img", "<iframe", "src=", "@import", "//cdn"):
        assert needle not in lowered, needle
    assert lowered.count("url(") == lowered.count("url(#")
    assert "content-security-policy" in lowered


def assert_proportional(bars: list[dict], length: float = BAR_LENGTH) -> None:
    """Bar widths are value / largest value × the full length."""
    values = [float(b["data-value"]) for b in bars]
    top = max(v for v in values if math.isfinite(v))
    for bar, value in zip(bars, values):
        expected = length if math.isinf(value) else value / top * length
        assert abs(float(bar["width"]) - expected) < 1e-2, (bar, expected)


def block_energy(base: dict, expert: dict, layout: dict) -> dict[str, list[float]]:
    """‖Δ_b‖² per block of every tensor (fp64), blocks per the ARCHITECTURE contract."""
    out = {}
    for name, t in layout.items():
        delta = (expert[name].double() - base[name].double())
        ranges = block_ranges(t, BLOCK_BYTES)
        if len(ranges) == 1:
            out[name] = [float((delta ** 2).sum())]
            continue
        row_bytes = t.nbytes // t.shape[0]
        out[name] = [float((delta[(b0 - t.begin) // row_bytes:(b1 - t.begin) // row_bytes] ** 2).sum())
                     for b0, b1 in ranges]
    return out


@pytest.fixture(scope="module")
def merged(tiny_family, tmp_path_factory):
    """A 30% TIES merge of e1, e2 (weights 1, 0.5), a second merge to diff against, and a plan never run."""
    root = tmp_path_factory.mktemp("html")
    db = build_catalog(root / "c.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2", "e3"])
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", weights=list(WEIGHTS.values()), params={"density": 0.5}, budget="30%"))
        snapshot_id, manifest = Engine(catalog).execute(plan, out=root / "merged", model_id="merged")
        other = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", budget="60%"))
        Engine(catalog).execute(other, out=root / "other", model_id="other")
        unused = Planner(catalog).plan(MergeRequest(base="base", experts=["e3"], operator="task_arithmetic", budget="50%"))
        catalog.plans.save(unused.digest, unused.to_json_str())
    return {"root": root, "db": db, "plan": plan, "manifest": manifest, "snapshot_id": snapshot_id,
            "unused": unused, "family": tiny_family}


def _written_seconds(merged) -> dict[str, float]:
    """The phase timings the snapshot's manifest.json records (those of the returned manifest add publish)."""
    return json.loads((merged["root"] / "merged" / "manifest.json").read_text())["cost"]["realized"]["seconds"]


def _explain_page(merged, tmp_path, monkeypatch, target="merged") -> str:
    out = tmp_path / "report.html"
    invoke(wide_runner(monkeypatch), ["explain", "--db", merged["db"], target, "--html", out])
    return out.read_text(encoding="utf-8")


def test_heatmaps_show_each_layer_and_experts_share_of_blocks_read_and_energy_kept(merged, tmp_path, monkeypatch):
    page = Page(_explain_page(merged, tmp_path, monkeypatch))
    family, plan = merged["family"], merged["plan"]
    layout = raw_layout(family["base"])
    base = load_tensors(family["base"])
    keys = {name: "other" if layer_of(name) is None else str(layer_of(name)) for name in layout}
    cells = {(a["data-metric"], a["data-row"], a["data-column"]): a for a, _ in page.rects("cell")}
    assert len(cells) == len(page.rects("cell")) == 2 * len(set(keys.values())) * len(WEIGHTS)
    for expert in WEIGHTS:
        changed = changed_blocks(family["base"], family[expert], BLOCK_BYTES)
        energy = block_energy(base, load_tensors(family[expert]), layout)
        for key in set(keys.values()):
            names = [n for n in layout if keys[n] == key]
            reads = {n: set(plan.reads_of(n, expert)) for n in names}
            n_changed = sum(len(changed[n]) for n in names)
            read_cell, energy_cell = cells["read", key, expert], cells["energy", key, expert]
            if n_changed == 0:
                assert read_cell["data-value"] == energy_cell["data-value"] == ""
                continue
            assert float(read_cell["data-value"]) == pytest.approx(
                sum(len(reads[n]) for n in names) / n_changed, abs=1e-6)
            total = sum(energy[n][i] for n in names for i in changed[n])
            kept = sum(energy[n][i] for n in names for i in reads[n])
            assert float(energy_cell["data-value"]) == pytest.approx(kept / total, abs=1e-5)
    assert any(0 < float(a["data-value"]) < 1 for a, _ in page.rects("cell") if a["data-value"])


def test_bytes_per_expert_are_the_plans_and_proportional(merged, tmp_path, monkeypatch):
    text = _explain_page(merged, tmp_path, monkeypatch)
    assert_self_contained(text)
    page = Page(text)
    bars = [a for a, svg in page.rects("bar") if svg.get("data-chart") == "bytes"]
    family, plan, manifest = merged["family"], merged["plan"], merged["manifest"]
    layout = raw_layout(family["base"])
    by = {(b["data-group"], b["data-series"]): float(b["data-value"]) for b in bars}
    for expert in WEIGHTS:
        changed = changed_blocks(family["base"], family[expert], BLOCK_BYTES)
        changed_bytes = sum(block_ranges(t, BLOCK_BYTES)[i][1] - block_ranges(t, BLOCK_BYTES)[i][0]
                            for name, t in layout.items() for i in changed[name])
        assert by[expert, "changed"] == changed_bytes
        assert by[expert, "planned"] == plan.cost.expert_bytes_by_model[expert]
        assert by[expert, "realized"] == manifest.cost.realized.expert_bytes_by_model[expert]
    assert_proportional(bars)
    summary = " ".join(page.text)
    for phase in _written_seconds(merged):
        assert phase in summary
    assert merged["snapshot_id"] in summary and "MergePipe explain: merged" in summary


def test_lineage_graph_draws_the_parents_and_the_omitted_table_lists_tensors(merged, tmp_path, monkeypatch):
    page = Page(_explain_page(merged, tmp_path, monkeypatch))
    nodes = {a["data-id"] for a, _ in page.rects("node")}
    assert nodes == {"merged", "base", "e1", "e2"}
    edges = {(a["data-parent"], a["data-child"], a["data-role"]) for tag, a, _ in page.elements
             if tag == "path" and a.get("class") == "edge"}
    assert edges == {("base", "merged", "base"), ("e1", "merged", "expert"), ("e2", "merged", "expert")}
    data = json.loads(invoke(wide_runner(monkeypatch), ["explain", "--db", merged["db"], "merged", "--json"]))
    omitted = sorted(data["tensors"], key=lambda t: -(sum(t["energy"].values()) - sum(t["kept_energy"].values())))
    text = " ".join(page.text)
    assert omitted[0]["tensor"] in text  # the largest omitted energy is listed, its name in full


def test_json_only_gains_keys_and_the_new_energies_are_the_weighted_block_norms(merged, monkeypatch):
    data = json.loads(invoke(wide_runner(monkeypatch), ["explain", "--db", merged["db"], "merged", "--json"]))
    assert {"plan_id", "snapshot_id", "budget_bytes", "retained_energy", "tensors", "experts", "reused_from",
            "update_bound", "error_share", "full_expert_bytes"} <= set(data)
    assert data["seconds"] == _written_seconds(merged) and data["seconds"]
    family = merged["family"]
    layout, base = raw_layout(family["base"]), load_tensors(family["base"])
    energies = {e: block_energy(base, load_tensors(family[e]), layout) for e in WEIGHTS}
    changed = {e: changed_blocks(family["base"], family[e], BLOCK_BYTES) for e in WEIGHTS}
    for t in data["tensors"]:
        assert {"tensor", "layer", "blocks", "changed", "read", "planned_bytes", "retained_energy", "store",
                "reused_blocks", "reused_bytes", "updated_blocks"} <= set(t)
        for e, w in WEIGHTS.items():
            expected = w ** 2 * sum(energies[e][t["tensor"]][i] for i in changed[e][t["tensor"]])
            assert t["energy"][e] == pytest.approx(expected, rel=1e-4, abs=1e-12)
        total = sum(t["energy"].values())
        assert t["retained_energy"] == pytest.approx(sum(t["kept_energy"].values()) / total if total else 1.0)


def test_a_plan_not_executed_has_its_inputs_as_lineage_and_no_phase_times(merged, tmp_path, monkeypatch):
    page = Page(_explain_page(merged, tmp_path, monkeypatch, target=merged["unused"].digest[:12]))
    nodes = {a["data-id"] for a, _ in page.rects("node")}
    assert nodes == {merged["unused"].digest, "base", "e3"}
    bars = [a for a, _ in page.rects("bar")]
    assert {b["data-series"] for b in bars} == {"changed", "planned"}  # nothing realized yet
    assert "not executed" in " ".join(page.text)


def test_diff_page_charts_the_relative_change_largest_first(merged, tmp_path, monkeypatch):
    out = tmp_path / "diff.html"
    invoke(wide_runner(monkeypatch), ["diff", "--db", merged["db"], "merged", "other", "--top", "1000",
                                      "--html", out])
    text = out.read_text(encoding="utf-8")
    assert_self_contained(text)
    page = Page(text)
    bars = [a for a, _ in page.rects("bar")]
    a, b = (load_file(str(merged["root"] / d / "model.safetensors")) for d in ("merged", "other"))
    expected = {n: float((b[n].double() - a[n].double()).norm() / a[n].double().norm()) for n in a}
    assert {bar["data-group"] for bar in bars} == {n for n, v in expected.items() if v != 0}
    for bar in bars:
        assert float(bar["data-value"]) == pytest.approx(expected[bar["data-group"]], rel=1e-12)
    values = [float(bar["data-value"]) for bar in bars]
    assert values == sorted(values, reverse=True)
    assert_proportional(bars)
    assert "operator: ties -> task_arithmetic" in " ".join(page.text)


# ------------------------------------------------------------------ the pure renderers, on crafted data

NASTY_TENSOR = 'model.layers.0.<script>alert("x")</script>&amp;.weight'
NASTY_EXPERT = "ex<p&\"q'r"


def _crafted_explanation() -> Explanation:
    tensor = TensorExplanation(tensor=NASTY_TENSOR, layer=0, blocks=4, changed={NASTY_EXPERT: 4},
                               read={NASTY_EXPERT: 1}, planned_bytes=100, retained_energy=0.25, store={},
                               energy={NASTY_EXPERT: 8.0}, kept_energy={NASTY_EXPERT: 2.0})
    expert = ExpertExplanation(expert=NASTY_EXPERT, planned_bytes=100, realized_bytes=None, full_bytes=400,
                               share=1.0)
    return Explanation(plan_id="f" * 64, snapshot_id=None, operator="ties", policy="energy", budget_bytes=100,
                       planned_expert_bytes=100, realized_expert_bytes=None, full_expert_bytes=400, error_bound=1.5,
                       error_bound_kind="bound", error_share=0.5, retained_energy=0.25, tensors=(tensor,),
                       experts=(expert,))


def test_names_are_escaped_everywhere():
    lineage = {"id": "<root>", "label": "<b>root</b>", "role": None,
               "parents": [{"id": NASTY_EXPERT, "label": NASTY_EXPERT, "role": "expert", "parents": []}]}
    text = render_explain(_crafted_explanation().to_json(), lineage)
    assert "<script" not in text and "<b>root" not in text and "<root>" not in text
    page = Page(text)
    assert {tag for tag, _, _ in page.elements} <= {"html", "head", "meta", "title", "style", "body", "header", "h1",
                                                    "h2", "h3", "p", "main", "section", "div", "span", "b", "table",
                                                    "thead", "tbody", "tr", "th", "td", "svg", "g", "title", "rect",
                                                    "text", "path", "polygon", "defs", "pattern"}
    texts = " ".join(page.text)
    assert NASTY_TENSOR in texts and NASTY_EXPERT in texts and "<b>root</b>" in texts
    cells = {a["data-metric"]: a for a, _ in page.rects("cell")}
    assert cells["read"]["data-column"] == NASTY_EXPERT
    assert float(cells["read"]["data-value"]) == 0.25 and float(cells["energy"]["data-value"]) == 0.25
    assert {a["data-id"] for a, _ in page.rects("node")} == {"<root>", NASTY_EXPERT}
    assert_self_contained(text)


def test_diff_renderer_escapes_and_draws_an_infinite_change_full_length():
    result = SnapshotDiff("a<1>", "b&2", inputs=["expert changed: <x> -> &y"],
                          tensors=[TensorChange("t<1>", math.inf, ["e<"]), TensorChange("t2", 0.5, []),
                                   TensorChange("t3", 0.125, ["e"]), TensorChange("t4", 0.0, [])])
    text = render_diff(result.to_json())
    assert "<x>" not in text and "<1>" not in text
    page = Page(text)
    bars = {a["data-group"]: a for a, _ in page.rects("bar")}
    assert list(bars) == ["t<1>", "t2", "t3"]  # unchanged tensors are counted, not drawn
    assert float(bars["t<1>"]["width"]) == float(bars["t2"]["width"]) == BAR_LENGTH
    assert float(bars["t3"]["width"]) == pytest.approx(BAR_LENGTH / 4)
    assert bars["t<1>"]["fill"].startswith("url(#")
    texts = " ".join(page.text)
    assert "expert changed: <x> -> &y" in texts and "a<1> → b&2" in texts and "3 of 4" in texts
    assert_self_contained(text)


def test_lineage_graph_draws_each_model_once_with_every_arrow_pointing_right():
    def node(ident, role, parents=()):
        return {"id": ident, "label": ident, "role": role, "parents": list(parents)}

    root = node("m@2", None, [node("base", "base"), node("b", "expert"),
                              node("m", "previous version", [node("base", "base"), node("a", "expert")])])
    page = Page(render_explain(_crafted_explanation().to_json(), root))
    boxes = {a["data-id"]: a for a, _ in page.rects("node")}
    assert sorted(boxes) == ["a", "b", "base", "m", "m@2"]
    edges = [a for tag, a, _ in page.elements if tag == "path" and a.get("class") == "edge"]
    assert len(edges) == 5
    for edge in edges:
        parent, child = boxes[edge["data-parent"]], boxes[edge["data-child"]]
        assert float(parent["x"]) + float(parent["width"]) < float(child["x"])
    # base -> m@2 skips the middle column: it passes between that column's boxes, not through them
    skip = next(e for e in edges if (e["data-parent"], e["data-child"]) == ("base", "m@2"))
    lane = float(skip["d"].split(" L ")[1].split()[1])
    for ident in ("b", "m"):
        top = float(boxes[ident]["y"])
        assert not top <= lane <= top + float(boxes[ident]["height"])


# ------------------------------------------------------------------ long names: whole or shortened, never cut

LONG_TENSOR = "model.layers.0.mlp.down_proj." + "x" * 84 + ".weight"
LONG_MODEL = "acme-research/llama-3.1-8b-instruct-dpo-merged-experiment-v1"
# DejaVu Sans Mono, the charts' font: advance, ascent and descent per em (its hmtx/hhea tables)
ADVANCE_EM, ASCENT_EM, DESCENT_EM = 1233 / 2048, 1901 / 2048, 483 / 2048
FONT_PX = 12


class Drawing(HTMLParser):
    """Every <text> of every <svg>: (the svg's attributes, the text's, its content, the tooltip of the
    innermost <g> around it)."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.texts: list[tuple[dict, dict, str, str | None]] = []
        self.svgs: list[dict] = []
        self._open: list[list] = []  # inside an svg: [tag, attributes, text, title]
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        if tag == "svg":
            self.svgs.append(dict(attrs))
        if self.svgs and (self._open or tag == "svg"):
            self._open.append([tag, dict(attrs), "", None])

    def handle_endtag(self, tag):
        if not self._open:
            return
        name, attrs, text, _ = self._open.pop()
        assert name == tag, (name, tag)
        if tag == "title":
            self._open[-1][3] = text
        elif tag == "text":
            title = next((t for n, _, _, t in reversed(self._open) if n == "g"), None)
            self.texts.append((self.svgs[-1], attrs, text, title))

    def handle_data(self, data):
        if self._open:
            self._open[-1][2] += data


def _extent(attrs: dict, text: str) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of a text's glyph boxes in its svg's units, from the font's metrics."""
    width = len(text) * ADVANCE_EM * FONT_PX
    if "transform" in attrs:
        tx, ty, angle = map(float, re.fullmatch(r"translate\(([-\d.]+) ([-\d.]+)\) rotate\(([-\d.]+)\)",
                                                attrs["transform"]).groups())
        x, y, anchor = 0.0, 0.0, attrs.get("text-anchor", "start")
    else:
        tx, ty, angle = 0.0, 0.0, 0.0
        x, y, anchor = float(attrs["x"]), float(attrs["y"]), attrs.get("text-anchor", "start")
    start = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
    cos, sin = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    corners = [(cx * cos - cy * sin + tx, cx * sin + cy * cos + ty)
               for cx in (start, start + width) for cy in (y - ASCENT_EM * FONT_PX, y + DESCENT_EM * FONT_PX)]
    return (min(c[0] for c in corners), min(c[1] for c in corners),
            max(c[0] for c in corners), max(c[1] for c in corners))


def _long_named_pages() -> tuple[str, str]:
    """An explain page (with lineage) and a diff page of experts and tensors with long names."""
    experts = (LONG_MODEL, "math@2")
    tensors = tuple(TensorExplanation(tensor=name, layer=layer, blocks=4, changed={e: 4 for e in experts},
                                      read={LONG_MODEL: 1, "math@2": 3}, planned_bytes=2048, retained_energy=0.5,
                                      store={}, energy={e: 2.0 for e in experts}, kept_energy={e: 1.0 for e in experts})
                    for name, layer in ((LONG_TENSOR, 0), ("model.layers.1.mlp.up_proj.weight", 1)))
    result = Explanation(
        plan_id="a" * 64, snapshot_id="snap-0123456789abcdef", operator="ties", policy="energy", budget_bytes=4096,
        planned_expert_bytes=4096, realized_expert_bytes=4096, full_expert_bytes=8192, error_bound=1.5,
        error_bound_kind="bound", error_share=0.5, retained_energy=0.5, tensors=tensors,
        experts=tuple(ExpertExplanation(expert=e, planned_bytes=2048, realized_bytes=2048, full_bytes=4096, share=0.5)
                      for e in experts))

    def node(ident, role, parents=()):
        return {"id": ident, "label": ident, "role": role, "parents": list(parents)}

    lineage = node(f"{LONG_MODEL}-merged@2", None, [
        node("base", "base"), node("math@2", "expert"),
        node(f"{LONG_MODEL}-merged", "previous version", [node("base", "base"), node(LONG_MODEL, "expert")])])
    diff = SnapshotDiff(f"{LONG_MODEL}-merged", f"{LONG_MODEL}-merged@2", inputs=[f"expert changed: {LONG_MODEL}"],
                        tensors=[TensorChange(LONG_TENSOR, math.inf, [LONG_MODEL, "math"]),
                                 TensorChange("model.layers.1.mlp.up_proj.weight", 0.25, ["math"])])
    return render_explain(result.to_json(), lineage), render_diff(diff.to_json())


def test_long_names_are_shortened_in_the_middle_with_the_whole_name_as_tooltip():
    assert (len(LONG_TENSOR), len(LONG_MODEL)) == (120, 60)
    explain, diff = _long_named_pages()
    shortened = [(text, title) for page in (explain, diff) for _, _, text, title in Drawing(page).texts
                 if "…" in text]
    assert shortened
    for text, title in shortened:  # the tooltip holds the whole text (a bar's: its label, series and text)
        head, tail = text.split("…")
        assert title is not None and re.search(re.escape(head) + ".{2,}" + re.escape(tail), title), (text, title)
        assert 0 < len(head) <= len(tail) <= len(head) + 1
    tooltips = {title for _, title in shortened}
    assert LONG_TENSOR in tooltips and LONG_MODEL in tooltips and f"{LONG_MODEL}-merged@2" in tooltips
    headers = [a for tag, a, _ in Page(explain).elements if tag == "th" and "title" in a]
    assert [a["title"] for a in headers] == [LONG_MODEL]  # the omitted table's expert column
    assert LONG_TENSOR in " ".join(Page(explain).text)  # the table's tensor column: whole, wrapped


@pytest.mark.parametrize("which", ["explain", "diff"])
def test_every_label_lies_inside_its_chart_by_the_fonts_own_metrics(which):
    """Each svg is drawn at its viewBox's size (scaled down by CSS only), and every text's glyph boxes lie
    inside that box: nothing is clipped at the svg's edge."""
    page = dict(zip(("explain", "diff"), _long_named_pages()))[which]
    drawing = Drawing(page)
    for svg in drawing.svgs:
        assert svg["viewbox"] == f"0 0 {svg['width']} {svg['height']}", svg
    assert len(drawing.texts) >= 4
    for svg, attrs, text, _ in drawing.texts:
        width, height = map(float, svg["viewbox"].split()[2:])
        left, top, right, bottom = _extent(attrs, text)
        assert left >= 0 and top >= 0 and right <= width and bottom <= height, (svg["class"], text, attrs)
    assert "svg { display: block; max-width: 100%; height: auto; }" in page


def test_bars_give_long_labels_room_down_to_a_floor_and_stay_proportional():
    _, diff = _long_named_pages()
    page = Page(diff)
    bars = page.rects("bar")
    length = float(bars[0][1]["data-length"])
    assert MIN_BAR_PX <= length < BAR_LENGTH
    assert_proportional([a for a, _ in bars], length)


# ------------------------------------------------------------------ writing


def test_a_report_overwrites_atomically_and_a_bad_path_is_one_line(merged, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.html"
    out.write_text("old")
    write_report(out, "new page")
    assert out.read_text() == "new page" and sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]
    with pytest.raises(ConfigError):
        write_report(tmp_path, "a directory is not a report file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]
    code, _, err = run_main(["explain", "--db", merged["db"], "merged", "--html", tmp_path / "no" / "r.html"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "cannot write the report" in err
    text = _explain_page(merged, tmp_path, monkeypatch)
    assert text.startswith("<!DOCTYPE html>") and text == (tmp_path / "report.html").read_text(encoding="utf-8")


def test_explain_html_does_not_import_torch(merged, tmp_path):
    out = tmp_path / "r.html"
    probe = ("import sys; from mergepipe.cli import cli; "
             f"cli.main(args=['explain', '--db', {str(merged['db'])!r}, 'merged', '--html', {str(out)!r}], "
             "prog_name='mergepipe', standalone_mode=False); print('TORCH-LOADED', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "TORCH-LOADED False" in proc.stdout and out.exists()
