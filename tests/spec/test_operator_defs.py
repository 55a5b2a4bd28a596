"""Operator definitions (mergepipe.spec.operators / spec.operators): the
registry, per-tensor resolution of settings into typed params, the
error-bound multipliers (beta) the planner budgets with, and the
threshold/streaming decisions."""

from __future__ import annotations

import math

import pytest

from mergepipe.engine.operators.registry import KERNELS
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import TensorParams
from mergepipe.spec.operators import OPERATORS, get_operator

Q = "model.layers.{}.self_attn.q_proj.weight"
MLP = "model.layers.{}.mlp.down_proj.weight"
Q0 = Q.format(0)


def resolve(op, experts, params=None, tensor=Q0, num_layers=2) -> TensorParams:
    """Typed params of a spec written as ``[(id, settings), ...]`` for one tensor."""
    return get_operator(op).resolve(MergeSpec(op, tuple(experts), params or {}), tensor, num_layers)


def beta(op, experts, params=None) -> list[float]:
    return get_operator(op).beta(resolve(op, experts, params))


def test_every_definition_has_a_kernel_and_every_kernel_a_definition():
    assert list(OPERATORS) == list(KERNELS)
    assert all(definition.name == name for name, definition in OPERATORS.items())


# ----------------------------------------------------------------- resolution


def test_expert_setting_beats_global_setting_beats_default():
    params = resolve("ties", [("a", {"density": 0.2}), ("b", {})], {"density": 0.6})
    assert [e.density for e in params.experts] == [0.2, 0.6]
    assert [e.weight for e in params.experts] == [1.0, 1.0]  # nobody set it: the default
    assert (params.global_.lambda_, params.global_.normalize) == (1.0, True)
    # a global gradient is every expert's default, evaluated for the tensor
    params = resolve("ties", [("a", {"density": 0.2}), ("b", {})], {"density": 0.6, "weight": [1.0, 3.0]},
                     Q.format(1), 3)
    assert [e.to_dict() for e in params.experts] == [{"weight": 2.0, "density": 0.2}, {"weight": 2.0, "density": 0.6}]
    params = resolve("ties", [("a", {"density": 0.5}), ("b", {"weight": 2})])
    assert [e.to_dict() for e in params.experts] == [{"weight": 1.0, "density": 0.5}, {"weight": 2.0, "density": 1.0}]
    assert params.global_.to_dict() == {"lambda": 1.0, "normalize": True}


def test_defaults_are_per_operator():
    """normalize defaults to True for TIES (a mean), False for task arithmetic (a sum)."""
    assert resolve("ties", [("a", {})]).global_.normalize is True
    assert resolve("task_arithmetic", [("a", {})]).global_.normalize is False
    assert resolve("dare_linear", [("a", {})]).global_.to_dict() == {"lambda": 1.0, "normalize": False, "rescale": "inverse"}
    assert resolve("della", [("a", {})]).global_.to_dict() == {"lambda": 1.0, "normalize": True, "rescale": "inverse"}
    assert resolve("slerp", [("a", {})]).global_.to_dict() == {"t": 0.5}
    assert resolve("breadcrumbs", [("a", {})]).experts[0].to_dict() == {"weight": 1.0, "density": 1.0, "gamma": 0.01}
    assert resolve("avg", [("a", {}), ("b", {})]) == TensorParams((OPERATORS["avg"].expert_params(),) * 2,
                                                               OPERATORS["avg"].global_params())


def test_normalize_defaults_are_mergekits():
    """mergekit 0.1.5's default_normalize per method (merge_methods/registry.py)."""
    expected = {"ties": True, "della": True, "task_arithmetic": False, "dare_ties": False, "dare_linear": False,
                "breadcrumbs": False, "breadcrumbs_ties": False, "della_linear": False, "linear": True}
    got = {op: resolve(op, [("a", {})]).global_.normalize for op in expected}
    assert got == expected


