"""Operator definitions (mergepipe.spec.operators): the registry, parameters (ParamDef, typed Params), the
MergeSpec, validation before any I/O, per-tensor resolution of settings into typed params, the
error-bound multipliers (beta) the planner budgets with, and the threshold/streaming decisions."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.canonical import canonical_json
from mergepipe.spec.operators import (
    ALIASES,
    FLAGS,
    OPERATORS,
    ExpertSpec,
    MergeSpec,
    OperatorDef,
    get_operator,
    validate_spec,
)
from mergepipe.spec.operators.base import ERROR_BOUNDS, NoParams, Params, TensorParams
from tests.spec.operators.table import TABLE, spec_for

Q = "model.layers.{}.self_attn.q_proj.weight"
MLP = "model.layers.{}.mlp.down_proj.weight"
Q0 = Q.format(0)


def resolve(op, experts, params=None, tensor=Q0, num_layers=2) -> TensorParams:
    """Typed params of a spec written as ``[(id, settings), ...]`` for one tensor."""
    return get_operator(op).resolve(MergeSpec(op, tuple(experts), params or {}), tensor, num_layers)


def beta(op, experts, params=None) -> list[float]:
    return get_operator(op).beta(resolve(op, experts, params))


def test_every_definition_has_a_kernel():
    assert all(type(d).kernel is not OperatorDef.kernel and d.name == name for name, d in OPERATORS.items())


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
    (op, [(f"e{i}", settings) for i, settings in enumerate(experts)], params, expected)
    for op, row in TABLE.items()
    for experts, params, expected in row.beta
]


@pytest.mark.parametrize("op, experts, params, expected", BETA_CASES)
def test_beta(op, experts, params, expected):
    """Hand-computed multipliers: the planner's error bound is only as sound as these."""
    assert beta(op, experts, params) == pytest.approx(expected, rel=1e-12)


def test_every_operator_has_a_row_and_a_beta_case():
    assert set(TABLE) == set(OPERATORS) and {case[0] for case in BETA_CASES} == set(OPERATORS)


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


# ----------------------------------------------------------------- parameters

DEFINITIONS = [d for op in OPERATORS.values() for d in (*op.expert_params.definitions(), *op.global_params.definitions())]
PARAM = {"weight": OPERATORS["ties"].expert_params.definitions()[0], **{d.name: d for d in FLAGS}}
PARAM_SETS = sorted({cls for d in OPERATORS.values() for cls in (d.expert_params, d.global_params)}, key=str)


def test_the_flags_and_scopes():
    """The parameters with a flag of their own (--density ...), and which ones are set per expert."""
    assert [d.name for d in FLAGS] == ["density", "gamma", "lambda", "normalize", "rescale", "epsilon", "t"]
    assert all(d.scope in ("expert", "global") for d in DEFINITIONS)
    assert {d.name for d in DEFINITIONS if d.scope == "expert"} == {"weight", "density", "gamma", "epsilon"}


def test_attribute_is_the_name_except_for_python_keywords():
    assert {d.name: d.attribute for d in DEFINITIONS if d.attribute != d.name} == {"lambda": "lambda_"}


