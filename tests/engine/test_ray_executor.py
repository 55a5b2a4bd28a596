"""The Ray executor (mergepipe.engine.ray_executor): one plan executed by Ray tasks publishes the snapshot a
local run publishes, and a failure publishes nothing.

A local Ray instance (two CPUs, one per test module) runs the units. The
reference for every comparison is the same plan executed by the local
executor in its own copy of the catalog: snapshot id, manifest hash, every
file's bytes, every output block's recorded hash, and the bytes read per
model must be equal. Failures are injected by the tasks of
tests/fixtures/ray_tasks.py, which run in the workers and announce every
attempt in a directory the test watches; the test kills a worker by its
process id.
"""

from __future__ import annotations

import _thread
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.engine.ray_executor import INSTALL_HINT, RayExecutor, import_ray
from mergepipe.errors import ConfigError, EngineError, ModelChangedError
from mergepipe.planner.planner import Planner, plan_copies
from mergepipe.spec.copy_map import LayerSlice
from mergepipe.spec.operators import OPERATORS
from mergepipe.txn.recover import recover
from mergepipe.spec.request import MergeRequest
from tests.engine.test_stale_bytes import flip
from tests.fixtures.ray_tasks import (
    AlwaysRaises,
    PausesMidUnit,
    ReadsMoreThanPlanned,
    as_,
    attempts,
    ray_instance,
    wait_for_attempt,
    wrapping,
)
from tests.fixtures.remote import RangeServer
from tests.planner.support import build_catalog, clone_catalog, raw_layout, snapshot_files, subprocess_env
from tests.spec.operators.table import TABLE

ray = pytest.importorskip("ray")

BLOCK_BYTES = 2048
EXPERTS = ["e1", "e2", "e3"]
BUDGET = "70%"  # copied, merged and unread blocks alike
#: operator -> (experts, weights, global params): each method's row of the test table (a test checks it).
CASES = {name: row.merge for name, row in TABLE.items()}


@pytest.fixture(scope="module")
def ray_runtime():
    with ray_instance(ray):
        yield ray


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=EXPERTS)


def make_plan(template, tmp_path, operator="ties", budget=BUDGET):
    experts, weights, params = CASES[operator]
    with Catalog.open(clone_catalog(template, tmp_path / f"plan-{operator}.db")) as catalog:
        return Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator=operator, weights=weights, params=params, seed=5, budget=budget))


def execute(template, plan, root: Path, **engine_kwargs):
    """The plan executed in a private copy of the catalog: (snapshot id, manifest, files, output blocks)."""
    root.mkdir()
    with Catalog.open(clone_catalog(template, root / "c.db")) as catalog:
        snapshot_id, manifest = Engine(catalog, **engine_kwargs).execute(plan, out=root / "out", model_id="m")
        outputs = catalog.snapshots.outputs("m")
    return snapshot_id, manifest, snapshot_files(root / "out"), outputs


def assert_same_snapshot(far, local):
    assert far[0] == local[0]  # snapshot id: the plan and every file's hash
    assert far[1].manifest_hash == local[1].manifest_hash
    assert far[2] == local[2]  # every byte of every file
    assert far[3] == local[3]  # every output block's recorded hash and norm bound
    far_cost, local_cost = far[1].cost.realized, local[1].cost.realized
    assert far_cost.expert_bytes_by_model == local_cost.expert_bytes_by_model
    assert (far_cost.base_bytes, far_cost.output_bytes) == (local_cost.base_bytes, local_cost.output_bytes)


def assert_nothing_published(catalog: Catalog, out: Path) -> None:
    """No output, no staging directory, the intent aborted, no model, and nothing left for recover."""
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if "staging" in p.name] == []
    assert [s.status for s in catalog.snapshots.list()] == ["aborted"]
    assert not catalog.models.exists("m")
    assert not recover(catalog, also_scan=[out.parent]).changed


def test_the_cases_cover_the_operator_registry():
    assert sorted(CASES) == sorted(OPERATORS)


@pytest.mark.parametrize("operator", sorted(CASES))
def test_ray_publishes_the_local_snapshot_for_every_operator(operator, template, ray_runtime, tmp_path):
    plan = make_plan(template, tmp_path, operator)
    local = execute(template, plan, tmp_path / "local")
    executor = RayExecutor(ray_runtime, 2)
    far = execute(template, plan, tmp_path / "ray", executor=executor)
    assert_same_snapshot(far, local)
    assert executor.progress.units_done == executor.progress.total_units >= 4  # balanced for two workers


