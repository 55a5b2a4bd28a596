"""Parameter settings: scalars, layer gradients, filter rules; MergeSpec JSON."""

from __future__ import annotations

import pytest

from mergepipe.engine.params import (
    ExpertSpec,
    MergeSpec,
    count_layers,
    gradient_position,
    layer_index,
    resolve,
    resolve_for_tensor,
)
from mergepipe.errors import ConfigError

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
    per_expert, _ = resolve_for_tensor(spec, Q.format(0), 0, 2)
    assert per_expert[0]["density"] == 0.7  # the expert's rule misses -> global
    per_expert, _ = resolve_for_tensor(spec, MLP.format(0), 0, 2)
    assert per_expert[0]["density"] == 0.3


@pytest.mark.parametrize("bad", [[], [0.1, "a"], [0.1, {"value": 1}], {"value": 1, "extra": 2}, {"filter": 3, "value": 1}, None, {"filter": "x"}])
def test_malformed_settings(bad):
    with pytest.raises(ConfigError):
        resolve(bad, "x", None, 2)


def test_gradient_position():
    assert gradient_position(None, 10) == 0.0
    assert gradient_position(0, 1) == 1.0
    assert gradient_position(3, 7) == 0.5
    with pytest.raises(ValueError):
        gradient_position(7, 7)


def test_resolve_for_tensor_fills_defaults_per_operator():
    spec = MergeSpec("ties", (("a", {"density": 0.5}), ("b", {"weight": 2})), {})
    per_expert, global_ = resolve_for_tensor(spec, Q.format(0), 0, 2)
    assert per_expert == [{"weight": 1.0, "density": 0.5}, {"weight": 2.0, "density": 1.0}]
    assert global_ == {"lambda": 1.0, "normalize": True}
    spec = MergeSpec("dare", (("a", {}),), {"rescale": "L1"})
    per_expert, global_ = resolve_for_tensor(spec, Q.format(0), 0, 2)
    assert global_ == {"lambda": 1.0, "normalize": False, "rescale": "l1"}
    _, global_ = resolve_for_tensor(MergeSpec("slerp", (("a", {}),), {}), "x", None, 0)
    assert global_ == {"t": 0.5}
    _, global_ = resolve_for_tensor(MergeSpec("della", (("a", {}),), {}), "x", None, 0)
    assert global_["normalize"] is True and global_["rescale"] == "inverse"


def test_expert_setting_beats_global_setting():
    spec = MergeSpec("ties", (("a", {"density": 0.2}), ("b", {})), {"density": 0.6, "weight": [1.0, 3.0]})
    per_expert, _ = resolve_for_tensor(spec, Q.format(1), 1, 3)
    assert per_expert == [{"weight": 2.0, "density": 0.2}, {"weight": 2.0, "density": 0.6}]


def test_spec_json_round_trip_and_canonical_bytes():
    spec = MergeSpec(
        "ties",
        (ExpertSpec("math", {"density": [0.2, 0.5], "weight": 1}), ExpertSpec("code", {"density": [{"filter": "mlp", "value": 0.3}, {"value": 0.5}]})),
        {"lambda": 0.9, "normalize": True},
        seed=42,
    )
    text = spec.to_json()
    assert MergeSpec.from_json(text) == spec
    assert MergeSpec.from_json(text).to_json() == text
    assert " " not in text and text.index('"experts"') < text.index('"operator"')


@pytest.mark.parametrize(
    "text",
    ["[]", "{}", '{"operator": "ties"}', '{"operator": "ties", "experts": [{"id": "a"}]}',
     '{"operator": "ties", "experts": [], "seed": -1}', '{"operator": "ties", "experts": [], "extra": 1}', "not json"],
)
def test_bad_spec_json(text):
    with pytest.raises(ConfigError):
        MergeSpec.from_json(text)




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