@pytest.mark.parametrize("cls", PARAM_SETS, ids=lambda c: c.__name__)
def test_every_field_is_named_after_its_definition_with_a_valid_default(cls):
    """Kernels read ``params.lambda_``; validation and to_dict() use ``lambda``: the field must be the
    definition's attribute and its alias the name, or one side misses it; a default passes its own check."""
    assert issubclass(cls, Params)
    fields = cls.model_fields
    assert list(fields) == [d.attribute for d in cls.definitions()]
    assert [f.alias for f in fields.values()] == list(cls.names())
    for f, d in zip(fields.values(), cls.definitions()):
        assert d.coerce(f.default) == f.default and type(d.coerce(f.default)) is type(f.default)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_parameter_classes_hold_only_their_scope(name):
    definition = OPERATORS[name]
    assert {d.scope for d in definition.expert_params.definitions()} <= {"expert"}
    assert {d.scope for d in definition.global_params.definitions()} <= {"global"}
    # one name is never both per-expert and global
    assert not set(definition.expert_params.names()) & set(definition.global_params.names())


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("density", 1, 1.0), ("density", 1e-9, 1e-9), ("density", 0.5, 0.5),
        ("gamma", 0, 0.0), ("gamma", 0.999, 0.999),
        ("epsilon", 0.0, 0.0), ("epsilon", 0.4999, 0.4999),
        ("t", 0, 0.0), ("t", 1, 1.0),
        ("weight", -3, -3.0), ("lambda", 1e6, 1e6),
        ("rescale", "L1", "l1"), ("rescale", "Inverse", "inverse"), ("rescale", "none", "none"),
        ("normalize", False, False), ("normalize", True, True),
    ],
)
def test_coerce_accepts_the_range_and_normalises(name, value, expected):
    got = PARAM[name].coerce(value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("density", 0.0, r"density must be in \(0, 1\], got 0.0"),
        ("density", -0.1, r"density must be in \(0, 1\]"),
        ("density", 1.0000001, r"density must be in \(0, 1\]"),
        ("gamma", 1.0, r"gamma must be in \[0, 1\), got 1.0"),
        ("gamma", -1e-9, r"gamma must be in \[0, 1\)"),
        ("epsilon", 0.5, r"epsilon must be in \[0, 0.5\), got 0.5"),
        ("epsilon", -0.01, r"epsilon must be in \[0, 0.5\)"),
        ("t", -0.01, r"t must be in \[0, 1\]"),
        ("t", 1.01, r"t must be in \[0, 1\], got 1.01"),
        ("rescale", "l2", r"rescale must be one of inverse, l1, none, got 'l2'"),
        ("rescale", True, r"mergekit's rescale: true means 'l1'"),
        ("rescale", 1, r"rescale must be one of inverse, l1, none"),
        ("normalize", "yes", r"normalize must be true or false, got 'yes'"),
        ("normalize", 1, r"normalize must be true or false"),
        ("weight", True, r"weight must be a finite number"),
        ("weight", "1", r"weight must be a finite number"),
        ("weight", math.nan, r"weight must be a finite number"),
        ("lambda", math.inf, r"lambda must be a finite number"),
        ("density", None, r"density must be a finite number"),
    ],
)
def test_coerce_refuses_naming_the_range(name, value, message):
    with pytest.raises(ConfigError, match=message):
        PARAM[name].coerce(value)


@pytest.mark.parametrize(
    "name, text",
    [("weight", ""), ("lambda", ""), ("density", "in (0, 1]"), ("gamma", "in [0, 1)"), ("epsilon", "in [0, 0.5)"),
     ("t", "in [0, 1]"), ("rescale", "one of inverse, l1, none"), ("normalize", "")],
)
def test_range_text_and_help(name, text):
    definition = PARAM[name]
    assert definition.range_text == text
    assert definition.help() == definition.doc + (f" ({text})" if text else "") + "."


def test_typed_params_validate_user_names_with_the_definitions():
    scaled = OPERATORS["task_arithmetic"].global_params
    built = scaled.model_validate({"lambda": 0.5})
    assert built.lambda_ == 0.5 and built.normalize is False
    assert built.to_dict() == {"lambda": 0.5, "normalize": False}
    assert scaled.model_validate(built.to_dict()) == built
    with pytest.raises(ConfigError, match=r"normalize must be true or false"):
        scaled.model_validate({"normalize": "yes"})
    assert NoParams.names() == () and NoParams().to_dict() == {} and NoParams.model_validate({}) == NoParams()


# ----------------------------------------------------------------- validation


def spec(op, experts, params=None, seed=0):
    return MergeSpec(op, tuple(experts), params or {}, seed)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_every_registered_operator_validates_its_test_case(name):
    assert validate_spec(spec_for(name)) is OPERATORS[name]


MERGEKIT_DOC = (Path(__file__).parents[3] / "docs" / "MERGEKIT.md").read_text()