def test_values_are_coerced_and_typed():
    params = resolve("dare", [("a", {"weight": 2, "density": 1})], {"rescale": "L1", "lambda": 3})
    (expert,) = params.experts
    assert expert.to_dict() == {"weight": 2.0, "density": 1.0}
    assert type(expert.weight) is float and type(params.global_.lambda_) is float
    assert params.global_.rescale == "l1"


def test_gradients_interpolate_over_layers():
    spec = [("a", {}), ("b", {"weight": 0.5})]
    params = {"weight": [1.0, 3.0], "lambda": [0.0, 1.0, 0.0]}
    got = [resolve("task_arithmetic", spec, params, Q.format(i), 3) for i in range(3)]
    assert [p.experts[0].weight for p in got] == [1.0, 2.0, 3.0]
    assert [p.experts[1].weight for p in got] == [0.5, 0.5, 0.5]  # the expert's own scalar wins
    assert [p.global_.lambda_ for p in got] == [0.0, 1.0, 0.0]
    # outside the layers: the first value
    assert resolve("task_arithmetic", spec, params, "lm_head.weight", 3).experts[0].weight == 1.0


def test_rules_pick_the_first_match_then_fall_back():
    rules = [{"filter": "mlp", "value": 0.3}, {"filter": "layers", "value": 0.4}]
    spec = [("a", {"density": rules}), ("b", {"density": [{"filter": "*", "value": 0.9}]})]
    mlp = resolve("ties", spec, {"density": 0.7}, MLP.format(1))
    attn = resolve("ties", spec, {"density": 0.7}, Q.format(1))
    head = resolve("ties", spec, {"density": 0.7}, "lm_head.weight")
    default = resolve("ties", spec, {}, "lm_head.weight")
    assert [e.density for e in mlp.experts] == [0.3, 0.9]  # "layers" matches too, but comes second
    assert [e.density for e in attn.experts] == [0.4, 0.9]
    assert [e.density for e in head.experts] == [0.7, 0.9]  # no rule matches: the global setting
    assert [e.density for e in default.experts] == [1.0, 0.9]  # and without one, the default


def test_experts_keep_the_spec_order():
    params = resolve("linear", [("z", {"weight": 3.0}), ("a", {"weight": 1.0})])
    assert [e.weight for e in params.experts] == [3.0, 1.0]


# --------------------------------------------------------------------- beta


