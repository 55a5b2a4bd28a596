"""nuslerp, multislerp and karcher: mergekit's configs as MergePipe reads them, and their parameters' checks.

mergekit runs nuslerp and multislerp on the task vectors of the models from a ``base_model``, or without one
on the models themselves; MergePipe's base is then the first model, one of the interpolated points
(``task_vectors: false``, its weight ``base_weight``). karcher always averages every model, the base among
them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.mergekit import load_config
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import OPERATORS, validate_spec


def _load(text: str) -> SimpleNamespace:
    fields = {"params": {}, "expert_params": {}, "notes": (), **load_config(text, "merge.yml").fields}
    return SimpleNamespace(**fields)


def _refused(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(text, "merge.yml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("merge.yml: ")
    return message


# ------------------------------------------------------------------ mapping


@pytest.mark.parametrize("listed", [False, True], ids=["base apart", "base listed"])
def test_nuslerp_with_a_base_model_interpolates_the_two_task_vectors(listed):
    request = _load(f"""
merge_method: nuslerp
base_model: b
models:
{"  - model: b" if listed else ""}
  - {{model: e1, parameters: {{weight: [0.2, 0.8]}}}}
  - {{model: e2, parameters: {{weight: 0.5}}}}
parameters: {{nuslerp_flatten: false, nuslerp_row_wise: true}}
""")
    assert (request.base, request.experts, request.operator) == ("b", ("e1", "e2"), "nuslerp")
    assert request.params == {"nuslerp_flatten": False, "nuslerp_row_wise": True}  # task vectors: the default
    assert request.expert_params == {"e1": {"weight": [0.2, 0.8]}, "e2": {"weight": 0.5}}
    assert any("skipped there" in n for n in request.notes) == listed


@pytest.mark.parametrize("method", ["nuslerp", "multislerp"])
def test_without_a_base_model_the_first_model_is_the_base_with_its_weight(method):
    request = _load(f"""
merge_method: {method}
models:
  - {{model: m1, parameters: {{weight: [{{filter: mlp, value: 0.3}}, {{value: 0.6}}]}}}}
  - {{model: m2, parameters: {{weight: 0.5}}}}
""")
    assert (request.base, request.experts) == ("m1", ("m2",))
    assert request.params == {"task_vectors": False, "base_weight": [{"filter": "mlp", "value": 0.3}, {"value": 0.6}]}
    assert request.expert_params == {"m2": {"weight": 0.5}}
    assert [n for n in request.notes if "first model" in n] == [
        f"{method} without base_model: the first model, 'm1', is MergePipe's base, one of the interpolated models "
        "with its weight (base_weight, task_vectors: false)"]


def test_the_first_models_weight_falls_back_to_the_global_one():
    request = _load("merge_method: multislerp\nmodels: [{model: m1}, {model: m2}, {model: m3}]\n"
                    "parameters: {weight: 0.4, normalize_weights: false}")
    assert (request.base, request.experts) == ("m1", ("m2", "m3"))
    assert request.params == {"weight": 0.4, "normalize_weights": False, "task_vectors": False, "base_weight": 0.4}
    bare = _load("merge_method: multislerp\nmodels: [{model: m1}, {model: m2}]")
    assert bare.params == {"task_vectors": False}  # base_weight's default is weight's, 1


@pytest.mark.parametrize("base", [None, "b", "m1"], ids=["no base", "base apart", "base listed"])
def test_karcher_averages_every_model_the_base_among_them(base):
    request = _load(("" if base is None else f"base_model: {base}\n") + """merge_method: karcher
models:
  - {model: m1, parameters: {weight: 0.3}}
  - {model: m2, parameters: {weight: 0.7}}
