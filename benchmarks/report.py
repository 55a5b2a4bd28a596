"""Presenting suite results: a rich table, one log line per run, and the K plot."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rich.console import Console
from rich.table import Table

NOTES = [
    "Cold cache: before every run, os.sync() then POSIX_FADV_DONTNEED on every input file "
    "(base, all experts, MergePipe's catalog); Python and library files stay cached.",
    "expert read / base read: physical bytes by page-cache residency (mincore) of the weight "
    "files after the run; they include kernel readahead around what was requested.",
    "total read: /proc/<pid>/io read_bytes of the run's process tree (inputs, catalog, any "
    "cold library file); written: pages dirtied for writing (write_bytes).",
    "MP ctr: MergePipe's own realized expert-byte counter (bytes it requested); budget is "
    "respected when realized <= planned <= budget. expert MB above MP ctr is kernel readahead.",
    "bound ok: ||out - MergePipe 100%|| <= the plan's error_bound (a guarantee for "
    "fixed-coefficient operators such as task arithmetic; informative for TIES).",
    "start s: MergePipe's start-up, process start to its first read (interpreter, imports, catalog, plan).",
    "wall: the child process alone. flush: the os.sync() after it; MergePipe fsyncs inside its "
    "wall, naive and mergekit leave dirty pages, so compare wall+flush for fairness.",
    "peak RSS: ru_maxrss from wait4, which counts mmap'd file pages (safetensors maps whole "
    "files); anon: sampled RssAnon, the memory a run really needs.",
    "rel err: ||out - ref|| / ||ref|| with ref = naive full-read output; d-rel: the same over "
    "||ref - base||, the share of the merged task vector lost; vs MP100: against MergePipe's "
    "own 100% output (which should equal the naive one bit for bit).",
    "mergekit differs from the naive reference by design: bf16 arithmetic and an unstable "
    "argsort for TIES trimming (ties at the threshold are common in bf16 deltas).",
    "analysis (MergePipe, one-time per expert): amortised per merge as "
    "per-expert analyze seconds x K / merges in the continuous-integration scenario.",
]


TABLE_WIDTH = 240  # the table has ~20 columns; narrower consoles wrap every cell


def console() -> Console:
    return Console(width=max(TABLE_WIDTH, Console().width))


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.0f}"


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _short_status(status: str) -> str:
    """A table-width status; the full text is printed once below the table."""
    return status if len(status) <= 24 else status.split(":")[0]


def _label(row) -> str:
    get = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
    if get("system") != "mergepipe":
        return f"{get('system')} {get('operator')} K={get('k')}"
    budget = get("budget")
    if get("series") == "fixed-budget":
        budget = f"{int(budget) / 1e6:.0f}MB(fixed)"
    return f"mergepipe {get('operator')} K={get('k')} {budget} {get('policy')}" + _on(get("device"))


def _on(device: str | None) -> str:
    """`` @cuda`` for a run off the CPU; nothing for the CPU (and for results written before --devices)."""
    return "" if device in (None, "cpu") else f" @{device}"


def one_line(row) -> str:
    if row.status != "ok":
        return f"{_label(row)}: {row.status}"
    return (f"{_label(row)}: {row.wall_seconds:.1f} s (+{row.flush_seconds:.1f} s flush), "
            f"expert read {_mb(row.expert_read_bytes)} MB, total read {_mb(row.read_bytes)} MB, "
            f"peak RSS {_gb(row.peak_rss_bytes)} GB, d-rel err {_num(row.delta_rel_error, '.2e')}")


def print_table(out: Console, result: dict) -> None:
    table = Table(title=f"{result['suite']} suite, {result['workload']['layout']['name']} "
                        f"({result['workload']['model_bytes'] / 1e9:.2f} GB/model), "
                        f"{result['machine']['cpus']} CPUs", show_lines=False)
    columns = ["system", "op", "K", "budget", "policy", "wall s", "start s", "cpu s",
               "+flush", "x naive", "x mk",
               "expert MB", "% naive", "MP ctr MB", "budget ok", "total rd MB", "written MB",
               "RSS GB", "anon GB", "rel err", "d-rel err", "vs MP100", "bound ok", "status"]
    for c in columns:
        table.add_column(c, justify="left" if c in ("system", "op", "status", "policy") else "right")
    for r in result["rows"]:
        budget = r["budget"]
        if r["series"] == "fixed-budget":
            budget = f"{int(budget) / 1e6:.0f}MB fix"
        frac = r["expert_read_fraction_of_naive"]
        table.add_row(
            r["system"], r["operator"].replace("task_arithmetic", "ta"), str(r["k"]), budget,
            r["policy"] + _on(r.get("device")), _num(r["wall_seconds"], ".1f"),
            _num((r.get("mp_seconds") or {}).get("startup"), ".1f"),
            _num(r["cpu_seconds"], ".1f"),
            _num(r["flush_seconds"], ".1f"),
            _num(r["speedup_vs_naive"], ".2f"), _num(r["speedup_vs_mergekit"], ".2f"),
            _mb(r["expert_read_bytes"]), "-" if frac is None else f"{100 * frac:.1f}",
            _mb(r["mp_realized_expert_bytes"]),
            {True: "yes", False: "NO", None: "-"}[r["mp_budget_respected"]],
            _mb(r["read_bytes"]), _mb(r["write_bytes"]), _gb(r["peak_rss_bytes"]),
            _gb(r["peak_anon_rss_bytes"]), _num(r["rel_error"], ".1e"),
            _num(r["delta_rel_error"], ".1e"), _num(r["delta_rel_error_vs_mp_full"], ".1e"),
            {True: "yes", False: "NO", None: "-"}[r["mp_error_bound_respected"]],
            _short_status(r["status"]),
        )
    out.print(table)
    for status in dict.fromkeys(r["status"] for r in result["rows"]):
        if _short_status(status) != status:
            out.print(f"[yellow]{_short_status(status)}[/]: {status}")
    a = result["analysis"]
    if a.get("wall_seconds") is not None:
        out.print(f"MergePipe analyze (one-time): {a['experts']} experts in {a['wall_seconds']:.1f} s "
                  f"({a['expert_mb_per_second']:.0f} MB/s of expert files, {a['per_expert_seconds']:.1f} "
                  f"s/expert); over {a['amortise_over_merges']} merges: "
                  f"{a['amortised_seconds_per_expert_per_merge']:.2f} s per expert per merge. "
                  f"Register: {a['register_seconds']:.1f} s.")
    elif a:
        out.print(f"MergePipe analyze: {a.get('status')}")
    for line in target_lines(result["rows"]):
        out.print(line)
    out.print(f"load average before/after: {result['load_average_before']} / "
              f"{result['load_average_after']}")


#: Targets: (operator, budget, column, limit, at most?) on MergePipe's energy-policy matrix rows.
TARGETS = (
    ("task_arithmetic", "10%", "speedup_vs_mergekit", 5.0, False),
)


def target_lines(rows: list[dict]) -> list[str]:
    """One line per target and matching row: the value, the limit and whether it is met."""
    lines = []
    for operator, budget, column, limit, at_most in TARGETS:
        for r in rows:
            if (r["system"], r["series"], r["operator"], r["budget"], r["policy"]) != (
                    "mergepipe", "matrix", operator, budget, "energy") or r.get(column) is None:
                continue
            value = r[column]
            met = value <= limit if at_most else value >= limit
            lines.append(f"target {_label(r)}: {column} {value:.2f} ({'<=' if at_most else '>='} {limit}: "
                         f"{'met' if met else 'NOT met'})")
    return lines


def _colour(label: str) -> str:
    """One colour per system/setting; the operator is told by the line style."""
    if label.startswith("naive"):
        return "black"
    if label.startswith("mergekit"):
        return "tab:blue"
    if "(fixed)" in label:
        return "tab:red"
    return "tab:orange" if " 100% " in label else "tab:green"


def plot(result: dict, path: Path) -> Path:
    """Expert bytes read and wall time vs K, one line per system/setting and operator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in result["rows"]:
        if r["status"] != "ok" and not r["status"].startswith("ok,"):
            continue
        if r["system"] == "mergepipe" and r["series"] == "matrix" and not (
            r["policy"] == "energy" and r["budget"] in ("100%", "10%")):
            continue
        label = _label(r).replace(f" K={r['k']}", "")
        series.setdefault(label, []).append((r["k"], r["expert_read_bytes"] / 1e9, r["wall_seconds"]))
    fig, (ax_io, ax_t) = plt.subplots(1, 2, figsize=(15, 5.5))
    for label, points in sorted(series.items()):
        points.sort()
        ks = [p[0] for p in points]
        style = dict(linestyle="--" if "task_arithmetic" in label else "-", marker="o",
                     color=_colour(label), label=label.replace("task_arithmetic", "TA"))
        ax_io.plot(ks, [p[1] for p in points], **style)
        ax_t.plot(ks, [p[2] for p in points], **style)
    ax_io.set(xlabel="experts K", ylabel="expert bytes read from disk (GB)",
              title="Expert I/O vs K (cold cache, physical)")
    ax_t.set(xlabel="experts K", ylabel="wall seconds", title="Wall time vs K")
    for ax in (ax_io, ax_t):
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({r["k"] for r in result["rows"]}))
    ax_t.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                title="solid: TIES, dashed: task arithmetic",
                title_fontsize=7)
    fig.suptitle(f"{result['suite']} suite, {result['workload']['layout']['name']}, "
                 f"{result['timestamp']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine_info(workload_root: Path) -> dict:
    def first(path: str, key: str) -> str:
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return "unknown"

    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    root = str(workload_root.resolve())
    mount = max((m for m in mounts if root.startswith(m[1])), key=lambda m: len(m[1]))
    versions = {}
    for module in ("torch", "safetensors", "transformers", "mergekit", "numpy"):
        try:
            versions[module] = version(module)
        except PackageNotFoundError:
            versions[module] = "not installed"
    return {
        "cpu": first("/proc/cpuinfo", "model name"),
        "cpus": os.cpu_count(),
        "memory": first("/proc/meminfo", "MemTotal"),
        "filesystem": f"{mount[0]} ({mount[2]}) on {mount[1]}",
        "python": platform.python_version(),
        "kernel": platform.release(),
        "versions": versions,
    }