@pytest.mark.parametrize("name", list(OPERATORS))
def test_registry_entries_are_consistent(name):
    definition = OPERATORS[name]
    assert definition.name == name and definition.summary
    assert definition.error_bound in ERROR_BOUNDS
    assert not definition.streaming or definition.error_bound != "none"
    assert definition.min_experts >= 1
    assert definition.max_experts is None or definition.max_experts >= definition.min_experts
    # the method's module documents its formula; docs/MERGEKIT.md its differences from mergekit
    module = sys.modules[type(definition).__module__]
    assert module.__name__.rsplit(".", 1)[1] not in ("base", "kernels")
    docs = (c.__doc__ for c in type(definition).__mro__ if c.__module__ == module.__name__ and c.__doc__)
    assert "out" in next(docs, module.__doc__)  # the formula (out = ...) on its class or the one it extends
    assert not definition.mergekit or f"`{name}`" in MERGEKIT_DOC.split("## Intentional numeric differences")[1]
    # the defaults are instances of the declared parameter classes
    assert set(definition.expert_params().to_dict()) == set(definition.expert_params.names())
    assert set(definition.global_params().to_dict()) == set(definition.global_params.names())


@pytest.mark.parametrize(
    "given, canonical",
    [("AVG", "avg"), ("TIES", "ties"), ("DARE", "dare_linear"), ("dare", "dare_linear"), ("Dare-Ties", "dare_ties"),
     ("Task_Arithmetic", "task_arithmetic"), ("MODEL_STOCK", "model_stock"), ("slerp", "slerp")],
)
def test_names_are_case_insensitive_with_aliases(given, canonical):
    assert get_operator(given) is OPERATORS[canonical]


def test_unknown_operator_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        get_operator("frankenmerge")
    for name in [*OPERATORS, *ALIASES]:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "op, experts, params, match",
    [
        ("ties", [("a", {"density": 0.0})], {}, r"density must be in \(0, 1\]"),
        ("ties", [("a", {"density": 1.5})], {}, r"density must be in \(0, 1\]"),
        ("ties", [("a", {"density": [0.5, 1.2]})], {}, r"density must be in"),
        ("ties", [("a", {"density": [{"filter": "mlp", "value": -0.1}, {"value": 0.5}]})], {}, r"density"),
        ("ties", [("a", {"weight": -1.0})], {}, r"weight must be >= 0"),
        ("dare_ties", [("a", {"weight": -1.0})], {}, r"weight must be >= 0"),
        ("linear", [("a", {"weight": -1.0})], {}, r"weight must be >= 0"),
        ("ties", [("a", {"densty": 0.5})], {}, r"does not take parameter 'densty'"),
        ("ties", [("a", {})], {"rescale": "l1"}, r"does not take parameter 'rescale'"),
        ("ties", [("a", {})], {"int8_mask": True}, r"int8_mask"),
        ("ties", [("a", {"lambda": 2.0})], {}, r"global parameter"),
        ("avg", [("a", {"weight": 2.0})], {}, r"avg does not take parameter 'weight'"),
        ("dare_linear", [("a", {})], {"rescale": True}, r"mergekit's rescale: true means 'l1'"),
        ("dare_linear", [("a", {})], {"rescale": "l2"}, r"rescale must be one of"),
        ("ties", [("a", {})], {"normalize": "yes"}, r"normalize must be true or false"),
        ("ties", [("a", {"weight": "1"})], {}, r"weight must be a finite number"),
        ("ties", [("a", {"weight": float("nan")})], {}, r"finite"),
        ("slerp", [("a", {}), ("b", {})], {}, r"exactly 1 expert"),
        ("slerp", [("a", {})], {"t": 1.5}, r"t must be in \[0, 1\]"),
        ("model_stock", [("a", {})], {}, r"at least 2 experts"),
        ("model_stock", [("a", {}), ("b", {})], {"filter_wise": 1}, r"filter_wise must be true or false"),
        ("model_stock", [("a", {"filter_wise": True}), ("b", {})], {}, r"'filter_wise' is a global parameter"),
        ("nearswap", [("a", {})], {}, r"nearswap needs t, the distance"),
        ("nearswap", [("a", {})], {"t": -0.001}, r"t must be in \[0, inf\]"),
        ("nearswap", [("a", {}), ("b", {})], {"t": 0.001}, r"nearswap needs exactly 1 expert, got 2"),
        ("nearswap", [("a", {"weight": 1.0})], {"t": 0.001}, r"nearswap does not take parameter 'weight'"),
        ("arcee_fusion", [("a", {}), ("b", {})], {}, r"arcee_fusion needs exactly 1 expert, got 2"),
        ("arcee_fusion", [("a", {})], {"t": 0.5}, r"arcee_fusion does not take parameter 't'.*no parameters"),
        ("della", [("a", {"density": 0.1, "epsilon": 0.15})], {}, r"density 0.1 \+- epsilon 0.15"),
        ("della_linear", [("a", {"density": 0.9, "epsilon": 0.1})], {}, r"\+- epsilon"),
        ("della", [("a", {"epsilon": 0.7})], {}, r"epsilon must be in \[0, 0.5\)"),
        ("breadcrumbs", [("a", {"gamma": 1.0})], {}, r"gamma must be in \[0, 1\)"),
        ("linear", [("a", {"weight": 0.0}), ("b", {"weight": 0.0})], {}, r"sum to 0"),
        ("task_arithmetic", [("a", {"weight": 1.0}), ("b", {"weight": -1.0})], {"normalize": True}, r"sum to 0"),
        ("ties", [("a", {}), ("a", {})], {}, r"listed twice"),
        ("ties", [], {}, r"at least 1 expert"),
        ("ties", [("a", {"density": []})], {}, r"must not be empty"),
        ("ties", [("a", {"density": [0.5, {"value": 1}]})], {}, r"all scalars"),
        ("ties", [("a", {"density": [{"filtr": "x", "value": 0.5}]})], {}, r"filter: SUBSTRING"),
    ],
)
def test_invalid_specs_are_config_errors(op, experts, params, match):
    with pytest.raises(ConfigError, match=match):
        validate_spec(spec(op, experts, params))