parameters: {max_iter: 5, tol: 1.0e-6}
""")
    assert request.base == (base or "m1")
    assert request.experts == (("m1", "m2") if base == "b" else ("m2",))
    assert request.params == {"max_iter": 5, "tol": 1e-6} and request.expert_params == {}
    assert "weight ignored: karcher takes no weight (mergekit ignores it too, so the result is the same)" in \
        request.notes


@pytest.mark.parametrize("text, needle", [
    ("merge_method: nuslerp\nbase_model: b\nmodels: [{model: e1}]",
     "nuslerp with a base_model interpolates the task vectors of exactly two other models, got 1"),
    ("merge_method: nuslerp\nbase_model: b\nmodels: [{model: b}, {model: e1}, {model: e2}, {model: e3}]",
     "exactly two other models, got 3"),
    ("merge_method: nuslerp\nmodels: [{model: m1}, {model: m2}, {model: m3}]",
     "nuslerp without base_model interpolates exactly two models, got 3"),
    ("merge_method: multislerp\nmodels: [{model: m1}]", "multislerp merges two models or more"),
    ("merge_method: karcher\nbase_model: m1\nmodels: [{model: m1}]", "karcher merges two models or more"),
    ("merge_method: multislerp\nmodels: [{model: m1, parameters: {density: 0.5}}, {model: m2}]",
     "multislerp does not take parameter 'density' (the first model, 'm1'); a model takes: weight"),
    ("merge_method: karcher\nmodels: [{model: m1, parameters: {t: 0.5}}, {model: m2}]",
     "karcher does not take parameter 't' (model 'm1'); it takes: max_iter, tol"),
    ("merge_method: nuslerp\nmodels: [{model: m1}, {model: m2}]\nparameters: {base_weight: 2}",
     "leave out task_vectors and base_weight"),
])
def test_configs_mergekit_refuses_or_that_do_not_merge_are_refused_in_one_line(text, needle):
    assert needle in _refused(text)


# --------------------------------------------------------------- validation


def _spec(op: str, experts: list[tuple[str, dict]], params: dict) -> MergeSpec:
    return MergeSpec(op, tuple(experts), params, 0)


@pytest.mark.parametrize("op, experts, params, needle", [
    ("nuslerp", [("a", {})], {}, r"nuslerp with task_vectors: true interpolates the task vectors of two experts, "
                                 r"got 1 expert for every tensor"),
    ("nuslerp", [("a", {}), ("b", {})], {"task_vectors": False},
     r"task_vectors: false interpolates the base and one expert, got 2 experts"),
    ("nuslerp", [("a", {}), ("b", {}), ("c", {})], {}, r"nuslerp needs two experts \(one with task_vectors: false"),
    ("nuslerp", [("a", {}), ("b", {})], {"base_weight": 0.5}, r"base_weight .* needs task_vectors: false"),
    ("nuslerp", [("a", {}), ("b", {})], {"nuslerp_flatten": 0}, r"nuslerp_flatten must be true or false"),
    ("nuslerp", [("a", {"nuslerp_row_wise": True}), ("b", {})], {}, r"'nuslerp_row_wise' is a global parameter"),
    ("multislerp", [("a", {"weight": 1.0}), ("b", {"weight": -1.0})], {}, r"weights sum to 0.0 .* normalize_weights"),
    ("multislerp", [("a", {})], {"task_vectors": False, "base_weight": -1.0}, r"weights sum to 0.0"),
    ("multislerp", [("a", {})], {"eps": 0}, r"eps must be in \(0, inf\]"),
    ("multislerp", [("a", {"density": 0.5})], {}, r"multislerp does not take parameter 'density'"),
    ("karcher", [("a", {})], {"max_iter": 2.5}, r"max_iter must be a whole number, got 2.5"),
    ("karcher", [("a", {})], {"max_iter": -1}, r"max_iter must be in \[0, inf\]"),
    ("karcher", [("a", {})], {"tol": -1e-5}, r"tol must be in \[0, inf\]"),
    ("karcher", [("a", {"weight": 1.0})], {}, r"karcher does not take parameter 'weight'"),
])
def test_invalid_settings_are_refused_before_any_io(op, experts, params, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_spec(_spec(op, experts, params))


def test_weights_may_cancel_without_normalisation():
    validate_spec(_spec("multislerp", [("a", {"weight": 1.0}), ("b", {"weight": -1.0})],
                        {"normalize_weights": False}))


def test_the_parameters_have_mergekits_defaults():
    defaults = {k: v for op in ("nuslerp", "multislerp", "karcher") for k, v in OPERATORS[op].global_params().to_dict().items()}
    assert {n: defaults[n] for n in ("nuslerp_flatten", "nuslerp_row_wise", "normalize_weights", "eps",
                                     "max_iter", "tol")} == {
        "nuslerp_flatten": True, "nuslerp_row_wise": False, "normalize_weights": True, "eps": 1e-8,
        "max_iter": 10, "tol": 1e-5}
    assert (defaults["task_vectors"], defaults["base_weight"]) == (True, 1.0)


def test_max_iter_is_a_whole_number():
    params = OPERATORS["karcher"].resolve(_spec("karcher", [("a", {})], {"max_iter": 7.0}), "x", 0)
    assert params.global_.max_iter == 7 and isinstance(params.global_.max_iter, int)


@pytest.mark.parametrize("name", ["nuslerp", "multislerp", "karcher"])
def test_the_spherical_means_are_planned_whole_tensors(name):
    definition = OPERATORS[name]
    assert not definition.streaming and definition.error_bound == "none" and not definition.random
