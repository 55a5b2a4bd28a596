"""What the engine leaves for the time model: each merge's row of timings (engine/record.py) and the kernel
probes (engine/probe.py)."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from mergepipe.catalog import Catalog
from mergepipe.catalog.snapshots import host_key
from mergepipe.engine import probe as probe_module
from mergepipe.engine.engine import Engine
from mergepipe.engine.probe import probe_kernels
from mergepipe.planner.planner import Planner
from mergepipe.spec.operators import OPERATORS
from mergepipe.catalog.records import Timing
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog, clone_catalog, subprocess_env


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("timings") / "t.db", 2048, tiny_family, base="base",
                         experts=["e1", "e2"])


@pytest.fixture
def catalog(template, tmp_path):
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as cat:
        yield cat


def test_a_merge_records_the_bytes_it_moved_and_the_engine_s_seconds(catalog, tmp_path):
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="60%"))
    started = time.perf_counter()
    _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    wall = time.perf_counter() - started
    written = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    (row,) = catalog.timings.merges(host_key(), "cpu", "ties", 10)
    assert row == Timing(plan.cost.expert_bytes, written, manifest.cost.realized.seconds["total"])
    assert 0 < row.seconds <= wall
    assert catalog.timings.merges(host_key(), "cpu", "task_arithmetic", 10) == []
    Engine(catalog).execute(plan, out=tmp_path / "again")  # a re-run moves the same bytes: a row of its own
    assert [r.expert_bytes for r in catalog.timings.merges(host_key(), "cpu", "ties", 10)] == [row.expert_bytes] * 2


def test_the_probe_times_every_operator_once_per_device(catalog, monkeypatch):
    measured = probe_kernels(catalog, "cpu", OPERATORS)
    assert set(measured) == set(OPERATORS) and all(0 < s < 1e-3 and math.isfinite(s) for s in measured.values())
    assert measured["della"] > measured["linear"]  # a sort and a random mask per element, against one multiply-add
    assert catalog.timings.kernel_seconds(host_key(), "cpu") == measured

    def never(operators, device):
        raise AssertionError(f"probed {operators} again")

    monkeypatch.setattr(probe_module, "kernel_seconds", never)
    assert probe_kernels(catalog, "cpu", ["ties", "slerp"]) == {}  # probed once per machine and device


def test_the_probe_times_only_what_is_missing(catalog, monkeypatch):
    catalog.timings.add_kernels(host_key(), "cpu", {"ties": 1e-9})
    asked = []
    monkeypatch.setattr(probe_module, "kernel_seconds",
                        lambda operators, device: asked.append(list(operators)) or dict.fromkeys(operators, 5e-9))
    assert probe_kernels(catalog, "cpu", ["ties", "slerp", "slerp"]) == {"slerp": 5e-9}
    assert asked == [["slerp"]]
    assert catalog.timings.kernel_seconds(host_key(), "cpu") == {"ties": 1e-9, "slerp": 5e-9}


def test_the_start_up_a_manifest_shows_is_the_process_s_age(tmp_path):
    """``process_seconds`` in a fresh interpreter that waited half a second: at least that, and no more than the
    parent saw the child live (``/proc``'s clocks tick in 10 ms: 50 ms of slack)."""
    child = ("import time; time.sleep(0.5); from mergepipe.engine.stream import process_seconds; "
             "print(process_seconds())")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True,
                         env=subprocess_env()).stdout
    lived = time.monotonic() - started
    assert 0.5 - 0.05 <= float(out) <= lived + 0.05
