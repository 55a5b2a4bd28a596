"""Shared inputs and helpers for operator tests."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mergepipe.catalog.thresholds import trim_thresholds
from mergepipe.engine.operators.base import BlockContext, Operator
from mergepipe.engine.operators.registry import OPERATORS
from mergepipe.engine.params import MergeSpec, resolve_for_tensor

TENSOR = "model.layers.1.mlp.up_proj.weight"
SEED = 1234

#: Per-operator test configuration: (per-expert params for 3 experts, global params).
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "avg": ([{}, {}, {}], {}),
    "linear": ([{"weight": 0.2}, {"weight": 0.5}, {"weight": 1.3}], {}),
    "task_arithmetic": ([{"weight": 0.2}, {"weight": -0.5}, {"weight": 1.3}], {"lambda": 0.8}),
    "ties": ([{"weight": 0.2, "density": 0.3}, {"weight": 0.5, "density": 0.5}, {"weight": 1.3, "density": 0.1}], {"lambda": 1.1}),
    "dare_linear": ([{"weight": 0.2, "density": 0.3}, {"weight": 0.5, "density": 0.5}, {"weight": 1.3, "density": 0.9}], {"lambda": 0.9}),
    "dare_ties": ([{"weight": 0.2, "density": 0.3}, {"weight": 0.5, "density": 0.5}, {"weight": 1.3, "density": 0.9}], {"normalize": True}),
    "breadcrumbs": ([{"weight": 0.2, "density": 0.3, "gamma": 0.05}, {"weight": 0.5, "density": 0.5, "gamma": 0.0}, {"weight": 1.3, "density": 0.9, "gamma": 0.2}], {}),
    "breadcrumbs_ties": ([{"weight": 0.2, "density": 0.3, "gamma": 0.05}, {"weight": 0.5, "density": 0.5, "gamma": 0.01}, {"weight": 1.3, "density": 0.6, "gamma": 0.1}], {"normalize": True}),
    "della": ([{"weight": 0.2, "density": 0.3, "epsilon": 0.1}, {"weight": 0.5, "density": 0.5, "epsilon": 0.2}, {"weight": 1.3, "density": 0.7, "epsilon": 0.0}], {}),
    "della_linear": ([{"weight": 0.2, "density": 0.3, "epsilon": 0.1}, {"weight": 0.5, "density": 0.5, "epsilon": 0.2}, {"weight": 1.3, "density": 0.7, "epsilon": 0.05}], {"lambda": 1.2}),
    "slerp": ([{}], {"t": 0.3}),
    "model_stock": ([{}, {}, {}], {}),
}
IDS = ["expert-b", "expert-a", "expert-c"]
STREAMING = [n for n, op in OPERATORS.items() if op.streaming]


def make_inputs(shape: Sequence[int], k: int, seed: int = 0, scale: float = 0.02, quantize: bool = True):
    """A base and k deltas; deltas rounded to bf16 spacing so that |Δ| ties occur."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tuple(shape), generator=g)
    deltas = []
    for i in range(k):
        d = torch.randn(tuple(shape), generator=g) * scale * (1 + i)
        if quantize:
            d = (base + d).to(torch.bfloat16).float() - base
        deltas.append(d)
    return base, deltas


def spec_for(name: str, ids: Sequence[str] | None = None) -> MergeSpec:
    per_expert, global_ = CASES[name]
    ids = list(ids or IDS)[: len(per_expert)]
    return MergeSpec(name, tuple(zip(ids, per_expert)), dict(global_), seed=SEED)


def resolved(name: str, ids: Sequence[str] | None = None):
    spec = spec_for(name, ids)
    per_expert, global_ = resolve_for_tensor(spec, TENSOR, 1, 2)
    return spec, per_expert, global_


def thresholds_for(op: Operator, deltas, per_expert):
    """What the catalog would store: thresholds at every needed density."""
    out = []
    for d, p in zip(deltas, per_expert):
        need = op.needs_thresholds(p)
        out.append(dict(zip(need, trim_thresholds(d.abs().reshape(-1), need))) if need else {})
    return out


def context(name, shape, ids, per_expert, global_, thresholds=None) -> BlockContext:
    return BlockContext.create(TENSOR, shape, ids, per_expert, global_, seed=SEED, thresholds=thresholds)


def run_blocks(op: Operator, base, deltas, ctx: BlockContext, rows_per_block: int, unread: set[tuple[int, int]] = frozenset()):
    """Merge block by block (whole rows); ``unread`` = {(expert, block index)}."""
    if base.dim() < 2:
        return op.merge(base, [None if (i, 0) in unread else d for i, d in enumerate(deltas)], ctx)
    parts = []
    for b, r0 in enumerate(range(0, base.shape[0], rows_per_block)):
        r1 = r0 + rows_per_block
        ds = [None if (i, b) in unread else d[r0:r1] for i, d in enumerate(deltas)]
        parts.append(op.merge(base[r0:r1], ds, ctx.for_rows(r0)))
    return torch.cat(parts)
