"""export_delta: the exported tensors against plain-torch references, the files, and what it refuses.

References: fp32(E) − fp32(B) from safetensors-loaded tensors, the trim by a stable descending sort of
|Δ| (ties by position), casts by torch; file layout read from the raw headers.
"""

from __future__ import annotations

import json

import pytest
import torch

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.export_delta import export_delta
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.errors import MergePipeError
from tests.fixtures.checkpoints import DTYPES, load_tensors
from tests.fixtures.delta_checkpoints import reference_deltas
from tests.planner.support import raw_layout

BLOCK = 1024


@pytest.fixture
def exporting(tmp_path, tiny_family):
    with Catalog.create(tmp_path / "c.db", block_bytes=BLOCK) as catalog:
        for model_id in ("base", "e1", "e3"):
            register_model(catalog, model_id, tiny_family[model_id])
        analyze(catalog, ["e3"], base_id="base", progress=False)
        yield catalog


def _trimmed(delta: torch.Tensor, density: float) -> torch.Tensor:
    flat = delta.reshape(-1)
    k = max(1, int(density * flat.numel()))
    order = torch.sort(flat.abs(), descending=True, stable=True).indices
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order[:k]] = True
    return torch.where(keep, flat, torch.zeros(())).view(delta.shape)


def _changed(base: dict, expert: dict) -> set[str]:
    return {n for n, b in base.items() if not torch.equal(b.view(torch.uint8), expert[n].view(torch.uint8))}


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
def test_exported_tensors_are_the_cast_deltas_of_changed_tensors(exporting, tiny_family, tmp_path, dtype):
    report = export_delta(exporting, "e3", tmp_path / "out", dtype=dtype)
    got = load_tensors(tmp_path / "out")
    base, expert = load_tensors(tiny_family["base"]), load_tensors(tiny_family["e3"])
    assert set(got) == _changed(base, expert)  # identical tensors (embeddings) are left out
    assert "model.embed_tokens.weight" not in got
    reference = reference_deltas(tiny_family["base"], tiny_family["e3"])
    for name, value in got.items():
        assert value.dtype == DTYPES[dtype.lower()]
        assert torch.equal(value, reference[name].to(value.dtype)), name
    assert report.tensors == len(got) and not report.analysed
    assert report.total_bytes == sum(p.stat().st_size for p in (tmp_path / "out").iterdir())


@pytest.mark.parametrize("density", [0.1, 0.5])
def test_a_trimmed_export_keeps_each_tensors_top_entries(exporting, tiny_family, tmp_path, density):
    export_delta(exporting, "e3", tmp_path / "out", density=density)
    got = load_tensors(tmp_path / "out")
    reference = reference_deltas(tiny_family["base"], tiny_family["e3"])
    for name, value in got.items():
        expected = _trimmed(reference[name], density)
        assert torch.equal(value, expected), name
        assert int((value != 0).sum()) <= max(1, int(density * value.numel()))


def test_the_description_and_the_files(exporting, tiny_family, tmp_path):
    export_delta(exporting, "e3", tmp_path / "out", density=0.25)
    info = json.loads((tmp_path / "out" / "mergepipe_delta.json").read_text())
    assert info["format"] == "dense" and info["block_bytes"] == BLOCK
    assert info["base_fingerprint"] == exporting.blocks.content_fingerprint("base")
    assert (info["base_id"], info["expert_id"], info["dtype"], info["density"]) == ("base", "e3", "F32", 0.25)
    assert (tmp_path / "out" / "config.json").read_bytes() == (tiny_family["base"] / "config.json").read_bytes()
    assert {t.file.name for t in raw_layout(tmp_path / "out").values()} == {"model.safetensors"}


def test_a_sharded_base_gives_a_sharded_delta(tmp_path, sharded_family):
    with Catalog.create(tmp_path / "c.db", block_bytes=BLOCK) as catalog:
        for model_id in ("base", "e1"):
            register_model(catalog, model_id, sharded_family[model_id])
        report = export_delta(catalog, "e1", tmp_path / "out", base="base")
        assert report.analysed  # analysed first, since it was not
    base_files = {n: t.file.name for n, t in raw_layout(sharded_family["base"]).items()}
    out = raw_layout(tmp_path / "out")
    assert len({t.file.name for t in out.values()}) > 1
    assert {n: t.file.name for n, t in out.items()} == {n: base_files[n] for n in out}
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: t.file.name for n, t in out.items()}


def test_refusals(exporting, tmp_path):
    with pytest.raises(MergePipeError, match="which base is 'e1' a delta of"):
        export_delta(exporting, "e1", tmp_path / "a")
    with pytest.raises(MergePipeError, match="density must be in"):
        export_delta(exporting, "e3", tmp_path / "b", density=1.5)
    export_delta(exporting, "e3", tmp_path / "d")
    fingerprint = json.loads((tmp_path / "d" / "mergepipe_delta.json").read_text())["base_fingerprint"]
    assert fingerprint
    register_model(exporting, "e3d", tmp_path / "d", kind="delta", base="base")
    with pytest.raises(MergePipeError, match="is a delta checkpoint already"):
        export_delta(exporting, "e3d", tmp_path / "c")