def test_combination_checks_per_tensor_with_filters():
    """A density rule that only bites on some tensors is caught when the
    tensor names are given (as the engine does before reading)."""
    s = spec("della", [("a", {"density": [{"filter": "mlp", "value": 0.1}, {"value": 0.5}], "epsilon": 0.15})])
    validate_spec(s)  # cannot know without tensor names
    validate_spec(s, ["model.layers.0.self_attn.q_proj.weight"], 1)
    with pytest.raises(ConfigError, match="model.layers.0.mlp.up_proj.weight"):
        validate_spec(s, ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"], 1)


def test_weights_summing_to_zero_on_one_tensor_only():
    s = spec("linear", [("a", {"weight": [{"filter": "embed", "value": 0.0}, {"value": 1.0}]}), ("b", {"weight": [{"filter": "embed", "value": 0.0}, {"value": 1.0}]})])
    validate_spec(s, ["model.layers.0.mlp.up_proj.weight"], 1)
    with pytest.raises(ConfigError, match="embed_tokens"):
        validate_spec(s, ["model.embed_tokens.weight"], 1)


@pytest.mark.parametrize(("experts", "params", "where"), [
    # density 0.2 - epsilon 0.3 < 0 at the gradient's end: the last layer, which every model has
    ([("a", {"density": 0.2, "epsilon": [0.1, 0.3]})], {}, "the last layer"),
    ([("a", {"density": [0.1, 0.5], "epsilon": 0.15})], {}, r"the first layer \(and the tensors outside"),
    # linear: both weights 0 at the first layer
    ([("a", {"weight": [0.0, 1.0]}), ("b", {"weight": [0.0, 2.0]})], {}, "the first layer"),
])
def test_gradient_ends_are_checked_without_tensor_names(experts, params, where):
    """Before any I/O, a setting invalid at either end of a layer gradient is refused: every model with
    layers reaches t = 0 (outside the layers, the first layer) and t = 1 (the last layer)."""
    op = "linear" if "weight" in experts[0][1] else "della"
    with pytest.raises(ConfigError, match=where):
        validate_spec(spec(op, experts, params))


def test_inner_gradient_points_wait_for_the_layer_count():
    # invalid only at the middle entry: the layer count decides whether a layer sits there
    s = spec("della", [("a", {"density": 0.2, "epsilon": [0.1, 0.3, 0.1]})])
    validate_spec(s)
    validate_spec(s, ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"], 2)
    with pytest.raises(ConfigError, match="model.layers.1.mlp"):
        validate_spec(s, [f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)], 3)


@pytest.mark.parametrize("normalize", [True, False])
def test_linear_base_weight_counts_the_base_among_the_averaged_models(normalize):
    """mergekit's Σ wi Mi (/ Σw) with M0 = B: base scale and coefficients in float64, by hand."""
    definition = get_operator("linear")
    s = spec("linear", [("a", {"weight": [1.0, 3.0]}), ("b", {"weight": 0.5})],
             {"base_weight": [{"filter": "mlp", "value": 2.0}, {"value": [0.0, 4.0]}], "normalize": normalize})
    for name, layers, (wa, wb, w0) in [("model.layers.1.mlp.up_proj.weight", 2, (3.0, 0.5, 2.0)),
                                       ("model.layers.1.self_attn.q_proj.weight", 2, (3.0, 0.5, 4.0)),
                                       ("model.embed_tokens.weight", 2, (1.0, 0.5, 0.0))]:
        params = definition.resolve(s, name, layers)
        total = wa + wb + w0
        if normalize:
            assert definition.coefficients(params, name) == [wa / total, wb / total]
            assert definition.base_scale(params) == 1.0
        else:
            assert definition.coefficients(params, name) == [wa, wb]
            assert definition.base_scale(params) == total
    with pytest.raises(ConfigError, match=r"base_weight must be in \[0, inf\]"):
        validate_spec(spec("linear", [("a", {})], {"base_weight": -1.0}))


# ------------------------------------------------------------------ MergeSpec


def test_spec_json_round_trip_and_canonical_bytes():
    spec = MergeSpec(
        "ties",
        (ExpertSpec("math", {"density": [0.2, 0.5], "weight": 1}), ExpertSpec("code", {"density": [{"filter": "mlp", "value": 0.3}, {"value": 0.5}]})),
        {"lambda": 0.9, "normalize": True},
        seed=42,
    )
    text = canonical_json(spec.to_dict())
    assert MergeSpec.from_dict(json.loads(text)) == spec
    assert canonical_json(MergeSpec.from_dict(json.loads(text)).to_dict()) == text
    assert b" " not in text and text.index(b'"experts"') < text.index(b'"operator"')


def test_experts_given_as_pairs_become_expert_specs():
    spec = MergeSpec("ties", (("a", {"density": 0.5}), ("b",)), {})
    assert spec.experts == (ExpertSpec("a", {"density": 0.5}), ExpertSpec("b", {}))
    assert spec.expert_ids == ("a", "b")


@pytest.mark.parametrize(
    "experts, params, expected",
    [
        ((("a", {"weight": 0.4}),), {"weight": 2.0}, 0.4),  # the expert's own
        ((("a", {}),), {"weight": 2}, 2.0),  # else the global one
        ((("a", {}),), {}, 1.0),  # else 1.0
        ((("a", {"weight": [0.1, 0.9]}),), {}, 1.0),  # varies by tensor: recorded in full elsewhere
    ],
)
def test_scalar_weight(experts, params, expected):
    assert MergeSpec("task_arithmetic", experts, params).scalar_weight("a") == expected


def test_unknown_expert_is_a_key_error_naming_it():
    with pytest.raises(KeyError, match="nope"):
        MergeSpec("ties", (("a", {}),)).expert("nope")


@pytest.mark.parametrize(
    "text",
    ["[]", "{}", '{"operator": "ties"}', '{"operator": "ties", "experts": [{"id": "a"}]}',
     '{"operator": "ties", "experts": [], "seed": -1}', '{"operator": "ties", "experts": [], "extra": 1}', "not json",
     '{"operator": "ties", "experts": [], "seed": true}', '{"operator": "ties", "experts": [], "params": []}',
     '{"operator": "ties", "experts": [{"expert_id": "a", "params": 3}]}'],
)
def test_bad_spec_json(text):
    with pytest.raises((ConfigError, json.JSONDecodeError)):
        MergeSpec.from_dict(json.loads(text))
