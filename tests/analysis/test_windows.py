"""analyze a window of blocks at a time: the same rows as plain torch, bounded buffers, checked second reads."""

from __future__ import annotations

import shutil

import pytest
import torch

from mergepipe.analysis import stats as stats_module
from mergepipe.analysis import stats as topk, analyze as windows
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.analysis.analyze import block_windows
from mergepipe.catalog import Catalog
from mergepipe.errors import ModelChangedError
from mergepipe.spec.operators import DENSITY_GRID
from tests.catalog.conftest import SMALL_BLOCK_BYTES
from tests.catalog.helpers import db_dump, reference_block_stats, reference_thresholds
from tests.fixtures.checkpoints import load_tensors

#: Entries per window in these tests: under one tiny-family embedding block pair (8 rows of 64 = 512
#: entries per block), so every tensor larger than a block spans several windows.
WINDOW = 700


@pytest.mark.parametrize(("sizes", "limit", "expected"), [
    ([3, 3, 3], 6, [(0, 2), (2, 3)]),
    ([10, 2, 2], 6, [(0, 1), (1, 3)]),  # a block larger than a window is a window alone
    ([1] * 5, 100, [(0, 5)]),
    ([], 4, []),
])
def test_block_windows(sizes, limit, expected):
    assert block_windows(sizes, limit) == expected


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of WINDOW entries, pieces of 128 and the histogram path from 64 entries on."""
    monkeypatch.setattr(windows, "WINDOW_ELEMENTS", WINDOW)
    monkeypatch.setattr(topk, "PIECE", 128)
    monkeypatch.setattr(topk, "_COUNT_SPAN", 2 * 128)
    monkeypatch.setattr(topk, "SORT_BELOW", 64)


def _analysed(path, family, experts=("e1", "e3")) -> tuple[Catalog, object]:
    catalog = Catalog.create(path, block_bytes=SMALL_BLOCK_BYTES)
    for model_id in ("base", *experts):
        register_model(catalog, model_id, family[model_id])
    return catalog, analyze(catalog, list(experts), base_id="base", progress=False)


def test_small_windows_match_plain_torch_and_read_each_byte_once(tmp_path, tiny_family, small_windows):
    catalog, report = _analysed(tmp_path / "c.db", tiny_family)
    base_t = load_tensors(tiny_family["base"])
    size = sum(t.numel() * t.element_size() for t in base_t.values())
    assert report.bytes_by_model == {"base": size, "e1": size, "e3": size}
    assert report.reread_bytes > 0  # tensors longer than a window were looked at again
    for expert in ("e1", "e3"):
        exp_t = load_tensors(tiny_family[expert])
        deltas = catalog.stats.block_deltas(expert, "base")
        tensor_stats = catalog.stats.tensor_stats(expert, "base")
        for name, b in base_t.items():
            expected = reference_block_stats(b, exp_t[name], SMALL_BLOCK_BYTES)
            got = [(d.l2, d.maxabs, d.nnz, d.identical) for d in deltas[name]]
            assert [g[1:] for g in got] == [e[1:] for e in expected], (expert, name)
            assert [g[0] for g in got] == pytest.approx([e[0] for e in expected], rel=1e-5, abs=0.0)
            flat = (exp_t[name].float() - b.float()).abs().reshape(-1)
            for density in DENSITY_GRID:
                thr = tensor_stats[name].thresholds[density]
                assert (thr.k, thr.tau, thr.last_index) == reference_thresholds(flat, density), (name, density)
    catalog.close()


def test_small_windows_record_what_one_window_records(tmp_path, tiny_family, monkeypatch):
    """The catalog rows do not depend on how a tensor is cut into windows and pieces."""
    whole, _ = _analysed(tmp_path / "whole.db", tiny_family)
    with monkeypatch.context() as patch:
        patch.setattr(windows, "WINDOW_ELEMENTS", WINDOW)
        patch.setattr(topk, "PIECE", 128)
        patch.setattr(topk, "SORT_BELOW", 64)
        cut, _ = _analysed(tmp_path / "cut.db", tiny_family)
    for expert in ("e1", "e3"):
        assert cut.stats.block_deltas(expert, "base") == whole.stats.block_deltas(expert, "base")
        assert cut.stats.tensor_stats(expert, "base") == whole.stats.tensor_stats(expert, "base")
        assert cut.blocks.by_tensor(expert) == whole.blocks.by_tensor(expert)
    whole.close()
    cut.close()


def test_buffers_never_exceed_a_window(tmp_path, tiny_family, small_windows, monkeypatch):
    """No fp32 (or key) buffer holds more than a window, though the embedding is 16000 entries."""
    asked: list[int] = []
    real = stats_module.Workspace.buffer

    def recording(self, name, numel, dtype=torch.float32):
        asked.append(numel)
        return real(self, name, numel, dtype)

    monkeypatch.setattr(stats_module.Workspace, "buffer", recording)
    catalog, _ = _analysed(tmp_path / "c.db", tiny_family, experts=("e1",))
    assert asked and max(asked) <= WINDOW
    assert max(t.numel for t in catalog.models.tensors("base")) > 20 * WINDOW
    catalog.close()


def test_model_changed_between_reads_is_refused(tmp_path, tiny_family, small_windows, monkeypatch):
    """A second read checks its blocks against the first read's hashes: a file rewritten in between is
    refused by name, and nothing is recorded."""
    e1 = shutil.copytree(tiny_family["e1"], tmp_path / "e1")
    catalog = Catalog.create(tmp_path / "c.db", block_bytes=SMALL_BLOCK_BYTES)
    register_model(catalog, "base", tiny_family["base"])
    register_model(catalog, "e1", e1)
    real = windows._Analyser.reread

    def rewrite_first(self, model_id, name, a, b):
        if model_id == "e1":
            tensor, block = self.job.tensor(model_id, name), self.job.blocks[model_id][name][a]
            with open(e1 / tensor.file, "r+b") as handle:  # same size: only the bytes tell
                handle.seek(block.begin)
                old = handle.read(2)
                handle.seek(block.begin)
                handle.write(bytes(b ^ 0x55 for b in old))
        return real(self, model_id, name, a, b)

    monkeypatch.setattr(windows._Analyser, "reread", rewrite_first)
    before = db_dump(catalog.path)
    with pytest.raises(ModelChangedError, match=r"model 'e1' changed on disk while analyze ran: block \d+ of"):
        analyze(catalog, ["e1"], base_id="base", progress=False)
    assert db_dump(catalog.path) == before
    catalog.close()
