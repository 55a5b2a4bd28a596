"""Planning never analyses: an expert without statistics against the base is
refused with the command that makes them, before any expert byte is read
and without writing to the catalog."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.catalog import Catalog
from mergepipe.errors import CatalogError
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.planner.conftest import F32_BLOCK_BYTES
from tests.planner.support import build_catalog, clone_catalog, spy_reads

# --------------------------------------------------------------------------- file opens
#
# Audit hooks cannot be removed, so one hook is installed for the session and
# records only while a test asks it to. It sees every open() and os.open()
# made from Python, i.e. any header or data read outside the byte-counting
# source (which ``spy_reads`` watches).

_OPENED: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
    if _OPENED and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextmanager
def opened_files() -> Iterator[list[str]]:
    """Paths opened from Python while the block runs."""
    _OPENED.append([])
    try:
        yield _OPENED[-1]
    finally:
        _OPENED.pop()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def half_analysed(f32_family, tmp_path_factory) -> Path:
    """base, dense and sparse registered; only dense analysed against base."""
    path = tmp_path_factory.mktemp("halfanalysed") / "template.db"
    models = {m: f32_family[m] for m in ("base", "dense", "sparse")}
    return build_catalog(path, F32_BLOCK_BYTES, models, base="base", experts=["dense"])


@pytest.fixture
def catalog(half_analysed, tmp_path):
    with Catalog.open(clone_catalog(half_analysed, tmp_path / "catalog.db")) as cat:
        yield cat


def row_counts(catalog: Catalog) -> dict[str, int]:
    """Rows per table: any write the planner made would change one."""
    tables = [r[0] for r in catalog._db.query("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    return {t: catalog._db.query_one(f'SELECT COUNT(*) FROM "{t}"')[0] for t in tables}


# --------------------------------------------------------------------------- tests


def test_an_unanalysed_expert_is_refused_naming_the_commands(catalog, f32_family):
    before = row_counts(catalog)
    assert before["analyses"] == 1 and before["block_deltas"] > 0
    expert_dirs = [str(f32_family[e].resolve()) for e in ("dense", "sparse")]
    with spy_reads() as spy, opened_files() as opened:
        with pytest.raises(CatalogError) as info:
            Planner(catalog).plan(MergeRequest(base="base", experts=["dense", "sparse"], operator="task_arithmetic", budget="50%"))
    message = str(info.value)
    assert "\n" not in message
    assert "mergepipe analyze" in message and "--analyze-missing" in message
    assert "--base base sparse`" in message  # the command names the missing expert only
    assert spy.calls == []
    assert [p for p in opened if any(os.path.realpath(p).startswith(d + os.sep) for d in expert_dirs)] == []
    with opened_files() as control:  # the hook does see opens of expert files
        (f32_family["sparse"] / "config.json").read_bytes()
    assert [os.path.realpath(p) for p in control] == [str((f32_family["sparse"] / "config.json").resolve())]
    assert row_counts(catalog) == before
    assert not catalog.stats.is_analyzed("sparse", "base")
    assert catalog.stats.is_analyzed("dense", "base")


def test_every_missing_expert_is_named(catalog):
    with pytest.raises(CatalogError) as info:
        Planner(catalog).plan(MergeRequest(base="dense", experts=["sparse", "base"], operator="task_arithmetic"))
    assert "sparse, base have not been analysed against 'dense'" in str(info.value)
    assert not catalog.stats.is_analyzed("sparse", "dense") and not catalog.stats.is_analyzed("base", "dense")


def test_after_analyze_the_same_request_plans(catalog, f32_template, tmp_path):
    with pytest.raises(CatalogError):
        Planner(catalog).plan(MergeRequest(base="base", experts=["dense", "sparse"], operator="task_arithmetic", budget="50%"))
    analyze(catalog, ["sparse"], base_id="base", progress=False)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["dense", "sparse"], operator="task_arithmetic", budget="50%"))
    # the same plan as on a catalog where everything was analysed up front
    with Catalog.open(clone_catalog(f32_template, tmp_path / "full.db")) as full:
        reference = Planner(full).plan(MergeRequest(base="base", experts=["dense", "sparse"], operator="task_arithmetic", budget="50%"))
    assert plan.digest == reference.digest
    assert plan.cost.expert_bytes_by_model["sparse"] > 0
