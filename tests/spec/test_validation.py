"""Invalid merge specs fail with a ConfigError before any I/O
(mergepipe.spec.operators.validate_spec and OperatorDef.validate)."""

from __future__ import annotations

import sys

import pytest

from mergepipe.engine.operators.registry import KERNELS
from mergepipe.errors import ConfigError
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import ERROR_BOUNDS
from mergepipe.spec.operators import ALIASES, OPERATORS, get_operator, validate_spec
from tests.engine.operators.cases import spec_for


def spec(op, experts, params=None, seed=0):
    return MergeSpec(op, tuple(experts), params or {}, seed)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_every_registered_operator_validates_its_test_case(name):
    assert validate_spec(spec_for(name)) is OPERATORS[name]


@pytest.mark.parametrize("name", list(OPERATORS))
def test_registry_entries_are_consistent(name):
    definition = OPERATORS[name]
    assert definition.name == name
    assert definition.error_bound in ERROR_BOUNDS
    assert not definition.streaming or definition.error_bound != "none"
    assert definition.min_experts >= 1
    assert definition.max_experts is None or definition.max_experts >= definition.min_experts
    # the kernel's module documents the formula and the differences from mergekit
    module = sys.modules[KERNELS[name].__module__]
    assert module.__name__.startswith("mergepipe.engine.operators.")
    assert module.__name__.rsplit(".", 1)[1] not in ("context", "registry", "_combine", "_sparsify")
    assert "Intentional difference" in module.__doc__
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