def test_a_passthrough_runs_its_copy_units_on_the_workers(template, ray_runtime, tmp_path):
    """A passthrough is a plan of copy items: its units run on Ray like a merge's, to the local snapshot."""
    slices = (LayerSlice("base", 0, 2), LayerSlice("e1", 1, 2))
    request = MergeRequest(base="base", experts=["e1"], operator="passthrough", slices=slices)
    with Catalog.open(clone_catalog(template, tmp_path / "plan.db")) as catalog:
        plan = plan_copies(catalog, request)
    local = execute(template, plan, tmp_path / "local")
    executor = RayExecutor(ray_runtime, 2)
    far = execute(template, plan, tmp_path / "ray", executor=executor)
    assert_same_snapshot(far, local)
    assert executor.progress.units_done == executor.progress.total_units >= 2  # the workers made it


@pytest.mark.parametrize("budget", ["15%", "50%", "100%"])
def test_the_budget_holds_with_reads_summed_across_workers(budget, template, ray_runtime, tmp_path):
    plan = make_plan(template, tmp_path, "ties", budget)
    local = execute(template, plan, tmp_path / "local")
    executor = RayExecutor(ray_runtime, 2)
    far = execute(template, plan, tmp_path / "ray", executor=executor)
    realized = far[1].cost.realized
    workers = executor.progress.workers
    assert len(workers) >= 2  # the reads really were spread over processes
    assert realized.expert_bytes <= plan.budget_bytes
    for expert in EXPERTS:
        assert realized.expert_bytes_by_model[expert] <= plan.expert_bytes_to_read(expert)
    # what the workers' records say they read, summed, is what the manifest reports
    assert sum(w.bytes_read for w in workers.values()) == realized.base_bytes + realized.expert_bytes
    written = sum(t.nbytes for t in raw_layout(tmp_path / "ray" / "out").values())  # the output's tensor data
    assert sum(w.bytes_written for w in workers.values()) == written
    assert_same_snapshot(far, local)


def test_a_record_claiming_more_than_the_plan_publishes_nothing(template, ray_runtime, tmp_path):
    """The coordinator checks Ray records as it checks local ones: a read beyond the plan aborts."""
    plan = make_plan(template, tmp_path, "ties", "50%")
    executor = wrapping(as_(ReadsMoreThanPlanned, expert="e2"), ray_runtime, 2)
    out = tmp_path / "out"
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as catalog:
        with pytest.raises(EngineError, match="more than the planned"):
            Engine(catalog, executor=executor).execute(plan, out=out, model_id="m")
        assert_nothing_published(catalog, out)


def test_a_worker_killed_mid_unit_is_retried_and_the_output_is_the_same(template, ray_runtime, tmp_path):
    plan = make_plan(template, tmp_path, "dare_ties")
    local = execute(template, plan, tmp_path / "local")
    marks = tmp_path / "marks"
    marks.mkdir()
    killed: list[int] = []

    def kill_the_first_attempt() -> None:
        pid = wait_for_attempt(marks, 0)  # its first block is merged and queued for writing: mid-unit
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_the_first_attempt, daemon=True)
    killer.start()
    executor = wrapping(as_(PausesMidUnit, directory=str(marks), unit=0), ray_runtime, 2)
    far = execute(template, plan, tmp_path / "ray", executor=executor)
    killer.join(timeout=10)
    tries = attempts(marks, 0)
    assert killed and tries[0] == killed[0]
    assert len(tries) == 2 and tries[1] != killed[0]  # Ray ran the unit once more, in another process
    assert_same_snapshot(far, local)


def test_a_unit_that_always_raises_publishes_nothing(template, ray_runtime, tmp_path, monkeypatch):
    plan = make_plan(template, tmp_path, "ties")
    marks = tmp_path / "marks"
    marks.mkdir()
    executor = wrapping(as_(AlwaysRaises, directory=str(marks), unit=1), ray_runtime, 2)
    out = tmp_path / "out"
    cancelled = []  # the other tasks end on the stop file: none is force-cancelled (a race that aborts Ray)
    monkeypatch.setattr(ray_runtime, "cancel", lambda ref, **kw: cancelled.append(ref))
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as catalog:
        with pytest.raises(EngineError) as info:
            Engine(catalog, executor=executor).execute(plan, out=out, model_id="m")
        assert cancelled == []
        message = str(info.value)
        assert "\n" not in message
        for needle in ("work unit 1", "RuntimeError: unit 1 always fails", "nothing was published"):
            assert needle in message, message
        assert len(attempts(marks, 1)) == 1  # an error of the unit is not retried: it would fail again
        assert_nothing_published(catalog, out)
        # the catalog is consistent: the same plan runs at once, and gives the local snapshot
        snapshot_id, _ = Engine(catalog, executor=RayExecutor(ray_runtime, 2)).execute(plan, out=out, model_id="m")
    assert snapshot_id == execute(template, plan, tmp_path / "local")[0]


