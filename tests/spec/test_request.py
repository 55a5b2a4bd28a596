"""The one merge request: built from Python, flags or a config file, checked as a whole before any I/O."""

from __future__ import annotations

import pytest

import json

from mergepipe.catalog import Catalog
from mergepipe.errors import BudgetError, ConfigError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import parse_budget
from mergepipe.spec.mergekit import load_config, merge_request
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.request import OUTPUT_DTYPES, MergeRequest
from mergepipe.storage.format import MERGEABLE_DTYPES
from tests.fixtures.cli import invoke, wide_runner
from tests.planner.support import build_catalog


def test_defaults_and_parsed_fields():
    request = MergeRequest(base="b", experts=["e1", "e2"], operator="TIES", params={"density": 0.5},
                           budget="25%", out_dtype="bfloat16", out_shard_bytes="5GB", block_bytes="64KiB")
    assert request.operator == "ties" and request.experts == ("e1", "e2")
    assert request.budget == parse_budget("25%")
    assert (request.out_dtype, request.out_shard_bytes, request.block_bytes) == ("BF16", 5 * 10**9, 65536)
    assert (request.seed, request.policy, request.previous, request.delta_update) == (0, None, None, False)
    assert MergeRequest(base="b", experts=["e"]).budget.text == "100%"


def test_the_spec_names_exact_ids_and_folds_the_weights_in():
    request = MergeRequest(base="b", experts=["math", "code"], operator="task_arithmetic", weights=[0.7, 0.3],
                           expert_params={"math": {"weight": 9.0}}, params={"lambda": 0.5}, seed=3)
    spec = request.spec({"math": "math@2", "code": "code"})
    assert spec == MergeSpec("task_arithmetic", (("math@2", {"weight": 0.7}), ("code", {"weight": 0.3})),
                             {"lambda": 0.5}, 3)


def test_parameters_keyed_by_another_spelling_are_checked_once_resolved():
    request = MergeRequest(base="b", experts=["math"], operator="ties", expert_params={"math@1": {"density": 0.4}})
    assert request.spec({"math": "math", "math@1": "math"}).expert("math").params == {"density": 0.4}
    with pytest.raises(ConfigError, match="parameters given for 'nobody', which is not among the experts"):
        MergeRequest(base="b", experts=["math"], expert_params={"nobody": {"density": 0.4}}).spec({"math": "math"})


@pytest.mark.parametrize("fields, words", [
    ({"base": "b", "experts": []}, "merge request: experts: "),
    ({"base": "", "experts": ["e"]}, "merge request: base: "),
    ({"base": "b", "experts": ["e"], "sed": 1}, "merge request: unknown key 'sed'"),
    ({"base": "b", "experts": ["e"], "seed": -1}, "merge request: seed: "),
    ({"base": "b", "experts": ["e"], "seed": "3"}, "merge request: seed: "),
    ({"base": "b", "experts": ["e"], "policy": "greedy"}, "merge request: policy: "),
    ({"base": "b", "experts": ["e"], "operator": "frankenmerge"}, "unknown merge operator 'frankenmerge'"),
    ({"base": "b", "experts": ["e"], "out_dtype": "int8"}, "the output dtype must be one of"),
    ({"base": "b", "experts": ["e"], "out_shard_bytes": "5B"}, "give a unit"),
    ({"base": "b", "experts": ["e1", "e2"], "weights": [1.0]}, "got 1 weights for 2 experts"),
    ({"base": "b", "experts": ["e", "e"]}, "listed twice"),
    ({"base": "b", "experts": ["b"]}, "both the base and an expert"),
    ({"base": "b", "experts": ["e"], "delta_update": True}, "give --from"),
    ({"base": "b", "experts": ["e"], "operator": "ties", "params": {"densty": 0.5}},
     "ties does not take parameter 'densty'"),
    ({"base": "b", "experts": ["e"], "operator": "ties", "params": {"density": 1.5}}, "density"),
    ({"base": "b", "experts": ["e1", "e2"], "operator": "slerp"}, "slerp needs exactly 1 expert"),
    ({"base": "b", "experts": ["e"], "operator": "della", "params": {"density": 0.2, "epsilon": 0.5}}, "epsilon"),
])
def test_anything_wrong_is_one_line_naming_the_key(fields, words):
    with pytest.raises(ConfigError) as info:
        MergeRequest(**fields)
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_a_bad_budget_is_a_budget_error():
    with pytest.raises(BudgetError, match="did you mean 25%"):
        MergeRequest(base="b", experts=["e"], budget="0.25")


def test_flags_win_over_a_config_which_wins_over_the_defaults():
    config = load_config("params: {density: 0.5, lambda: 0.9}\nexpert_params: {e1: {weight: 0.3}}", "c.yml")
    request = merge_request({"base": "b", "experts": ("e1", "e2"), "operator": None, "params": {"density": 0.7},
                             "seed": 4, "budget": None}, config)
    assert request.params == {"density": 0.7, "lambda": 0.9}  # flags update the config's global parameters
    assert request.expert_params == {"e1": {"weight": 0.3}}
    assert (request.operator, request.seed, request.budget.text) == ("ties", 4, "100%")


def test_a_mergekit_config_names_the_models_itself():
    config = load_config("merge_method: ties\nbase_model: b\nmodels: [{model: e1, parameters: {density: 0.5}}]\n"
                         "mergepipe: {budget: 25%, seed: 7, model_id: m}", "k.yml")
    request = merge_request({"budget": "50%"}, config)
    assert (request.base, request.experts, request.seed, request.model_id) == ("b", ("e1",), 7, "m")
    assert request.budget.text == "50%"
    with pytest.raises(ConfigError, match="k.yml is a mergekit config: it names the models and the method; drop "
                                          "--experts, --weights"):
        merge_request({"experts": ("x",), "weights": (1.0,)}, config)


def test_output_dtypes_are_the_mergeable_ones():
    assert set(OUTPUT_DTYPES) == set(MERGEABLE_DTYPES)


def test_a_plan_embeds_its_request_with_exact_versions_and_plans_again_from_it(tiny_family, tmp_path, monkeypatch):
    """What bisect, search and --from derive new requests from: no text re-parsed, no request rebuilt by hand."""
    db = build_catalog(tmp_path / "c.db", 2048, {n: tiny_family[n] for n in ("base", "e1", "e2")}, "base", ("e1", "e2"))
    runner = wide_runner(monkeypatch)
    flags = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.4",
             "--weights", "0.7", "0.3", "--seed", "3", "--no-progress", "--json"]
    planned = json.loads(invoke(runner, ["plan", *flags, "--budget", "60%"]))
    full = json.loads(invoke(runner, ["plan", *flags, "--budget", "100%"]))
    plan = Plan.from_json(planned)
    assert (plan.request.base, plan.request.experts) == ("base@1", ("e1@1", "e2@1"))
    assert (plan.request.budget, plan.request.seed, plan.request.weights) == (parse_budget("60%"), 3, (0.7, 0.3))
    with Catalog.open(db) as catalog:
        assert Planner(catalog).plan(plan.request).digest == plan.digest
        assert Planner(catalog).plan(plan.request.changed(budget="100%")).digest == full["digest"] != plan.digest
    with pytest.raises(ConfigError, match="merge request: seed: "):
        plan.request.changed(seed=-1)
