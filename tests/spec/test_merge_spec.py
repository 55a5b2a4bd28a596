"""MergeSpec (mergepipe.spec.operators): settings kept as written, canonical
JSON for hashing, and a reader that names what is malformed."""

from __future__ import annotations

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.operators import ExpertSpec, MergeSpec


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
    with pytest.raises(ConfigError):
        MergeSpec.from_json(text)
