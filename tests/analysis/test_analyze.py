"""analyze: hashes and delta statistics against plain-torch references."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import save_file

from mergepipe.analysis import analyze as analyze_job
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.errors import (
    CatalogError,
    LayoutMismatchError,
    ModelChangedError,
    UnknownModelError,
)
from mergepipe.spec.operators import DENSITY_GRID
from tests.catalog.conftest import SMALL_BLOCK_BYTES
from tests.catalog.helpers import (
    block_rows,
    db_dump,
    reference_block_stats,
    reference_thresholds,
    row_count,
)
from tests.fixtures.checkpoints import load_tensors


def thresholds_of(catalog, expert_id: str, base_id: str):
    """Tensor -> {density: threshold} of the mergeable tensors of one analysis."""
    stats = catalog.stats.tensor_stats(expert_id, base_id)
    return {name: s.thresholds for name, s in stats.items() if s.mergeable}


@pytest.mark.parametrize("expert", ["e1", "e3"])
def test_block_stats_match_plain_torch(analysed, tiny_family, expert):
    catalog, _ = analysed
    base_t = load_tensors(tiny_family["base"])
    exp_t = load_tensors(tiny_family[expert])
    deltas = catalog.stats.block_deltas(expert, "base")
    assert set(deltas) == set(base_t)
    for name, b in base_t.items():
        expected = reference_block_stats(b, exp_t[name], SMALL_BLOCK_BYTES)
        got = deltas[name]
        assert [d.index for d in got] == list(range(len(expected)))
        for d, (l2, maxabs, nnz, identical) in zip(got, expected):
            assert d.identical == identical, (name, d.index)
            assert d.maxabs == maxabs
            assert d.nnz == nnz
            assert d.l2 == pytest.approx(l2, rel=1e-5, abs=0.0)
    # several blocks per tensor, and an uneven last block, were exercised
    embed = deltas["model.embed_tokens.weight"]
    assert len(embed) == len(block_rows([250, 64], 2, SMALL_BLOCK_BYTES)) == 32


def test_thresholds_match_a_stable_sort(analysed, tiny_family):
    catalog, _ = analysed
    base_t = load_tensors(tiny_family["base"])
    exp_t = load_tensors(tiny_family["e1"])
    thresholds = thresholds_of(catalog, "e1", "base")
    assert set(thresholds) == set(base_t)
    for name, b in base_t.items():
        a = (exp_t[name].float() - b.float()).abs().reshape(-1)
        assert sorted(thresholds[name]) == sorted(DENSITY_GRID)
        for density, thr in thresholds[name].items():
            assert (thr.k, thr.tau, thr.last_index) == reference_thresholds(a, density), (name, density)


def test_untouched_tensors_are_identical(analysed, tiny_family):
    catalog, _ = analysed
    deltas = catalog.stats.block_deltas("e3", "base")
    stats = catalog.stats.tensor_stats("e3", "base")
    for name, blocks in deltas.items():
        untouched = "embed" in name
        assert all(d.identical == untouched for d in blocks), name
        assert stats[name].identical == untouched
    for d in deltas["model.embed_tokens.weight"]:
        assert (d.l2, d.maxabs, d.nnz) == (0.0, 0.0, 0)


def test_block_hashes_are_blake3_of_the_bytes(analysed, tiny_family):
    catalog, report = analysed
    assert set(report.hashed) == {"base", "e1", "e3"}
    for model_id in ("base", "e3"):
        weights = tiny_family[model_id] / "model.safetensors"
        raw = weights.read_bytes()
        for blocks in catalog.blocks.by_tensor(model_id).values():
            for b in blocks:
                assert b.hash == blake3.blake3(raw[b.begin : b.end]).hexdigest()


def test_each_byte_read_once(analysed, tiny_family):
    _, report = analysed
    size = sum(t.numel() * t.element_size() for t in load_tensors(tiny_family["base"]).values())
    assert report.bytes_by_model == {"base": size, "e1": size, "e3": size}
    assert report.bytes_read == 3 * size
    assert report.analyzed == ("e1", "e3") and report.skipped == ()


def test_rerun_reads_nothing(analysed):
    catalog, _ = analysed
    before = db_dump(catalog.path)
    report = analyze(catalog, ["e1", "e3"], base_id="base", progress=False)
    assert report.bytes_read == 0
    assert report.analyzed == () and report.hashed == ()
    assert report.skipped == ("e1", "e3")
    assert analyze(catalog, None, progress=False).bytes_read == 0  # hashes of all models: known
    assert db_dump(catalog.path) == before


def test_new_expert_later_reads_only_what_it_needs(family_catalog, tiny_family):
    analyze(family_catalog, ["e1"], base_id="base", progress=False)
    report = analyze(family_catalog, ["e1", "e3"], base_id="base", progress=False)
    size = family_catalog.models.get("base").total_bytes
    embed = [t for t in family_catalog.models.tensors("base") if "embed" in t.name][0]
    assert report.analyzed == ("e3",) and report.skipped == ("e1",)
    # e3 is read whole (its hashes are unknown); the base is read for Δ
    assert report.bytes_by_model == {"base": size, "e3": size}
    # now that both are hashed, a fresh analysis of e3 skips its identical embeddings entirely
    with family_catalog.transaction():
        family_catalog._db.write("DELETE FROM analyses WHERE expert_id = 'e3'")
    again = analyze(family_catalog, ["e3"], base_id="base", progress=False)
    assert again.bytes_by_model == {"base": size - embed.nbytes, "e3": size - embed.nbytes}
    assert all(d.identical for d in family_catalog.stats.block_deltas("e3", "base")[embed.name])


def test_default_ids(family_catalog):
    report = analyze(family_catalog, None, base_id="base", progress=False)
    assert report.analyzed == ("e1", "e2", "e3")
    assert all(family_catalog.stats.is_analyzed(e, "base") for e in ("e1", "e2", "e3"))
    assert not family_catalog.stats.is_analyzed("base", "e1")
    assert family_catalog.model_status("e2").describe() == "Δ vs base"
    assert family_catalog.model_status("base").describe() == "hashed"


def test_hash_only_without_base(family_catalog):
    report = analyze(family_catalog, ["e2"], progress=False)
    assert report.hashed == ("e2",) and report.analyzed == ()
    assert report.bytes_by_model == {"e2": family_catalog.models.get("e2").total_bytes}
    assert family_catalog.model_status("e2").fully_hashed
    assert family_catalog.model_status("e1").hashed_blocks == 0
    assert family_catalog.stats.analyses() == []


def test_not_analysed_query_says_what_to_run(family_catalog):
    with pytest.raises(CatalogError, match=r"run `mergepipe analyze (--db \S+ )?--base base e1`"):
        family_catalog.stats.block_deltas("e1", "base")


def test_layout_mismatch_lists_differences(catalog, tiny_family, sharded_family):
    register_model(catalog, "llama", tiny_family["base"])
    register_model(catalog, "qwen", sharded_family["base"])
    before = db_dump(catalog.path)
    with pytest.raises(LayoutMismatchError) as info:
        analyze(catalog, ["qwen"], base_id="llama", progress=False)
    message = str(info.value)
    assert message.startswith("expert 'qwen' does not match the layout of base 'llama' (")
    # Qwen3 has no lm_head (tied) and q/k norms that Llama lacks
    assert "(5 differences: tensor 'lm_head.weight' is missing; extra tensor 'model.layers.0.self_attn" in message
    assert "\n" not in message
    assert db_dump(catalog.path) == before


def _write_model(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_dtype_and_shape_differences_are_named(catalog, tmp_path):
    base = _write_model(tmp_path / "b", {"w": torch.zeros(4, 4), "v": torch.zeros(3)})
    other = _write_model(tmp_path / "e", {"w": torch.zeros(4, 4, dtype=torch.float16), "v": torch.zeros(4)})
    register_model(catalog, "b", base)
    register_model(catalog, "e", other)
    with pytest.raises(LayoutMismatchError, match=r"2 differences: 'v' has shape \[4\], base \[3\]; 'w' is F16, base F32"):
        analyze(catalog, ["e"], base_id="b", progress=False)


def test_long_mismatch_lists_the_first_five(catalog, tmp_path):
    base = _write_model(tmp_path / "b", {f"t{i}": torch.zeros(2) for i in range(8)})
    other = _write_model(tmp_path / "e", {f"t{i}": torch.zeros(3) for i in range(8)})
    register_model(catalog, "b", base)
    register_model(catalog, "e", other)
    with pytest.raises(LayoutMismatchError, match=r"\(8 differences: 't0' has shape \[3\], base \[2\]; .*'t4'.*; … 3 more\)"):
        analyze(catalog, ["e"], base_id="b", progress=False)


def test_non_mergeable_and_f32_tensors(catalog, tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 16, generator=g)
    ids = torch.arange(10, dtype=torch.int64)
    base = _write_model(tmp_path / "b", {"w": w, "ids": ids, "same_ids": ids.clone()})
    w2 = w.clone()
    w2[3:5] += 0.5
    expert = _write_model(tmp_path / "e", {"w": w2, "ids": ids + 1, "same_ids": ids.clone()})
    register_model(catalog, "b", base)
    register_model(catalog, "e", expert)
    analyze(catalog, ["e"], base_id="b", progress=False)
    deltas = catalog.stats.block_deltas("e", "b")
    stats = catalog.stats.tensor_stats("e", "b")
    assert [(d.identical, d.l2, d.nnz) for d in deltas["ids"]] == [(False, None, None)]
    assert [(d.identical, d.l2, d.nnz) for d in deltas["same_ids"]] == [(True, 0.0, 0)]
    assert not stats["ids"].mergeable and stats["ids"].thresholds == {}
    assert set(thresholds_of(catalog, "e", "b")) == {"w"}
    # F32 rows are 64 bytes: 16 rows per 1 KiB block, so only block 0 (rows 0-15) changed
    expected = reference_block_stats(w, w2, SMALL_BLOCK_BYTES)
    assert [(d.identical, d.nnz, d.maxabs) for d in deltas["w"]] == [(e[3], e[2], e[1]) for e in expected]
    assert [d.identical for d in deltas["w"]] == [False, True, True]


def test_nan_delta_refused_with_nothing_written(catalog, tmp_path):
    w = torch.zeros(8, 8)
    bad = w.clone()
    bad[2, 3] = float("nan")
    register_model(catalog, "b", _write_model(tmp_path / "b", {"w": w}))
    register_model(catalog, "e", _write_model(tmp_path / "e", {"w": bad}))
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match="tensor 'w' has a NaN or infinite delta"):
        analyze(catalog, ["e"], base_id="b", progress=False)
    assert db_dump(catalog.path) == before


def test_interrupted_analysis_records_nothing(family_catalog, monkeypatch):
    calls = {"n": 0}
    real = analyze_job._Analyser.expert

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(analyze_job._Analyser, "expert", flaky)
    before = db_dump(family_catalog.path)
    with pytest.raises(KeyboardInterrupt):
        analyze(family_catalog, ["e1", "e2"], base_id="base", progress=False)
    assert db_dump(family_catalog.path) == before
    assert row_count(family_catalog.path, "block_deltas") == 0


def test_changed_model_refused(catalog, tiny_family, tmp_path):
    ckpt = shutil.copytree(tiny_family["e1"], tmp_path / "e1")
    register_model(catalog, "base", tiny_family["base"])
    register_model(catalog, "e1", ckpt)
    st = os.stat(ckpt / "model.safetensors")
    os.utime(ckpt / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ModelChangedError, match="model 'e1' changed on disk"):
        analyze(catalog, ["e1"], base_id="base", progress=False)
    assert row_count(catalog.path, "analyses") == 0


def test_sharded_family(catalog, sharded_family):
    for model_id in ("base", "e1", "e2"):
        register_model(catalog, model_id, sharded_family[model_id])
    report = analyze(catalog, None, base_id="base", progress=False)
    assert report.analyzed == ("e1", "e2")
    base_t = load_tensors(sharded_family["base"])
    e2_t = load_tensors(sharded_family["e2"])
    deltas = catalog.stats.block_deltas("e2", "base")
    for name, b in base_t.items():
        expected = reference_block_stats(b, e2_t[name], SMALL_BLOCK_BYTES)
        assert [d.identical for d in deltas[name]] == [e[3] for e in expected], name
        assert [d.nnz for d in deltas[name]] == [e[2] for e in expected], name
    # e2 only changes layer 1: layer 0 is identical throughout
    assert all(d.identical for n, ds in deltas.items() if ".layers.0." in n for d in ds)


def test_report_rate(analysed):
    _, report = analysed
    assert report.analyzed == ("e1", "e3") and report.bytes_per_second > 0


def test_unknown_model_refused_with_nothing_written(family_catalog):
    before = db_dump(family_catalog.path)
    with pytest.raises(UnknownModelError, match="unknown model 'ghost'"):
        analyze(family_catalog, ["e1", "ghost"], base_id="base", progress=False)
    with pytest.raises(UnknownModelError, match="unknown model 'ghost'"):
        analyze(family_catalog, ["e1"], base_id="ghost", progress=False)
    assert db_dump(family_catalog.path) == before
