"""The test table: one row per merge method, which the parametrized checks run over the registry.

A row holds the method's kernel-test settings (up to three experts), its independent plain-torch
reference (``combine`` over the deltas its ``sparsify`` leaves, experts in id order), its hand-computed
error-bound multipliers (``beta``), the end-to-end merge the engine tests run (``merge``: experts,
weights, global parameters) and that merge with one parameter changed (``changed``, provenance keys).
Parameters reach the kernels the engine's way (a ``MergeSpec`` resolved into typed params, a
``BlockContext``); the references read plain ``{user name: value}`` dicts (``as_dicts``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mergepipe.analysis.stats import trim_thresholds
from mergepipe.spec.operators import OPERATORS, BlockContext, MergeSpec
from mergepipe.spec.operators.base import TensorParams
from mergepipe.spec.operators.kernels import merge
from tests.spec.operators import reference as ref

TENSOR = "model.layers.1.mlp.up_proj.weight"
#: Layers of the model TENSOR belongs to (only gradients would care).
NUM_LAYERS = 2
SEED = 1234
#: Expert ids in an order that is not id order, so sums in id order are exercised.
IDS = ["expert-b", "expert-a", "expert-c"]
#: The experts of the end-to-end merges (tests/fixtures' tiny family).
E3 = ["e1", "e2", "e3"]


@dataclass(frozen=True)
class Row:
    experts: tuple[dict[str, Any], ...]
    global_: dict[str, Any]
    #: (base, xs, per-expert dicts, global dict) -> the merge of the (sparsified) deltas xs
    combine: Callable[..., torch.Tensor]
    #: (expert settings, global settings, hand-computed multipliers)
    beta: tuple[tuple[list[dict[str, Any]], dict[str, Any], list[float]], ...]
    merge: tuple[list[str], list[float] | None, dict[str, Any]]
    #: ("params" or "expert_params", the value) of ``merge`` with a parameter changed; None: nothing to change
    changed: tuple[str, dict[str, Any]] | None
    #: (delta, per-expert dict, global dict, uniforms) -> xi, for methods that sparsify each delta first
    sparsify: Callable[..., torch.Tensor] | None = None


def _weights(experts: Sequence[dict[str, Any]]) -> list[float]:
    return [p.get("weight", 1.0) for p in experts]


def _sum(base, xs, experts, g):
    return ref.linear_combine(base, ref.norm_coefs(_weights(experts), g["lambda"], g["normalize"]), xs)


def _consensus(base, xs, experts, g):
    return ref.consensus_combine(base, _weights(experts), xs, g["normalize"], g["lambda"])


def _linear(base, xs, experts, g):
    every = [*_weights(experts), g["base_weight"]]
    if g["normalize"]:
        return ref.linear_combine(base, ref.norm_coefs(every, 1.0, True)[:-1], xs)
    return ref.linear_combine(base, every[:-1], xs, base_scale=math.fsum(every))


def _ties(delta, p, g, rng):
    return ref.ties_sparsify(delta, p["density"])


def _dare(delta, p, g, rng):
    return ref.dare_sparsify(delta, p["density"], rng, g["rescale"])


def _breadcrumbs(delta, p, g, rng):
    return ref.breadcrumbs_sparsify(delta, p["density"], p["gamma"])


def _della(delta, p, g, rng):
    return ref.della_sparsify(delta, p["density"], p["epsilon"], rng, g["rescale"])


def _nearswap(base, xs, experts, g):
    """w = clamp(t / max(|Δ|, 1e-6), 0, 1), out = w E + (1 - w) B in fp32 (t / x as torch divides a number
    by a tensor: 1 / x, then times t, as mergekit computes it)."""
    w = torch.clamp((1.0 / torch.clamp(xs[0].abs(), min=1e-6)) * g["t"], 0.0, 1.0)
    return w * (base + xs[0]) + (1.0 - w) * base


W3 = ({"weight": 0.2}, {"weight": 0.5}, {"weight": 1.3})
NONE3: tuple[dict[str, Any], ...] = ({}, {}, {})
INF = math.inf

TABLE: dict[str, Row] = {
    "arcee_fusion": Row(
        ({},),
        {},
        lambda base, xs, e, g: ref.arcee_fusion(base, xs[0]),
        beta=(([{}], {}, [INF]),),
        merge=(["e1"], None, {}),
        changed=None,
    ),
    "avg": Row(
        NONE3,
        {},
        lambda base, xs, e, g: ref.linear_combine(base, [1.0 / len(xs)] * len(xs), xs),
        beta=(([{}, {}, {}, {}], {}, [0.25] * 4),),
        merge=(E3, None, {}),
        changed=None,
    ),
    "breadcrumbs": Row(
        (
            {"weight": 0.2, "density": 0.3, "gamma": 0.05},
            {"weight": 0.5, "density": 0.5, "gamma": 0.0},
            {"weight": 1.3, "density": 0.9, "gamma": 0.2},
        ),
        {},
        _sum,
        sparsify=_breadcrumbs,
        beta=(([{"weight": 0.5, "density": 0.5}], {"lambda": 2.0}, [1.0]),),  # no rescale: |c|
        merge=(E3, None, {"density": 0.5, "gamma": 0.1}),
        changed=("params", {"density": 0.5, "gamma": 0.2}),
    ),
    "breadcrumbs_ties": Row(
        (
            {"weight": 0.2, "density": 0.3, "gamma": 0.05},
            {"weight": 0.5, "density": 0.5, "gamma": 0.01},
            {"weight": 1.3, "density": 0.6, "gamma": 0.1},
        ),
        {"normalize": True},
        _consensus,
        sparsify=_breadcrumbs,
        beta=(
            ([{"weight": 4.0, "density": 0.5}], {"lambda": 0.7, "normalize": True}, [0.7]),
            ([{"weight": 4.0, "density": 0.5}], {"lambda": 0.7}, [2.8]),
        ),
        merge=(E3, None, {"density": 0.4, "gamma": 0.1}),
        changed=("params", {"density": 0.6, "gamma": 0.1}),
    ),
    "dare_linear": Row(
        ({"weight": 0.2, "density": 0.3}, {"weight": 0.5, "density": 0.5}, {"weight": 1.3, "density": 0.9}),
        {"lambda": 0.9},
        _sum,
        sparsify=_dare,
        # |c| / density with the inverse rescale, |c| otherwise; l1: no bound
        beta=(
            ([{"weight": 2.0, "density": 0.25}], {}, [8.0]),
            ([{"weight": 2.0, "density": 0.25}], {"rescale": "none"}, [2.0]),
            ([{"weight": 2.0, "density": 1.0}], {}, [2.0]),
            ([{"weight": 2.0, "density": 0.25}], {"rescale": "l1"}, [INF]),
        ),
        merge=(E3, [1.0, 0.5, 0.5], {"density": 0.5}),
        changed=("params", {"density": 0.7}),
    ),
    "dare_ties": Row(
        ({"weight": 0.2, "density": 0.3}, {"weight": 0.5, "density": 0.5}, {"weight": 1.3, "density": 0.9}),
        {"normalize": True},
        _consensus,
        sparsify=_dare,
        beta=(
            ([{"density": 0.5}, {"weight": 2.0, "density": 0.25}], {"lambda": 1.5, "normalize": True}, [3.0, 6.0]),
            # normalize defaults to false for dare_ties (as mergekit)
            ([{"density": 0.5}, {"weight": 2.0, "density": 0.25}], {"lambda": 1.5}, [3.0, 12.0]),
            ([{"weight": 2.0, "density": 0.5}], {"lambda": 1.5, "normalize": False}, [6.0]),
        ),
        merge=(E3, [1.0, 0.7, 0.4], {"density": 0.6}),
        changed=("params", {"density": 0.3}),
    ),
    "della": Row(
        (
            {"weight": 0.2, "density": 0.3, "epsilon": 0.1},
            {"weight": 0.5, "density": 0.5, "epsilon": 0.2},
            {"weight": 1.3, "density": 0.7, "epsilon": 0.0},
        ),
        {},
        _consensus,
        sparsify=_della,
        # the largest rescale is 1 / (density - epsilon)
        beta=(
            ([{"weight": 5.0, "density": 0.5, "epsilon": 0.1}], {}, [1.0 / (0.5 - 0.1)]),
            ([{"density": 0.5, "epsilon": 0.1}, {}], {"rescale": "l1"}, [INF, INF]),
        ),
        merge=(E3, None, {"density": 0.5, "epsilon": 0.1}),
        changed=("params", {"density": 0.5, "epsilon": 0.2}),
    ),
    "della_linear": Row(
        (
            {"weight": 0.2, "density": 0.3, "epsilon": 0.1},
            {"weight": 0.5, "density": 0.5, "epsilon": 0.2},
            {"weight": 1.3, "density": 0.7, "epsilon": 0.05},
        ),
        {"lambda": 1.2},
        _sum,
        sparsify=_della,
        beta=(
            ([{"weight": 1.0, "density": 0.5, "epsilon": 0.1}], {}, [1.0 / (0.5 - 0.1)]),
            ([{"weight": 3.0, "density": 0.6, "epsilon": 0.2}], {"lambda": 0.5}, [1.5 / (0.6 - 0.2)]),
            ([{"density": 0.5, "epsilon": 0.1}], {"rescale": "l1"}, [INF]),
        ),
        merge=(E3, None, {"density": 0.5, "epsilon": 0.2}),
        changed=("params", {"density": 0.5, "epsilon": 0.1}),
    ),
    "karcher": Row(
        NONE3,
        {"max_iter": 20},
        lambda base, xs, e, g: ref.karcher(base, xs, g),
        beta=(([{}, {}], {}, [INF, INF]),),
        merge=(E3, None, {}),
        changed=("params", {"max_iter": 0}),
    ),
    "linear": Row(
        W3,
        {},
        _linear,
        beta=(
            ([{"weight": 1.0}, {"weight": 3.0}], {}, [0.25, 0.75]),  # exact: |ci|
            ([{"weight": 1.0}, {"weight": 3.0}], {"normalize": False}, [1.0, 3.0]),
        ),
        merge=(E3, [0.5, 0.3, 0.2], {}),
        changed=("expert_params", {"e2": {"weight": 3.0}}),
    ),
    "model_stock": Row(
        NONE3,
        {},
        lambda base, xs, e, g: (ref.model_stock_rows if g["filter_wise"] else ref.model_stock)(base, xs),
        beta=(([{}, {}], {}, [INF, INF]), ([{}, {}], {"filter_wise": True}, [INF, INF])),
        merge=(E3, None, {}),
        changed=None,
    ),
    "multislerp": Row(
        W3,
        {},
        lambda base, xs, e, g: ref.multislerp(base, xs, e, g),
        beta=(([{}, {}], {}, [INF, INF]),),
        merge=(E3, [0.5, 0.3, 0.2], {}),
        changed=("expert_params", {"e2": {"weight": 3.0}}),
    ),
    "nearswap": Row(
        ({},),
        {"t": 0.01},
        _nearswap,
        beta=(([{}], {"t": 0.001}, [1.0]), ([{}], {"t": 5.0}, [1.0])),  # w |Δ| <= |Δ|, whatever t
        merge=(["e1"], None, {"t": 1e-3}),
        changed=("params", {"t": 2e-3}),
    ),
    "nuslerp": Row(
        ({"weight": 0.3}, {"weight": 0.9}),
        {"nuslerp_flatten": False},
        lambda base, xs, e, g: ref.nuslerp(base, xs, e, g),
        beta=(([{}, {}], {}, [INF, INF]),),
        merge=(["e1", "e2"], [0.4, 0.6], {"nuslerp_flatten": False}),
        changed=("params", {"nuslerp_flatten": False, "nuslerp_row_wise": True}),
    ),
    "ram": Row(
        NONE3,
        {"epsilon": 0.01},
        lambda base, xs, e, g: ref.ram(base, xs, g["epsilon"]),
        beta=(([{}, {}, {}], {"epsilon": 0.1}, [1.0, 1.0, 1.0]),),  # |m| <= Σ |Δi|
        merge=(E3, None, {"epsilon": 1e-3}),
        changed=("params", {"epsilon": 1e-2}),
    ),
    "ramplus_tl": Row(
        NONE3,
        {"r": 0.05, "alpha": 20.0, "epsilon": 0.01},
        lambda base, xs, e, g: ref.ramplus_tl(base, xs, g["r"], g["alpha"], g["epsilon"]),
        beta=(([{}, {}], {}, [INF, INF]),),
        merge=(E3, None, {"r": 0.5, "alpha": 1.0, "epsilon": 1e-3}),
        changed=("params", {"r": 0.5, "alpha": 0.5}),
    ),
    "sce": Row(
        NONE3,
        {"select_topk": 0.4},
        lambda base, xs, e, g: ref.sce(base, xs, g["select_topk"]),
        beta=(([{}, {}], {"select_topk": 0.5}, [INF, INF]),),
        merge=(E3, None, {"select_topk": 0.5}),
        changed=("params", {"select_topk": 0.3}),
    ),
    "slerp": Row(
        ({},),
        {"t": 0.3},
        lambda base, xs, e, g: ref.slerp(base, xs[0], g["t"]),
        beta=(([{}], {"t": 0.3}, [INF]),),
        merge=(["e1"], None, {"t": 0.3}),
        changed=("params", {"t": 0.6}),
    ),
    "task_arithmetic": Row(
        ({"weight": 0.2}, {"weight": -0.5}, {"weight": 1.3}),
        {"lambda": 0.8},
        _sum,
        beta=(
            ([{"weight": 0.5}, {"weight": -2.0}], {"lambda": 0.8}, [0.4, 1.6]),
            ([{"weight": 1.0}, {"weight": 3.0}], {"lambda": 2.0, "normalize": True}, [0.5, 1.5]),
        ),
        merge=(E3, [1.0, 0.5, -0.3], {"lambda": 0.8}),
        changed=("params", {"lambda": 0.5}),
    ),
    "ties": Row(
        ({"weight": 0.2, "density": 0.3}, {"weight": 0.5, "density": 0.5}, {"weight": 1.3, "density": 0.1}),
        {"lambda": 1.1},
        _consensus,
        sparsify=_ties,
        # consensus: |λ| with normalize, |λ w| without
        beta=(
            ([{"weight": 0.5}, {"weight": 2.0}], {"lambda": 0.9}, [0.9, 0.9]),
            ([{"weight": 0.5}, {"weight": 2.0}], {"lambda": -0.9, "normalize": False}, [0.45, 1.8]),
        ),
        merge=(E3, [1.0, 0.7, 0.4], {"density": 0.5, "lambda": 0.9}),
        changed=("params", {"density": 0.3}),
    ),
}
#: The kernel tests' settings: (per-expert settings, global settings).
CASES = {name: (list(row.experts), row.global_) for name, row in TABLE.items()}
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
    """The table's settings of ``name`` as the user would write them."""
    per_expert, global_ = CASES[name]
    ids = list(ids or IDS)[: len(per_expert)]
    return MergeSpec(name, tuple(zip(ids, per_expert)), dict(global_), seed=SEED)