BETA_CASES = [
    # exact: |ci|
    ("avg", [("a", {}), ("b", {}), ("c", {}), ("d", {})], {}, [0.25] * 4),
    ("linear", [("a", {"weight": 1.0}), ("b", {"weight": 3.0})], {}, [0.25, 0.75]),
    ("linear", [("a", {"weight": 1.0}), ("b", {"weight": 3.0})], {"normalize": False}, [1.0, 3.0]),
    ("task_arithmetic", [("a", {"weight": 0.5}), ("b", {"weight": -2.0})], {"lambda": 0.8}, [0.4, 1.6]),
    ("task_arithmetic", [("a", {"weight": 1.0}), ("b", {"weight": 3.0})], {"lambda": 2.0, "normalize": True},
     [0.5, 1.5]),
    # consensus: |λ| with normalize, |λ w| without
    ("ties", [("a", {"weight": 0.5}), ("b", {"weight": 2.0})], {"lambda": 0.9}, [0.9, 0.9]),
    ("ties", [("a", {"weight": 0.5}), ("b", {"weight": 2.0})], {"lambda": -0.9, "normalize": False},
     [0.45, 1.8]),
    # DARE: |c| / density with the inverse rescale, |c| otherwise; l1: no bound
    ("dare_linear", [("a", {"weight": 2.0, "density": 0.25})], {}, [8.0]),
    ("dare_linear", [("a", {"weight": 2.0, "density": 0.25})], {"rescale": "none"}, [2.0]),
    ("dare_linear", [("a", {"weight": 2.0, "density": 1.0})], {}, [2.0]),
    ("dare_linear", [("a", {"weight": 2.0, "density": 0.25})], {"rescale": "l1"}, [math.inf]),
    ("dare_ties", [("a", {"density": 0.5}), ("b", {"weight": 2.0, "density": 0.25})],
     {"lambda": 1.5, "normalize": True}, [3.0, 6.0]),
    ("dare_ties", [("a", {"density": 0.5}), ("b", {"weight": 2.0, "density": 0.25})], {"lambda": 1.5},
     [3.0, 12.0]),  # normalize defaults to false for dare_ties (as mergekit)
    ("dare_ties", [("a", {"weight": 2.0, "density": 0.5})], {"lambda": 1.5, "normalize": False}, [6.0]),
    # DELLA: the largest rescale is 1 / (density - epsilon)
    ("della_linear", [("a", {"weight": 1.0, "density": 0.5, "epsilon": 0.1})], {}, [1.0 / (0.5 - 0.1)]),
    ("della_linear", [("a", {"weight": 3.0, "density": 0.6, "epsilon": 0.2})], {"lambda": 0.5},
     [1.5 / (0.6 - 0.2)]),
    ("della_linear", [("a", {"density": 0.5, "epsilon": 0.1})], {"rescale": "l1"}, [math.inf]),
    ("della", [("a", {"weight": 5.0, "density": 0.5, "epsilon": 0.1})], {}, [1.0 / (0.5 - 0.1)]),
    ("della", [("a", {"density": 0.5, "epsilon": 0.1}), ("b", {})], {"rescale": "l1"}, [math.inf, math.inf]),
    # breadcrumbs: no rescale, |c|
    ("breadcrumbs", [("a", {"weight": 0.5, "density": 0.5})], {"lambda": 2.0}, [1.0]),
    ("breadcrumbs_ties", [("a", {"weight": 4.0, "density": 0.5})], {"lambda": 0.7, "normalize": True}, [0.7]),
    ("breadcrumbs_ties", [("a", {"weight": 4.0, "density": 0.5})], {"lambda": 0.7}, [2.8]),
    # tensor-level: no per-element bound
    ("slerp", [("a", {})], {"t": 0.3}, [math.inf]),
    ("model_stock", [("a", {}), ("b", {})], {}, [math.inf, math.inf]),
    ("nuslerp", [("a", {}), ("b", {})], {}, [math.inf, math.inf]),
    ("multislerp", [("a", {}), ("b", {})], {}, [math.inf, math.inf]),
    ("karcher", [("a", {}), ("b", {})], {}, [math.inf, math.inf]),
    ("model_stock", [("a", {}), ("b", {})], {"filter_wise": True}, [math.inf, math.inf]),
    ("arcee_fusion", [("a", {})], {}, [math.inf]),
    # nearswap moves an entry by w |Δ| with w in [0, 1]: at most |Δ|, whatever t
    ("nearswap", [("a", {})], {"t": 0.001}, [1.0]),
    ("nearswap", [("a", {})], {"t": 5.0}, [1.0]),
    # sce: whole-tensor weights and selection, no bound; ram: |m| <= Σ |Δi| (each delta whole or divided)
    ("sce", [("a", {}), ("b", {})], {"select_topk": 0.5}, [math.inf, math.inf]),
    ("ram", [("a", {}), ("b", {}), ("c", {})], {"epsilon": 0.1}, [1.0, 1.0, 1.0]),
    ("ramplus_tl", [("a", {}), ("b", {})], {}, [math.inf, math.inf]),
]


@pytest.mark.parametrize("op, experts, params, expected", BETA_CASES)
def test_beta(op, experts, params, expected):
    """Hand-computed multipliers: the planner's error bound is only as sound as these."""
    assert beta(op, experts, params) == pytest.approx(expected, rel=1e-12)


