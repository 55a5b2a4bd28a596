"""The benchmark suite: MergePipe vs a naive full-read merge vs mergekit, side by side.

Usage: ``python -m benchmarks.suite [--quick] [--systems naive,mergekit,mergepipe]``
(``make bench`` / ``make bench-quick``).

For each (operator, K) group, on the same generated checkpoints, each system
runs in its own child process with a cold page cache for every input file
(``os.sync()``, ``POSIX_FADV_DONTNEED``) and its previous output removed:

1. ``naive``: ``benchmarks.naive_merge``, the full-read reference output;
2. ``mergekit``: mergekit 0.1.5 (``mergekit-yaml``) on the same merge;
3. ``mergepipe``: ``mergepipe merge`` at each budget and policy; its 100%
   run (first policy) is kept as MergePipe's own full-read reference.

Per run: wall seconds of the child, seconds of the ``os.sync()`` after it
(dirty output still in the page cache; MergePipe fsyncs inside its wall,
the others do not), peak RSS, physical bytes read and written
(``/proc/<pid>/io``), and physical bytes read per input attributed by page
cache residency (``mincore`` after the run: the cache was empty, so whatever
is resident was read by the run, readahead included). Errors: relative
Frobenius error of the output vs the naive reference and vs MergePipe's own
100% output, also relative to the merged task vector (``||a-ref||/||ref-base||``).

MergePipe's one-time ``analyze`` of all experts is measured separately and
amortised over ``amortise_over_merges`` merges (experts arriving over time).
A "fixed absolute budget" series (a fraction of the K=2 full expert read,
held fixed as K grows) shows whether expert I/O stays flat in K.

``--methods`` runs the every-method groups instead (issue 42: nuslerp,
multislerp, karcher, sce, nearswap, arcee_fusion, ram, ramplus_tl,
passthrough) on the same layout: mergekit and MergePipe run one mergekit YAML
per method (``mergekit_runner.METHODS``, fp32 compute on both sides), and the
errors are against mergekit's output, there being no naive reference for them.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from benchmarks import mergekit_runner, mergepipe_runner, report
from benchmarks.checkpoints import Reference, compare, remove_tree, weight_bytes, weight_files
from benchmarks.coldcache import RunResult, drop_cache, resident_bytes, run_measured
from benchmarks.workloads import DEFAULT_ROOT, EXPERTS, Workload, ensure_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SYSTEMS = ("naive", "mergekit", "mergepipe")
BUDGETS = ("100%", "50%", "25%", "10%")
POLICIES = ("energy", "uniform")
BASE_ID = "base"


FULL_MATRIX = tuple((b, p) for b in BUDGETS for p in POLICIES)
# Enough for the K plot and the energy-vs-uniform check; 100% uniform reads what 100% energy reads.
REDUCED = (("100%", "energy"), ("10%", "energy"), ("10%", "uniform"))
# The every-method groups: full, and 10% where a partial budget means something.
METHOD_RUNS = (("100%", "energy"), ("10%", "energy"))


@dataclass(frozen=True)
class Group:
    """One merge (operator, K experts) compared across systems."""

    operator: str
    k: int
    systems: tuple[str, ...] = SYSTEMS
    # MergePipe (budget, policy) runs; the first must be a 100% budget: it is
    # kept as MergePipe's own full-read reference for the others.
    mergepipe: tuple[tuple[str, str], ...] = FULL_MATRIX
    # Both systems run the mergekit YAML of ``mergekit_runner.METHODS[operator]`` (MergePipe with
    # ``--config``); mergekit's output is then the reference of the errors.
    from_config: bool = False

    def __post_init__(self) -> None:
        if self.mergepipe and self.mergepipe[0][0] != "100%":
            raise ValueError(f"{self}: the first MergePipe run must be at 100% budget")


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    layout: str
    groups: tuple[Group, ...]
    run_timeout_seconds: float  # per child process; a hung run becomes a failed row
    fixed_budget_operator: str = "task_arithmetic"
    fixed_budget_ks: tuple[int, ...] = (2, 4, 8)
    fixed_budget_fraction: float = 0.10  # of the K=2 full expert read
    fixed_budget_policy: str = "energy"
    density: float = 0.5
    lam: float = 1.0
    amortise_over_merges: int = 10


def method_groups() -> tuple[Group, ...]:
    """One group per method of ``mergekit_runner.METHODS``, at the number of experts it merges there."""
    return tuple(
        Group(name, m.experts, systems=("mergekit", "mergepipe"),
              mergepipe=METHOD_RUNS if m.budgetable else METHOD_RUNS[:1], from_config=True)
        for name, m in mergekit_runner.METHODS.items()
    )


SUITES = {
    # Sized for <= 30 min on 2 idle cores and ~14 GB of disk (10.7 GB of inputs,
    # at most 3 outputs of 1.2 GB at a time). The full budget x policy matrix
    # runs at K=8, where the targets are set; K=4 and K=2 run the reduced set.
    # mergekit's TIES (an argsort of every tensor) is the most expensive run,
    # so at K=2 TIES compares MergePipe with the naive merge only.
    "standard": SuiteSpec(
        "standard",
        "qwen3-0.6b",
        groups=(
            Group("task_arithmetic", 8), Group("ties", 8),
            Group("task_arithmetic", 4, mergepipe=REDUCED), Group("ties", 4, mergepipe=REDUCED),
            Group("task_arithmetic", 2, mergepipe=REDUCED),
            Group("ties", 2, systems=("naive", "mergepipe"), mergepipe=REDUCED),
        ),
        run_timeout_seconds=1200.0,
    ),
    # <= 3 min on 2 idle cores: K=4 for both operators with a budget sweep,
    # task arithmetic at K=2 and K=8 for the K plot and the fixed-budget series.
    "quick": SuiteSpec(
        "quick",
        "qwen3-tiny",
        groups=(
            Group("task_arithmetic", 4, mergepipe=(*REDUCED, ("25%", "energy"))),
            Group("ties", 4, mergepipe=REDUCED),
            Group("task_arithmetic", 2, mergepipe=REDUCED[:2]),
            Group("task_arithmetic", 8, mergepipe=REDUCED[:2]),
        ),
        run_timeout_seconds=240.0,
    ),
    # --methods: the standard layout (~30 min on 2 idle cores) and the quick one (~2 min), no fixed-budget series.
    "methods": SuiteSpec("methods", "qwen3-0.6b", groups=method_groups(), run_timeout_seconds=1200.0,
                         fixed_budget_ks=()),
    "methods-quick": SuiteSpec("methods-quick", "qwen3-tiny", groups=method_groups(), run_timeout_seconds=240.0,
                               fixed_budget_ks=()),
}


@dataclass
class Row:
    series: str  # "matrix" or "fixed-budget"
    system: str
    operator: str
    k: int
    budget: str = ""
    policy: str = ""
    device: str = "cpu"  # MergePipe's --device
    reference: str = "naive"  # the output rel_error, delta_rel_error and identical_to_naive compare against
    status: str = "ok"
    wall_seconds: float | None = None
    cpu_seconds: float | None = None  # user + sys of the process tree
    flush_seconds: float | None = None
    load1: float | None = None  # 1-minute load average before the run: noise indicator
    peak_rss_bytes: int | None = None
    peak_anon_rss_bytes: int | None = None
    read_bytes: int | None = None  # physical, whole process tree
    write_bytes: int | None = None
    base_read_bytes: int | None = None  # physical, by page-cache residency
    expert_read_bytes: int | None = None  # physical, by page-cache residency
    expert_read_fraction_of_naive: float | None = None
    mp_realized_expert_bytes: int | None = None  # MergePipe's own counters
    mp_planned_expert_bytes: int | None = None
    mp_budget_bytes: int | None = None
    mp_budget_respected: bool | None = None
    mp_error_bound: float | None = None
    mp_seconds: dict = field(default_factory=dict)  # by phase; "startup": process start to the first read
    mp_predicted_seconds: dict = field(default_factory=dict)  # the plan's prediction (planner/planner.py)
    mp_snapshot_id: str | None = None
    mp_plan_id: str | None = None
    rel_error: float | None = None  # vs naive reference
    delta_rel_error: float | None = None
    identical_to_naive: bool | None = None
    rel_error_vs_mp_full: float | None = None
    delta_rel_error_vs_mp_full: float | None = None
    abs_error_vs_mp_full: float | None = None  # ||out - MergePipe 100%||, vs the plan's bound
    mp_error_bound_respected: bool | None = None
    speedup_vs_naive: float | None = None
    speedup_vs_mergekit: float | None = None
    amortised_analysis_seconds: float | None = None
    stderr_tail: str = ""


def _failure(result: RunResult) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return f"failed (exit {result.returncode}): {lines[-1] if lines else 'no stderr'}"


def copy_catalog(source: Path, target: Path) -> Path:
    """``source`` copied to ``target`` with SQLite's backup, both connections closed after. A connection
    left open here loses its locks when ``drop_cache`` closes its own descriptor of the file (POSIX locks
    belong to the process: SQLite's "how to corrupt" page, section 2.2); with one left open after the
    backup, ``benchmarks.predict`` then failed to open the catalog after the first merge ("database disk
    image is malformed")."""
    with closing(sqlite3.connect(source)) as a, closing(sqlite3.connect(target)) as b:
        a.backup(b)
    return target


class SuiteRun:
    """Runs the groups of one suite on one workload and collects rows."""

    def __init__(self, spec: SuiteSpec, workload: Workload, scratch: Path,
                 systems: tuple[str, ...], log: Callable[[str], None], devices: tuple[str, ...] = ("cpu",)):
        self.spec, self.wl, self.scratch, self.systems, self.log = spec, workload, scratch, systems, log
        self.devices = devices  # every MergePipe run once per device, the reference on the first
        self.rows: list[Row] = []
        self.db = scratch / "catalog.db"
        self.analysis: dict = {}
        self.mergepipe_ready: str | None = None  # None = ready, else the reason it is not
        self._mp_full_is_naive = False  # this group's MergePipe 100% output == naive output

    # -- measurement -------------------------------------------------------
    def _cold_inputs(self) -> list[Path]:
        catalog = [p for p in self.scratch.glob("catalog*.db*")]
        return [self.wl.base, *self.wl.experts, *catalog]

    def measure(self, row: Row, cmd: list[str], out: Path | None, env=None) -> RunResult:
        if out is not None:
            remove_tree(out)
        os.sync()
        drop_cache(self._cold_inputs())
        row.load1 = round(os.getloadavg()[0], 2)
        result = run_measured(cmd, env=env, timeout_seconds=self.spec.run_timeout_seconds)
        flush_started = time.perf_counter()
        os.sync()
        row.flush_seconds = time.perf_counter() - flush_started
        row.wall_seconds = result.wall_seconds
        row.cpu_seconds = result.user_seconds + result.sys_seconds
        row.peak_rss_bytes = result.peak_rss_bytes
        row.peak_anon_rss_bytes = result.peak_anon_rss_bytes
        row.read_bytes, row.write_bytes = result.read_bytes, result.write_bytes
        row.base_read_bytes = resident_bytes(weight_files(self.wl.base))
        row.expert_read_bytes = sum(resident_bytes(weight_files(e)) for e in self.wl.experts)
        if not result.ok:
            row.status = _failure(result)
            row.stderr_tail = result.stderr[-2000:]
        return result

    # -- MergePipe set-up ---------------------------------------------------
    def setup_mergepipe(self) -> None:
        mergepipe_runner.compile_package()  # every MergePipe process after this finds its bytecode
        availability = mergepipe_runner.probe()
        if not availability.ok:  # no merge to amortise it over: skip the analysis too
            self.mergepipe_ready = availability.reason
            self.analysis = {"status": f"skipped: {availability.reason}"}
            return
        ids = [BASE_ID, *(p.name for p in EXPERTS[: len(self.wl.experts)])]
        dirs = [self.wl.base, *self.wl.experts]
        started = time.perf_counter()
        steps = [mergepipe_runner.init_db(self.db)]
        steps += [mergepipe_runner.register(self.db, i, d) for i, d in zip(ids, dirs)]
        for cmd in steps:
            result = run_measured(cmd)
            if not result.ok:
                self.mergepipe_ready = f"set-up {_failure(result)}"
                self.analysis = {"status": self.mergepipe_ready}
                return
        register_seconds = time.perf_counter() - started
        row = Row("analysis", "mergepipe-analyze", "-", len(ids) - 1)
        self.measure(row, mergepipe_runner.analyze(self.db, BASE_ID, ids[1:]), None)
        if row.status != "ok":
            self.mergepipe_ready = f"analyze {row.status}"
            self.analysis = {"status": self.mergepipe_ready, "wall_seconds_until_failure":
                             row.wall_seconds, "stderr_tail": row.stderr_tail}
            return
        expert_bytes = weight_bytes(self.wl.experts)
        per_expert = row.wall_seconds / (len(ids) - 1)
        self.analysis = {
            "status": row.status,
            "experts": len(ids) - 1,
            "register_seconds": register_seconds,
            "wall_seconds": row.wall_seconds,
            "cpu_seconds": row.cpu_seconds,
            "per_expert_seconds": per_expert,
            "read_bytes": row.read_bytes,
            "expert_bytes": expert_bytes,
            "expert_mb_per_second": expert_bytes / 1e6 / row.wall_seconds,
            "peak_rss_bytes": row.peak_rss_bytes,
            "amortise_over_merges": self.spec.amortise_over_merges,
            "amortised_seconds_per_expert_per_merge": per_expert / self.spec.amortise_over_merges,
        }
        for device in self.devices[1:]:
            # A plan runs once per catalog (a second run of it would publish its snapshot again), and the
            # same merge on another device plans the same: each further device merges in a copy.
            copy_catalog(self.db, self.db_for(device))
        self.log(f"analyze: {len(ids) - 1} experts in {row.wall_seconds:.1f} s "
                 f"({self.analysis['expert_mb_per_second']:.0f} MB/s of expert files)")

    def db_for(self, device: str) -> Path:
        """The catalog the runs on ``device`` merge in: the first device's is the one analysed."""
        if device == self.devices[0]:
            return self.db
        return self.scratch / f"catalog-{device}.db"

    # -- one group ------------------------------------------------------------
    def run_group(self, group: Group, fixed_budget_bytes: int | None) -> None:
        op, k, spec = group.operator, group.k, self.spec
        experts = self.wl.expert_dirs(k)
        expert_ids = [p.name for p in EXPERTS[:k]]
        tag = f"{op}-k{k}"
        naive_ref = self.scratch / f"ref-naive-{tag}"
        mp_ref = self.scratch / f"ref-mergepipe-{tag}"
        out = self.scratch / "out"
        # "naive" (the reference system's output: naive's, or mergekit's for a from_config group) and
        # "mergepipe" (its 100% output)
        refs: dict[str, Reference] = {}
        reference = "mergekit" if group.from_config else "naive"
        self._mp_full_is_naive = False
        cfg_path = self.mergekit_config(group, experts)

        def finish(row: Row, output: Path) -> None:
            row.reference = reference
            if row.status.startswith("ok"):
                self._errors(row, output, refs)
            self.rows.append(row)
            self.log(report.one_line(row))

        if "naive" in group.systems and "naive" in self.systems:
            row = Row("matrix", "naive", op, k)
            cmd = [sys.executable, "-m", "benchmarks.naive_merge", "--base", str(self.wl.base),
                   "--experts", *map(str, experts), "--out", str(naive_ref), "--operator", op,
                   "--density", str(spec.density), "--lambda", str(spec.lam)]
            self.measure(row, cmd, naive_ref)
            if row.status == "ok":
                refs["naive"] = Reference.of(naive_ref, self.wl.base)
            finish(row, naive_ref)

        if "mergekit" in group.systems and "mergekit" in self.systems:
            row = Row("matrix", "mergekit", op, k)
            self.measure(row, mergekit_runner.command(cfg_path, out), out,
                         env=mergekit_runner.environment())
            finish(row, out)
            if reference == "mergekit" and row.status == "ok":
                refs["naive"] = Reference.of(out, self.wl.base)

        if "mergepipe" in group.systems and "mergepipe" in self.systems:
            variants = [("matrix", b, p) for b, p in group.mergepipe]
            if fixed_budget_bytes is not None:
                variants.append(("fixed-budget", str(fixed_budget_bytes), spec.fixed_budget_policy))
            for series, budget, policy, device in [(*v, d) for v in variants for d in self.devices]:
                row = Row(series, "mergepipe", op, k, budget, policy, device)
                if self.mergepipe_ready is not None:
                    row.status = f"unavailable: {self.mergepipe_ready}"
                    self.rows.append(row)
                    continue
                is_ref = series == "matrix" and budget == "100%" and "mergepipe" not in refs
                model_id = f"bench-{tag}-{budget.rstrip('%')}-{policy}-{series}-{device}"
                # a path of its own: MergePipe refuses to write where a registered snapshot lives (or lived)
                target = mp_ref if is_ref else self.scratch / f"out-{model_id}"
                summary_path = self.scratch / "summary.json"
                summary_path.unlink(missing_ok=True)
                cmd = (mergepipe_runner.merge_config(self.db_for(device), cfg_path, target, model_id, budget,
                                                     policy, summary_path, device=device) if group.from_config
                       else mergepipe_runner.merge(self.db_for(device), BASE_ID, expert_ids, target, model_id,
                                                   op, budget, policy, summary_path, spec.density, spec.lam,
                                                   device=device))
                self.measure(row, cmd, target)
                if row.status == "ok":
                    self._summary(row, summary_path)
                finish(row, target)
                if is_ref and row.status.startswith("ok"):
                    refs["mergepipe"] = Reference.of(mp_ref, self.wl.base)
                    self._mp_full_is_naive = bool(row.identical_to_naive)
                if not is_ref:
                    remove_tree(target)
        remove_tree(out)
        remove_tree(naive_ref)
        remove_tree(mp_ref)

    def mergekit_config(self, group: Group, experts: list[Path]) -> Path:
        """The mergekit YAML of ``group``, written in the scratch folder; a from_config group's MergePipe
        runs it too."""
        cfg = mergekit_runner.config(self.wl.base, experts, group.operator, self.spec.density, self.spec.lam)
        return mergekit_runner.write_config(self.scratch / f"mergekit-{group.operator}-k{group.k}.yml", cfg)

    def _summary(self, row: Row, path: Path) -> None:
        if not path.exists():
            row.status = "ok, but no --json-summary written"
            return
        s = mergepipe_runner.MergeSummary.from_json(path)
        row.mp_realized_expert_bytes = s.realized_expert_bytes
        row.mp_planned_expert_bytes = s.planned_expert_bytes
        row.mp_budget_bytes = s.budget_bytes
        row.mp_budget_respected = s.budget_respected()
        row.mp_error_bound = s.error_bound
        row.mp_seconds = s.seconds
        row.mp_predicted_seconds = s.predicted_seconds
        row.mp_snapshot_id = s.snapshot_id
        row.mp_plan_id = json.loads(path.read_text()).get("plan_id")
        if s.missing:
            row.status = f"ok, summary lacks {', '.join(s.missing)}"

    def _errors(self, row: Row, output: Path, refs: dict[str, Reference]) -> None:
        """Errors vs the naive output and vs MergePipe's own 100% output.

        When MergePipe's 100% output is bit-identical to the naive one, the two
        errors are the same and each run is compared once (it halves the time).
        """
        if row.system == row.reference:
            row.rel_error, row.delta_rel_error, row.identical_to_naive = 0.0, 0.0, True
            return
        targets = [n for n in ("naive", "mergepipe") if n in refs]
        if row.system != "mergepipe":
            targets = [n for n in targets if n == "naive"]
        elif "mergepipe" in refs and self._mp_full_is_naive:
            targets = ["mergepipe"]
        comps = dict(zip(targets, compare(output, [refs[n] for n in targets])))
        if "mergepipe" in comps:
            c = comps["mergepipe"]
            row.rel_error_vs_mp_full, row.delta_rel_error_vs_mp_full = c.rel_error, c.delta_rel_error
            row.abs_error_vs_mp_full = c.sq_diff ** 0.5
            if row.mp_error_bound is not None:
                row.mp_error_bound_respected = row.abs_error_vs_mp_full <= row.mp_error_bound
            if self._mp_full_is_naive:
                comps.setdefault("naive", c)
        if "naive" in comps:
            c = comps["naive"]
            row.rel_error, row.delta_rel_error = c.rel_error, c.delta_rel_error
            row.identical_to_naive = c.identical
        if row.system == "mergepipe" and "mergepipe" not in refs and row.budget == "100%":
            row.rel_error_vs_mp_full, row.delta_rel_error_vs_mp_full = 0.0, 0.0
            row.abs_error_vs_mp_full = 0.0
            if row.mp_error_bound is not None:
                row.mp_error_bound_respected = row.mp_error_bound >= 0.0

    # -- derived columns --------------------------------------------------------
    def derive(self) -> None:
        def find(system: str, op: str, k: int) -> Row | None:
            return next((r for r in self.rows if r.system == system and r.operator == op
                         and r.k == k and r.status.startswith("ok")), None)

        per_expert = self.analysis.get("amortised_seconds_per_expert_per_merge")
        for row in self.rows:
            if not row.status.startswith("ok"):
                continue
            naive, mk = find("naive", row.operator, row.k), find("mergekit", row.operator, row.k)
            if naive is not None:
                row.speedup_vs_naive = naive.wall_seconds / row.wall_seconds
                if naive.expert_read_bytes:
                    row.expert_read_fraction_of_naive = row.expert_read_bytes / naive.expert_read_bytes
            if mk is not None:
                row.speedup_vs_mergekit = mk.wall_seconds / row.wall_seconds
            if row.system == "mergepipe" and per_expert is not None:
                row.amortised_analysis_seconds = per_expert * row.k


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small suite (< 3 min)")
    parser.add_argument("--methods", action="store_true",
                        help="the every-method groups (issue 42) instead, mergekit vs MergePipe on one YAML each; "
                        "with --quick on the quick suite's layout")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--budgets", default="",
                        help="comma-separated MergePipe budgets to run, e.g. 100%%,10%% (the first 100%% run, "
                        "the reference, always runs; no fixed-budget series)")
    parser.add_argument("--only", default="",
                        help="comma-separated groups to run, e.g. ties:8,task_arithmetic:4")
    parser.add_argument("--devices", default="cpu",
                        help="comma-separated --device values every MergePipe run repeats on, e.g. cpu,cuda "
                        "(the first runs the 100%% reference)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    devices = tuple(d for d in args.devices.split(",") if d)
    systems = tuple(s for s in args.systems.split(",") if s)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    spec = SUITES[{(False, False): "standard", (False, True): "quick", (True, False): "methods",
                   (True, True): "methods-quick"}[args.methods, args.quick]]
    if args.only:
        wanted = {tuple(item.split(":")) for item in args.only.split(",")}
        groups = tuple(g for g in spec.groups if (g.operator, str(g.k)) in wanted)
        if len(groups) != len(wanted):
            known = ", ".join(f"{g.operator}:{g.k}" for g in spec.groups)
            raise SystemExit(f"--only {args.only}: unknown group; this suite has {known}")
        spec = replace(spec, groups=groups)
    if args.budgets:
        keep = set(args.budgets.split(","))
        spec = replace(spec, fixed_budget_ks=(), groups=tuple(
            replace(g, mergepipe=tuple(run for i, run in enumerate(g.mergepipe) if i == 0 or run[0] in keep))
            for g in spec.groups))
    started = time.perf_counter()
    console = report.console()
    log = console.log

    max_k = max(g.k for g in spec.groups)
    generated = time.perf_counter()
    workload = ensure_workload(spec.layout, max_k, args.seed, args.root, log=log)
    generation_seconds = time.perf_counter() - generated
    scratch = workload.root / f"scratch-{spec.name}"
    remove_tree(scratch)
    scratch.mkdir()
    run = SuiteRun(spec, workload, scratch, systems, log, devices)
    load_before = os.getloadavg()
    if "mergepipe" in systems:
        run.setup_mergepipe()
        if run.mergepipe_ready is not None:
            log(f"[yellow]MergePipe rows skipped: {run.mergepipe_ready}")
    k2_full = weight_bytes(workload.expert_dirs(min(spec.fixed_budget_ks, default=2)))
    fixed_budget = int(spec.fixed_budget_fraction * k2_full)
    for group in spec.groups:
        in_series = group.operator == spec.fixed_budget_operator and group.k in spec.fixed_budget_ks
        run.run_group(group, fixed_budget if in_series else None)
    run.derive()
    remove_tree(scratch)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    result = {
        "suite": spec.name,
        "timestamp": stamp,
        "command": "python -m benchmarks.suite " + " ".join(argv if argv is not None else sys.argv[1:]),
        "spec": asdict(spec),
        "machine": report.machine_info(workload.root),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "workload": {
            "layout": asdict(workload.layout),
            "parameters": workload.layout.param_count(),
            "model_bytes": weight_bytes([workload.base]),
            "experts": [p.name for p in EXPERTS[:max_k]],
            "seed": args.seed,
            "generation_or_cache_seconds": generation_seconds,
        },
        "fixed_budget_bytes": fixed_budget,
        "analysis": run.analysis,
        "rows": [asdict(r) for r in run.rows],
        "notes": report.NOTES,
        "total_seconds": time.perf_counter() - started,
    }
    json_path = args.results / f"{spec.name}-{stamp}.json"
    json_path.write_text(json.dumps(result, indent=1))
    report.print_table(console, result)
    png_path = report.plot(result, args.results / f"{spec.name}-{stamp}.png")
    log(f"wrote {json_path} and {png_path} in {result['total_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
