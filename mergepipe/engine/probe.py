"""What each operator's kernel costs on this machine's device, the compute in the time model's prior: the
checked kernel on a synthetic fp32 block, in seconds per element and expert (docs/ARCHITECTURE.md, Seconds)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from mergepipe.catalog import Catalog
from mergepipe.catalog.snapshots import host_key
from mergepipe.runtime import compute_threads
from mergepipe.spec.operators import OPERATORS, BlockContext, ExpertSpec, MergeSpec, kept_count
from mergepipe.spec.operators.kernels import merge, top_k

#: The synthetic tensor: 64K fp32 elements, the size of the pieces the engine merges on a CPU.
PROBE_SHAPE = (64, 1024)
#: Experts merged at once (fewer where the operator takes fewer).
PROBE_EXPERTS = 2
#: Timed sweeps over the operators (after one that warms up), each kernel's fastest timing kept.
SWEEPS = 3
#: Density of the trimming operators while probed (the kernel's cost barely depends on it).
DENSITY = 0.5
#: The tensor name the kernels see (a layer's MLP weight, so layer gradients resolve).
_TENSOR = "model.layers.0.mlp.up_proj.weight"


def probe_kernels(catalog: Catalog, device: str, operators: Iterable[str]) -> dict[str, float]:
    """Probe those of ``operators`` never probed on ``device`` here and record them; their seconds per element
    and expert."""
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        return {}  # no such device here: the planner or the engine refuses it in one line
    host = host_key()
    known = catalog.timings.kernel_seconds(host, device)
    # a passthrough has no kernel: it copies bytes, priced by the read rate alone
    missing = [op for op in dict.fromkeys(operators) if op not in known and op in OPERATORS]
    if not missing:
        return {}
    measured = kernel_seconds(missing, torch.device(device))
    catalog.timings.add_kernels(host, device, measured)
    return measured


def kernel_seconds(operators: Sequence[str], device: torch.device) -> dict[str, float]:
    """Seconds per element and expert of each operator's kernel on ``device``: the fastest of ``SWEEPS``
    sweeps over the operators, so a moment's load slows one timing of an operator, not all of them."""
    with compute_threads():  # as many threads as a merge gives its kernels
        merges = {op: _merge(op, device) for op in operators}
        best = dict.fromkeys(operators, math.inf)
        for sweep in range(SWEEPS + 1):
            for op, (once, work) in merges.items():
                started = time.perf_counter()
                once()
                if sweep:  # the first sweep warms up
                    best[op] = min(best[op], (time.perf_counter() - started) / work)
    return best


def _merge(operator: str, device: torch.device) -> tuple[Callable[[], None], int]:
    """A call of ``operator``'s checked kernel on a synthetic block (with exact trim thresholds), and the
    elements times experts it merges."""
    definition = OPERATORS[operator]
    experts = max(definition.min_experts, min(PROBE_EXPERTS, definition.max_experts or PROBE_EXPERTS))
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(PROBE_SHAPE, generator=generator).mul_(0.02).to(device)
    deltas: list[torch.Tensor | None] = [
        torch.randn(PROBE_SHAPE, generator=generator).mul_(0.002).to(device) for _ in range(experts)
    ]
    ids = tuple(f"e{i}" for i in range(experts))
    params = {"density": DENSITY} if "density" in definition.expert_params.names() else {}
    resolved = definition.resolve(MergeSpec(definition.name, tuple(ExpertSpec(e) for e in ids), params), _TENSOR, 1)
    thresholds = [
        {f: top_k(d.abs().reshape(-1), kept_count(f, d.numel()), f) for f in definition.needs_thresholds(p)}
        for d, p in zip(deltas, resolved.experts)
        if d is not None
    ]
    ctx = BlockContext(definition, _TENSOR, PROBE_SHAPE, ids, resolved, seed=0, thresholds=thresholds)

    def once() -> None:
        float(merge(base, deltas, ctx).sum())  # the sum waits for a GPU to finish

    return once, base.numel() * experts
