"""Micro-benchmark: MergePipe's streaming operators vs mergekit's, same tensors.

    python -m benchmarks.operators_bench [--mib 64] [--experts 2 4 8] [--repeats 3] [--threads N]

A "block set" is four fp32 tensors of shape (rows, 1024) totalling ``--mib``
MiB of base. For K experts (bf16-rounded fine-tunes of the base, as real
checkpoints are) each operator merges the set:

* MergePipe, as the engine runs it: ``Operator.merge`` block by block (1 MiB
  blocks of whole rows) on fp32 deltas, writing the output. The engine's
  ``Δ = E - B`` (part of decoding the expert block) is timed separately and
  shown added in "op + Δ". Trimming operators (TIES, breadcrumbs) get the
  per-tensor TrimThresholds the catalog stores; computing them ("thresholds
  (once)": one O(n) pass per expert, paid once at ``analyze`` and reused by
  every later merge) is timed separately too, and added in the last ratio;
* mergekit 0.1.5: its merge method objects called directly on whole fp32
  tensors (``registry.get(name)([TensorGroup], parameters=...)``), with
  mergekit's defaults (e.g. L1 rescale for DARE/DELLA).

nearswap merges one expert, so its row runs where ``--experts`` has 1.

Throughput is MiB/s of expert data (K x the set's fp32 bytes); times are
the best of ``--repeats`` runs, MergePipe and mergekit interleaved so both
see the same background load. Both use the same torch thread count.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from typing import Any, Callable

import torch

from mergepipe.analysis.stats import trim_thresholds
from mergepipe.engine.operators.context import BlockContext
from mergepipe.engine.operators.registry import merge
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import OPERATORS

COLS = 1024
NUM_TENSORS = 4
BLOCK_BYTES = 1 << 20  # the catalog's default block size
MiB = 1 << 20

#: row label -> (our operator, mergekit method, per-expert params, global params).
#: ``weight: "varied"`` gives expert i the weight 0.5 + 0.25 i (no two equal).
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "avg": ("avg", "linear", {}, {}),
    "linear (equal w)": ("linear", "linear", {"weight": 1.0}, {}),
    "linear (varied w)": ("linear", "linear", {"weight": "varied"}, {}),
    "task_arithmetic": ("task_arithmetic", "task_arithmetic", {"weight": "varied"}, {}),
    "ties": ("ties", "ties", {"weight": "varied", "density": 0.5}, {}),
    "dare_linear": ("dare_linear", "dare_linear", {"weight": "varied", "density": 0.5}, {}),
    "dare_ties": ("dare_ties", "dare_ties", {"weight": "varied", "density": 0.5}, {}),
    "breadcrumbs": ("breadcrumbs", "breadcrumbs", {"weight": "varied", "density": 0.5, "gamma": 0.01}, {}),
    "breadcrumbs_ties": ("breadcrumbs_ties", "breadcrumbs_ties", {"weight": "varied", "density": 0.5, "gamma": 0.01}, {}),
    "della": ("della", "della", {"weight": "varied", "density": 0.5, "epsilon": 0.1}, {}),
    "della_linear": ("della_linear", "della_linear", {"weight": "varied", "density": 0.5, "epsilon": 0.1}, {}),
    "ram": ("ram", "ram", {}, {"epsilon": 1e-5}),
    "nearswap": ("nearswap", "nearswap", {}, {"t": 1e-3}),  # one expert: runs at --experts 1 only
}


def fits(label: str, k: int) -> bool:
    """Whether the operator merges ``k`` experts (nearswap takes exactly one)."""
    definition = OPERATORS[CASES[label][0]]
    return definition.min_experts <= k and (definition.max_experts is None or k <= definition.max_experts)


def expert_params(label: str, i: int) -> dict[str, Any]:
    params = dict(CASES[label][2])
    if params.get("weight") == "varied":
        params["weight"] = 0.5 + 0.25 * i
    return params


def spec_for(label: str, k: int) -> MergeSpec:
    op_name, _, _, global_params = CASES[label]
    return MergeSpec(op_name, tuple((f"e{i}", expert_params(label, i)) for i in range(k)), dict(global_params), seed=0)


def make_set(total_mib: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = total_mib * MiB // 4 // COLS // NUM_TENSORS
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(NUM_TENSORS)]
    base = {n: torch.randn(rows, COLS, generator=g) * 0.02 for n in names}
    experts = []
    for _ in range(k):
        experts.append({n: (b + torch.randn(b.shape, generator=g) * 0.002).to(torch.bfloat16).float() for n, b in base.items()})
    return names, base, experts


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved_best(repeats: int, *fns: Callable[[], Any]) -> list[float]:
    """Best wall time of each function, runs interleaved so that both sides
    see the same background load (min over repeats filters the noise)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_of(1, fn))
    return best


def delta_runner(names, base, experts, deltas):
    """The engine's part before an operator: Δ = E - B in fp32 for every block."""

    def run():
        for t in names:
            deltas[t] = [e[t] - base[t] for e in experts]

    return run


