"""The setting language (mergepipe.spec.settings): scalars, layer gradients,
filter rules, and where a tensor sits on a gradient.

How an operator's definition turns settings into typed values per tensor
(precedence, defaults, coercion) is tests/spec/test_operator_defs.py; the
MergeSpec JSON is tests/spec/test_merge_spec.py.
"""

from __future__ import annotations

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.settings import (
    count_layers,
    gradient_position,
    layer_index,
    resolve,
    setting_leaves,
)

Q = "model.layers.{}.self_attn.q_proj.weight"
MLP = "model.layers.{}.mlp.down_proj.weight"


@pytest.mark.parametrize(
    "name, index",
    [
        ("model.layers.12.mlp.up_proj.weight", 12),
        ("model.embed_tokens.weight", None),
        ("lm_head.weight", None),
        ("model.norm.weight", None),
        ("transformer.h.3.attn.c_attn.weight", 3),
        ("gpt_neox.layers.0.attention.dense.weight", 0),
        ("encoder.layer.5.output.dense.bias", 5),
        ("model.layers_norm.weight", None),
        ("blocks.7.attn.weight", 7),
    ],
)
def test_layer_index(name, index):
    assert layer_index(name) == index


def test_count_layers():
    assert count_layers([Q.format(0), MLP.format(3), "lm_head.weight"]) == 4
    assert count_layers(["lm_head.weight"]) == 0


def test_scalar():
    assert resolve(0.5, Q.format(0), 0, 4) == 0.5
    assert resolve(True, "x", None, 4) is True
    assert resolve("l1", "x", None, 4) == "l1"


def test_gradient_interpolates_over_layers():
    g = [0.0, 1.0]
    assert [resolve(g, Q.format(i), i, 5) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    g3 = [0.0, 1.0, 0.0]
    assert [resolve(g3, Q.format(i), i, 5) for i in range(5)] == [0.0, 0.5, 1.0, 0.5, 0.0]


def test_gradient_outside_layers_takes_the_first_value_and_one_layer_the_last():
    assert resolve([0.2, 0.8], "model.embed_tokens.weight", None, 4) == 0.2
    assert resolve([0.2, 0.8], "lm_head.weight", None, 4) == 0.2
    assert resolve([0.2, 0.8], Q.format(0), 0, 1) == 0.8


def test_gradient_of_booleans_and_strings_picks():
    assert [resolve([True, False], Q.format(i), i, 4) for i in range(4)] == [True, True, True, False]
    assert resolve(["none", "l1"], Q.format(3), 3, 4) == "l1"


def test_filter_rules_first_match_wins_and_default():
    rules = [{"filter": "self_attn", "value": 0.1}, {"filter": "mlp", "value": [0.2, 0.4]}, {"value": 0.9}]
    assert resolve(rules, Q.format(1), 1, 3) == 0.1
    assert resolve(rules, MLP.format(1), 1, 3) == pytest.approx(0.3)
    assert resolve(rules, "lm_head.weight", None, 3) == 0.9
    assert resolve([{"filter": "*", "value": 2}], "x", None, 0) == 2
    assert resolve({"filter": "mlp", "value": 1}, MLP.format(0), 0, 1) == 1


def test_no_matching_rule_is_none_and_falls_back_to_the_default():
    assert resolve([{"filter": "mlp", "value": 0.3}], Q.format(0), 0, 2) is None
    spec = MergeSpec("ties", (("a", {"density": [{"filter": "mlp", "value": 0.3}]}),), {"density": 0.7})
    ties = OPERATORS["ties"]
    assert ties.resolve(spec, Q.format(0), 2).experts[0].density == 0.7  # the expert's rule misses -> global
    assert ties.resolve(spec, MLP.format(0), 2).experts[0].density == 0.3


@pytest.mark.parametrize("bad", [[], [0.1, "a"], [0.1, {"value": 1}], {"value": 1, "extra": 2}, {"filter": 3, "value": 1}, None, {"filter": "x"}])
def test_malformed_settings(bad):
    with pytest.raises(ConfigError):
        resolve(bad, "x", None, 2)
    with pytest.raises(ConfigError):
        setting_leaves(bad)


@pytest.mark.parametrize(
    "setting, leaves",
    [
        (0.5, [0.5]),
        ([0.1, 0.9, 0.3], [0.1, 0.9, 0.3]),
        ([{"filter": "mlp", "value": [0.2, 0.6]}, {"value": 0.5}], [0.2, 0.6, 0.5]),
        ({"filter": "x", "value": True}, [True]),
    ],
)
def test_setting_leaves_are_every_value_a_setting_can_reach_the_ends_of(setting, leaves):
    """Range checks run on the leaves: they must include every rule's values."""
    assert setting_leaves(setting) == leaves


def test_rules_nested_in_rules_are_refused():
    with pytest.raises(ConfigError, match="not more rules"):
        setting_leaves([{"filter": "mlp", "value": [{"value": 0.3}]}])


def test_gradient_position():
    assert gradient_position(None, 10) == 0.0
    assert gradient_position(0, 1) == 1.0
    assert gradient_position(3, 7) == 0.5
    with pytest.raises(ValueError):
        gradient_position(7, 7)


@pytest.mark.mergekit
@pytest.mark.parametrize(
    "setting",
    [0.3, [0.1, 0.9], [0.0, 1.0, 0.2, 0.7], [{"filter": "mlp", "value": [0.2, 0.6]}, {"value": 0.5}],
     [{"filter": "self_attn", "value": 0.1}, {"filter": "*", "value": [1.0, 0.0]}]],
)
def test_resolution_matches_mergekit(setting):
    """Same value as mergekit's evaluate_setting, on every tensor of a 5-layer model."""
    config = pytest.importorskip("mergekit.config")
    from pydantic import TypeAdapter

    adapter = TypeAdapter(config.ParameterSetting)
    parsed = adapter.validate_python(setting)
    names = [f.format(i) for i in range(5) for f in (Q, MLP)] + ["model.embed_tokens.weight", "lm_head.weight"]
    for name in names:
        idx = layer_index(name)
        t = gradient_position(idx, 5)
        want = config.evaluate_setting(name, parsed, t, validate=float)
        assert resolve(setting, name, idx, 5) == want, name