def test_a_changed_expert_fails_on_a_worker_with_the_local_error(tiny_family, ray_runtime, tmp_path):
    """A unit's own MergePipeError reaches the user as it would locally: one line, nothing published."""
    family = {name: Path(shutil.copytree(tiny_family[name], tmp_path / name)) for name in ("base", "e1", "e2")}
    with Catalog.create(tmp_path / "template.db", BLOCK_BYTES) as catalog:
        for name, path in family.items():
            register_model(catalog, name, path)
        analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}))
    tensor = "model.layers.1.mlp.down_proj.weight"
    flip(family["e1"], tensor, plan.reads[tensor]["e1"][0])
    messages = []
    for name, executor in (("local", None), ("ray", RayExecutor(ray_runtime, 2))):
        out = tmp_path / name / "out"
        out.parent.mkdir()
        with Catalog.open(clone_catalog(tmp_path / "template.db", out.parent / "c.db")) as catalog:
            with pytest.raises(ModelChangedError) as info:
                Engine(catalog, executor=executor).execute(plan, out=out, model_id="m")
            assert_nothing_published(catalog, out)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "'e1'" in messages[1] and "\n" not in messages[1]


def test_experts_over_http_merge_on_ray_as_locally(tiny_family, ray_runtime, tmp_path):
    """Workers fetch the planned ranges themselves (the server is on this machine's loopback): the snapshot
    is the local executor's, and the server saw the same bytes fetched."""
    with RangeServer(Path(tiny_family["base"]).parent) as server:
        with Catalog.create(tmp_path / "template.db", BLOCK_BYTES) as catalog:
            for name in ("base", "e1", "e2"):
                register_model(catalog, name, f"{server.url}/{name}")
            analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="50%"))
        server.log.clear()
        local = execute(tmp_path / "template.db", plan, tmp_path / "local")
        fetched_locally = covered(server.log.gets(".safetensors"))
        server.log.clear()
        far = execute(tmp_path / "template.db", plan, tmp_path / "ray", executor=RayExecutor(ray_runtime, 2))
        assert covered(server.log.gets(".safetensors")) == fetched_locally
    assert_same_snapshot(far, local)
    assert set(far[1].cost.realized.requests_by_model) == {"base", "e1", "e2"}  # counted by the workers


def covered(requests) -> dict[str, list[tuple[int, int]]]:
    """Per path, the byte ranges the ranged GETs fetched, merged where they touch or overlap."""
    out: dict[str, list[tuple[int, int]]] = {}
    for request in sorted((r for r in requests if r.range), key=lambda r: (r.path, r.range)):
        spans = out.setdefault(request.path, [])
        begin, end = request.range
        if spans and begin <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((begin, end))
    return out


@pytest.fixture
def sigint_handled():
    """SIGINT raising KeyboardInterrupt, as in a terminal, for the test's length. A shell that starts a job
    in the background without job control (`make test &` in a script) starts it with SIGINT ignored,
    Python then leaves it so, and ``_thread.interrupt_main`` does nothing: the Ctrl-C test waited out its
    paused unit's 120 s and failed in such fresh-clone runs."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_cancels_the_tasks_and_rolls_back(template, ray_runtime, tmp_path, sigint_handled):
    plan = make_plan(template, tmp_path, "ties")
    marks = tmp_path / "marks"
    marks.mkdir()

    cancelling, ended = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def interrupt_once_a_unit_is_paused() -> None:
        try:
            wait_for_attempt(marks, 0)
        except TimeoutError as exc:
            failed.append(exc)
            return
        # What Ctrl-C does: KeyboardInterrupt in the main thread. Sent again until the executor cancels:
        # Python drops one that lands in a finalizer ("Exception ignored in ..."), as a user presses again.
        while not (cancelling.is_set() or ended.is_set()):
            _thread.interrupt_main()
            cancelling.wait(2.0)

    threading.Thread(target=interrupt_once_a_unit_is_paused, daemon=True).start()
    executor = wrapping(as_(PausesMidUnit, directory=str(marks), unit=0), ray_runtime, 2, cancelling=cancelling)
    out = tmp_path / "out"
    try:
        with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as catalog:
            with pytest.raises(KeyboardInterrupt):
                Engine(catalog, executor=executor).execute(plan, out=out, model_id="m")
            assert_nothing_published(catalog, out)
    finally:
        ended.set()  # no interrupt may reach a later test
    assert not failed, failed
    # the paused task was cancelled: its worker process is gone (it would sleep for minutes otherwise)
    assert gone(attempts(marks, 0)[0])


def gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` ends (or is a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


# ------------------------------------------------------------------ Ray optional, connection errors


def test_the_core_never_imports_ray():
    probe = ("import sys, mergepipe.engine.engine, mergepipe.engine.ray_executor, mergepipe.cli.merge_cmds; "
             "print('RAY-LOADED', 'ray' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "RAY-LOADED False" in proc.stdout


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    with pytest.raises(ConfigError) as info:
        import_ray()
    assert INSTALL_HINT in str(info.value) and "\n" not in str(info.value)


# Connecting and starting (bounded, one line, quiet, Ctrl-C honoured): test_ray_startup.py, with real Ray.