def ours_runner(label, names, base, deltas):
    """The engine's checked kernel entry point, block by block over precomputed Δ."""
    k = len(deltas[names[0]])
    spec = spec_for(label, k)
    definition = OPERATORS[spec.operator]
    definition.validate(spec)
    thresholds = catalog_thresholds(label, names, deltas)
    contexts = {}
    for t in names:
        params = definition.resolve(spec, t, 0)
        assert definition.streams_with(params, True)
        contexts[t] = BlockContext.create(definition, t, base[t].shape, spec.expert_ids, params, seed=0,
                                          thresholds=thresholds[t])
    rows_per_block = max(1, BLOCK_BYTES // (COLS * 4))

    def run():
        outputs = []  # the engine hands each merged block to the writer
        for t in names:
            b, ctx, ds = base[t], contexts[t], deltas[t]
            for r0 in range(0, b.shape[0], rows_per_block):
                r1 = r0 + rows_per_block
                outputs.append(merge(b[r0:r1], [d[r0:r1] for d in ds], ctx.for_rows(r0)))
        return outputs

    return run


def needed(label, k):
    spec = spec_for(label, k)
    definition = OPERATORS[spec.operator]
    params = definition.resolve(spec, "x", 0)
    return [definition.needs_thresholds(p) for p in params.experts]


def catalog_thresholds(label, names, deltas):
    """What ``analyze`` stores for this operator: thresholds per expert and tensor."""
    needs = needed(label, len(deltas[names[0]]))
    return {
        t: [dict(zip(need, trim_thresholds(d.abs().reshape(-1), need))) if need else {} for d, need in zip(deltas[t], needs)]
        for t in names
    }


def mergekit_runner(label, names, base, experts):
    from mergekit.merge_methods import registry
    from mergekit.merge_methods.base import TensorGroup

    _, method_name, _, global_params = CASES[label]
    method = registry.get(method_name)
    ids = [f"e{i}" for i in range(len(experts))]
    per_expert = [expert_params(label, i) for i in range(len(experts))]
    params: dict[str, Any] = dict(global_params)
    for key in ("weight", "density", "gamma", "epsilon"):
        if key in per_expert[0]:
            params[key] = {i: p[key] for i, p in zip(ids, per_expert)}
    if method_name == "linear":
        params["weight"] = {i: p.get("weight", 1.0) for i, p in zip(ids, per_expert)}

    def run():
        for t in names:
            if method_name == "linear":
                group = TensorGroup.from_tensors([e[t] for e in experts], ids=ids, name=t)
            else:
                group = TensorGroup.from_tensors([base[t]] + [e[t] for e in experts], ids=["base"] + ids, base_index=0, name=t)
            method([group], parameters=params)

    return run


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="fp32 size of the base block set")
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", nargs="+", default=list(CASES), help=f"rows to run, from: {', '.join(CASES)}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    have_mergekit = importlib.util.find_spec("mergekit") is not None

    console = Console()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table = Table(
        title=f"Streaming operators, {args.mib} MiB fp32 block set, MiB/s of expert data "
        f"(torch threads={torch.get_num_threads()}, {os.cpu_count()} CPUs, load avg at start {load:.1f})"
    )
    columns = (
        "operator", "K", "MergePipe op", "mergekit", "ratio",
        "MergePipe op + Δ", "ratio incl. Δ", "thresholds (once)", "ratio incl. Δ + thr",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "operator" else "right")
    for k in args.experts:
        names, base, experts = make_set(args.mib, k)
        data_mib = k * args.mib
        deltas: dict[str, list[torch.Tensor]] = {}
        delta_s = best_of(args.repeats, delta_runner(names, base, experts, deltas))
        for name in [op for op in args.ops if fits(op, k)]:
            thr_s = 0.0
            if any(needed(name, k)):
                start = time.perf_counter()
                catalog_thresholds(name, names, deltas)
                thr_s = time.perf_counter() - start
            ours = ours_runner(name, names, base, deltas)
            if have_mergekit:
                ours_s, mk_s = interleaved_best(args.repeats, ours, mergekit_runner(name, names, base, experts))
            else:
                ours_s, mk_s = best_of(args.repeats, ours), float("nan")
            row = [name, str(k), f"{data_mib / ours_s:,.0f}", f"{data_mib / mk_s:,.0f}", f"{mk_s / ours_s:.2f}x"]
            with_delta = ours_s + delta_s
            row += [f"{data_mib / with_delta:,.0f}", f"{mk_s / with_delta:.2f}x"]
            if thr_s:
                row += [f"{data_mib / thr_s:,.0f}", f"{mk_s / (with_delta + thr_s):.2f}x"]
            else:
                row += ["-", "-"]
            table.add_row(*row)
            console.log(f"{name} K={k}: ours {ours_s:.3f}s (+ delta {delta_s:.3f}s) mergekit {mk_s:.3f}s thresholds {thr_s:.3f}s")
        del base, experts, deltas
    console.print(table)


if __name__ == "__main__":
    main()