def test_every_operator_is_in_the_beta_table():
    assert {case[0] for case in BETA_CASES} == set(OPERATORS)


def test_coefficients_are_signed_and_base_scale_follows_normalize():
    ta = OPERATORS["task_arithmetic"]
    params = resolve("task_arithmetic", [("a", {"weight": 0.5}), ("b", {"weight": -2.0})], {"lambda": 0.8})
    assert ta.coefficients(params) == pytest.approx([0.4, -1.6], rel=1e-15)
    assert ta.base_scale(params) == 1.0
    linear = OPERATORS["linear"]
    weighted = [("a", {"weight": 0.5}), ("b", {"weight": 2.0})]
    assert linear.base_scale(resolve("linear", weighted)) == 1.0
    assert linear.base_scale(resolve("linear", weighted, {"normalize": False})) == 2.5
    assert OPERATORS["avg"].base_scale(resolve("avg", [("a", {}), ("b", {})])) == 1.0


# ------------------------------------------------------- thresholds, streaming


def _experts(op, *settings):
    return resolve(op, [(f"e{i}", s) for i, s in enumerate(settings)])


def test_needs_thresholds():
    ties, bc, dare = (OPERATORS[n] for n in ("ties", "breadcrumbs", "dare_linear"))
    (e,) = _experts("ties", {"density": 0.3}).experts
    assert ties.needs_thresholds(e) == (0.3,)
    (e,) = _experts("ties", {"density": 1.0}).experts
    assert ties.needs_thresholds(e) == ()
    (e,) = _experts("breadcrumbs", {"density": 0.5, "gamma": 0.01}).experts
    assert bc.needs_thresholds(e) == (0.01, 0.51)
    (e,) = _experts("breadcrumbs", {"density": 0.5, "gamma": 0.0}).experts
    assert bc.needs_thresholds(e) == (0.5,)
    (e,) = _experts("breadcrumbs", {"density": 0.8, "gamma": 0.3}).experts
    assert bc.needs_thresholds(e) == (min(0.3, 1 - 0.8),)
    (e,) = _experts("dare_linear", {"density": 0.3}).experts
    assert dare.needs_thresholds(e) == ()


@pytest.mark.parametrize(
    "op, settings, global_, available, streams",
    [
        ("ties", [{"density": 0.3}], {}, True, True),
        ("ties", [{"density": 0.3}], {}, False, False),  # the kernel needs the whole tensor
        ("ties", [{"density": 1.0}], {}, False, True),  # nothing to trim
        ("breadcrumbs", [{"density": 0.5}], {}, False, False),
        ("dare_linear", [{"density": 0.3}], {}, False, True),  # random drop: no thresholds
        ("dare_linear", [{"density": 0.3}], {"rescale": "l1"}, True, False),  # per-tensor norms
        ("della", [{"density": 0.3, "epsilon": 0.1}], {"rescale": "l1"}, True, False),
        ("della_linear", [{"density": 0.3, "epsilon": 0.1}], {}, False, True),
        ("task_arithmetic", [{}], {}, False, True),
        ("slerp", [{}], {}, True, False),
        ("model_stock", [{}, {}], {}, True, False),
        ("model_stock", [{}, {}], {"filter_wise": True}, True, False),
        ("nearswap", [{}], {"t": 0.001}, False, True),  # element-wise: no thresholds
        ("arcee_fusion", [{}], {}, True, False),  # whole-tensor quantiles
        ("sce", [{}, {}], {"select_topk": 1.0}, True, False),  # weights from whole tensors
        ("ram", [{}, {}], {}, False, True),  # element-wise
        ("ramplus_tl", [{}, {}], {}, True, False),  # per-tensor counts
    ],
)
def test_streams_with(op, settings, global_, available, streams):
    params = resolve(op, [(f"e{i}", s) for i, s in enumerate(settings)], global_)
    assert OPERATORS[op].streams_with(params, available) is streams
