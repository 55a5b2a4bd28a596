"""Shared inputs and helpers for the kernel tests: one configuration per operator.

Parameters reach the kernels the way the engine gives them: a ``MergeSpec``
resolved by the operator's definition (``OperatorDef.resolve``) into typed
params, and a ``BlockContext`` built from them. The independent references
(``reference.py``) take the same values as plain ``{user name: value}``
dicts (``as_dicts``), so they never touch the package's parameter types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mergepipe.analysis.stats import trim_thresholds
from mergepipe.engine.operators.context import BlockContext
from mergepipe.engine.operators.registry import merge
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import TensorParams
from mergepipe.spec.operators import OPERATORS

TENSOR = "model.layers.1.mlp.up_proj.weight"
#: Layers of the model TENSOR belongs to (only gradients would care).
NUM_LAYERS = 2
SEED = 1234

#: Per-operator test configuration: (per-expert settings for 3 experts, global settings).
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
    "nuslerp": ([{"weight": 0.3}, {"weight": 0.9}], {"nuslerp_flatten": False}),
    "multislerp": ([{"weight": 0.2}, {"weight": 0.5}, {"weight": 1.3}], {}),
    "karcher": ([{}, {}, {}], {"max_iter": 20}),
    "nearswap": ([{}], {"t": 0.01}),
    "arcee_fusion": ([{}], {}),
    "sce": ([{}, {}, {}], {"select_topk": 0.4}),
    "ram": ([{}, {}, {}], {"epsilon": 0.01}),
    "ramplus_tl": ([{}, {}, {}], {"r": 0.05, "alpha": 20.0, "epsilon": 0.01}),
}
#: Expert ids in an order that is not id order, so sums in id order are exercised.
IDS = ["expert-b", "expert-a", "expert-c"]
STREAMING = [n for n, d in OPERATORS.items() if d.streaming]


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
    """The CASES configuration of ``name`` as the user would write it."""
    per_expert, global_ = CASES[name]
    ids = list(ids or IDS)[: len(per_expert)]
    return MergeSpec(name, tuple(zip(ids, per_expert)), dict(global_), seed=SEED)


def params_for(name: str, per_expert: Sequence[dict], global_: dict, ids: Sequence[str] | None = None) -> TensorParams:
    """Typed params of hand-written settings, through the engine's own path
    (defaults filled in, values coerced), for TENSOR."""
    ids = list(ids or IDS)[: len(per_expert)]
    spec = MergeSpec(name, tuple(zip(ids, (dict(p) for p in per_expert))), dict(global_), seed=SEED)
    return OPERATORS[name].resolve(spec, TENSOR, NUM_LAYERS)


def resolved(name: str) -> TensorParams:
    """Typed params of the CASES configuration of ``name`` (experts in IDS order)."""
    return params_for(name, *CASES[name])


def as_dicts(params: TensorParams) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(per-expert, global) ``{user name: value}`` dicts: what the references read."""
    return [p.to_dict() for p in params.experts], params.global_.to_dict()


def thresholds_for(name: str, deltas, params: TensorParams):
    """What the catalog would store: thresholds at every density the definition needs."""
    definition = OPERATORS[name]
    out = []
    for d, p in zip(deltas, params.experts):
        need = definition.needs_thresholds(p)
        out.append(dict(zip(need, trim_thresholds(d.abs().reshape(-1), need))) if need else {})
    return out


def context(name: str, shape, ids: Sequence[str], params: TensorParams, thresholds=None) -> BlockContext:
    """A whole-tensor context for TENSOR, as the engine builds it."""
    return BlockContext.create(OPERATORS[name], TENSOR, shape, ids, params, seed=SEED, thresholds=thresholds)


def run_blocks(base, deltas, ctx: BlockContext, rows_per_block: int, unread: frozenset[tuple[int, int]] = frozenset()):
    """Merge block by block (whole rows), as the engine does; ``unread`` = {(expert, block index)}."""
    if base.dim() < 2:
        return merge(base, [None if (i, 0) in unread else d for i, d in enumerate(deltas)], ctx)
    parts = []
    for b, r0 in enumerate(range(0, base.shape[0], rows_per_block)):
        r1 = r0 + rows_per_block
        ds = [None if (i, b) in unread else d[r0:r1] for i, d in enumerate(deltas)]
        parts.append(merge(base[r0:r1], ds, ctx.for_rows(r0)))
    return torch.cat(parts)