def params_for(name: str, per_expert: Sequence[dict], global_: dict, ids: Sequence[str] | None = None) -> TensorParams:
    """Typed params of hand-written settings, through the engine's own path, for TENSOR."""
    ids = list(ids or IDS)[: len(per_expert)]
    spec = MergeSpec(name, tuple(zip(ids, (dict(p) for p in per_expert))), dict(global_), seed=SEED)
    return OPERATORS[name].resolve(spec, TENSOR, NUM_LAYERS)


def resolved(name: str) -> TensorParams:
    return params_for(name, *CASES[name])


def as_dicts(params: TensorParams) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(per-expert, global) ``{user name: value}`` dicts: what the references read."""
    return [p.to_dict() for p in params.experts], params.global_.to_dict()


def sparsify_all(name, deltas, ids, per_expert, global_, seed=SEED, tensor=TENSOR):
    """The reference's sparsified deltas (the deltas themselves for methods that do not sparsify)."""
    sparsify = TABLE[name].sparsify
    if sparsify is None:
        return list(deltas)
    return [sparsify(d, p, global_, ref.Uniforms(seed, i, tensor)) for d, p, i in zip(deltas, per_expert, ids)]


def reference_merge(name, base, deltas, ids, per_expert, global_, seed=SEED, tensor=TENSOR):
    """The whole-tensor reference of ``name``, experts in the order given."""
    xs = sparsify_all(name, deltas, ids, per_expert, global_, seed, tensor)
    return TABLE[name].combine(base, xs, per_expert, global_)


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
    return BlockContext(OPERATORS[name], TENSOR, shape, ids, params, seed=SEED, thresholds=thresholds)


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
