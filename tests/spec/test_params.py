"""The parameter catalogue (mergepipe.spec.operators): one declaration per
parameter gives the attribute the kernels read, the scope validation
enforces, the range coercion checks and the CLI's help text."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.operators import PARAMS, SCOPES, NoParams, ParamSet, param

PARAM_SETS = sorted(
    {cls for d in OPERATORS.values() for cls in (d.expert_params, d.global_params)}, key=lambda c: c.__name__
)


def test_the_catalogue_is_keyed_by_name_and_scoped():
    # the first operators' parameters, then those each later method adds (their tests check them)
    assert list(PARAMS)[:8] == ["weight", "density", "gamma", "epsilon", "lambda", "normalize", "rescale", "t"]
    assert all(name == d.name and d.scope in SCOPES for name, d in PARAMS.items())
    assert {n for n, d in PARAMS.items() if d.scope == "expert"} == {"weight", "density", "gamma", "epsilon"}


def test_attribute_is_the_name_except_for_python_keywords():
    assert {n: d.attribute for n, d in PARAMS.items() if d.attribute != n} == {"lambda": "lambda_"}


@pytest.mark.parametrize("cls", PARAM_SETS, ids=lambda c: c.__name__)
def test_every_field_is_named_after_its_definition(cls):
    """Kernels read ``params.lambda_``; validation and to_dict() use ``lambda``:
    the field name must be the definition's attribute, or one side misses it."""
    assert issubclass(cls, ParamSet) and dataclasses.is_dataclass(cls)
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields] == [d.attribute for d in cls.definitions()]
    for f in fields:
        assert f.default == f.metadata["mergepipe.param"].default  # field default from its definition


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
    got = PARAMS[name].coerce(value)
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
        PARAMS[name].coerce(value)


@pytest.mark.parametrize(
    "name, text",
    [("weight", ""), ("lambda", ""), ("density", "in (0, 1]"), ("gamma", "in [0, 1)"), ("epsilon", "in [0, 0.5)"),
     ("t", "in [0, 1]"), ("rescale", "one of inverse, l1, none"), ("normalize", "")],
)
def test_range_text_and_help(name, text):
    definition = PARAMS[name]
    assert definition.range_text == text
    assert definition.help() == definition.doc + (f" ({text})" if text else "") + "."


def test_param_overrides_a_default_only_with_a_valid_value():
    @dataclasses.dataclass(frozen=True)
    class Own(ParamSet):
        normalize: bool = param("normalize", False)
        density: float = param("density", 0.25)

    assert Own() == Own(normalize=False, density=0.25)
    assert [d.default for d in Own.definitions()] == [False, 0.25]
    assert PARAMS["normalize"].default is True  # the catalogue is untouched
    with pytest.raises(ConfigError, match="density"):
        param("density", 0.0)


def test_build_and_to_dict_use_user_names():
    scaled = OPERATORS["task_arithmetic"].global_params
    built = scaled.build({"lambda": 0.5})
    assert built.lambda_ == 0.5 and built.normalize is False
    assert built.to_dict() == {"lambda": 0.5, "normalize": False}
    assert scaled.build(built.to_dict()) == built


def test_no_params():
    assert NoParams.names() == () and NoParams().to_dict() == {} and NoParams.build({}) == NoParams()
