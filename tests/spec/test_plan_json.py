"""The Plan's JSON (mergepipe.spec.plan): an exact round trip, a strict
reader that only ever raises PlanError, and a digest computed once.

Plans here are built by hand (no catalog): this is the serialisation
contract, not the planner (tests/planner covers what plans contain).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from mergepipe.errors import PlanError
from mergepipe.spec import plan as plan_module
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.copy_map import CopyMap, LayerSlice, TensorCopy
from mergepipe.spec.plan import PLAN_SCHEMA, ModelRef, Plan, PlanCost, PlanReuse, Prediction
from mergepipe.spec.request import MergeRequest


def make_plan(**overrides) -> Plan:
    """A plan with every field set to something non-default, in canonical
    form (as the planner makes them: tensor_level and block indices sorted)."""
    fields = {
        "base": ModelRef("base", "f" * 64),
        "experts": (ModelRef("math", "a" * 64), ModelRef("code", "b" * 64)),
        "merge": MergeSpec(
            "ties",
            (("math", {"density": [0.2, 0.5], "weight": 1.0}),
             ("code", {"density": [{"filter": "mlp", "value": 0.3}, {"value": 0.5}]})),
            {"lambda": 0.9, "normalize": True},
            seed=42,
        ),
        "block_bytes": 2048,
        "budget_text": "30%",
        "budget_bytes": 123_456,
        "policy": "greedy",
        "out_dtype": "bf16",
        "reads": {"model.layers.0.mlp.up_proj.weight": {"math": (0, 1, 2, 7), "code": (3,)},
                  "lm_head.weight": {"code": (0, 1)}},
        "tensor_level": ("lm_head.weight", "model.norm.weight"),
        "cost": PlanCost(1000, 400, 1000, 2000, {"math": 300, "code": 100}),
        "error_bound": 0.125,
        "error_bound_kind": "consensus",
        "error_share": 0.25,
        "notes": ("some blocks of code were skipped",),
        "created_at": "2024-05-01T12:00:00Z",
    }
    fields.update(overrides)
    return Plan(**fields)


def stored(plan: Plan | None = None) -> dict:
    """A plan as stored: its JSON object (a private copy to edit)."""
    return json.loads((plan or make_plan()).to_json_str())


# ------------------------------------------------------------------ round trip


def test_json_round_trip_is_exact():
    plan = make_plan()
    text = plan.to_json_str()
    back = Plan.from_json(text)
    assert back == plan
    assert back.created_at == plan.created_at  # outside __eq__, still kept
    assert back.digest == plan.digest
    assert back.to_json_str() == text
    assert Plan.from_json(plan.to_json()) == plan  # a dict reads the same as its text


def test_a_plan_not_in_canonical_form_reads_back_canonical_with_the_same_digest():
    plan = make_plan(tensor_level=("model.norm.weight", "lm_head.weight"),
                     reads={"lm_head.weight": {"code": (3, 1, 2), "math": ()}})
    back = Plan.from_json(plan.to_json_str())
    assert back.tensor_level == ("lm_head.weight", "model.norm.weight")
    assert back.reads == {"lm_head.weight": {"code": (1, 2, 3)}}
    assert back.digest == plan.digest


def test_reads_are_stored_as_canonical_ranges_and_read_back_as_indices():
    data = stored()
    assert data["reads"]["model.layers.0.mlp.up_proj.weight"] == {"code": [[3, 3]], "math": [[0, 2], [7, 7]]}
    assert Plan.from_json(data).reads_of("model.layers.0.mlp.up_proj.weight", "math") == (0, 1, 2, 7)


def test_digest_ignores_notes_and_created_at_only():
    plan = make_plan()
    assert dataclasses.replace(plan, notes=(), created_at=None).digest == plan.digest
    assert dataclasses.replace(plan, error_bound=0.25).digest != plan.digest
    assert dataclasses.replace(plan, error_share=0.5).digest != plan.digest
    assert dataclasses.replace(plan, merge=dataclasses.replace(plan.merge, seed=43)).digest != plan.digest


# --------------------------------------------------------------- strict reader


def _drop(key):
    return lambda d: d.pop(key)


def _set(path, value):
    def edit(d):
        *parents, last = path
        for p in parents:
            d = d[p]
        d[last] = value
    return edit


MALFORMED = {
    **{f"missing {k}": _drop(k) for k in (
        "schema", "base", "experts", "merge", "block_bytes", "budget", "policy", "out_dtype", "reads",
        "tensor_level", "cost", "error_bound", "notes", "created_at")},
    "missing base fingerprint": lambda d: d["base"].pop("fingerprint"),
    "missing cost field": lambda d: d["cost"].pop("expert_bytes"),
    "missing merge operator": lambda d: d["merge"].pop("operator"),
    "unknown field": _set(["extra"], 1),
    "unknown budget field": _set(["budget", "unit"], "B"),
    "unknown merge field": _set(["merge", "extra"], 1),
    "schema as text": _set(["schema"], "1"),
    "block_bytes as bool": _set(["block_bytes"], True),
    "block_bytes zero": _set(["block_bytes"], 0),
    "block_bytes float": _set(["block_bytes"], 2048.0),
    "experts as object": _set(["experts"], {"id": "math"}),
    "expert id empty": _set(["experts", 0, "id"], ""),
    "base as list": _set(["base"], ["base", "f"]),
    "merge as number": _set(["merge"], 5),
    "merge seed negative": _set(["merge", "seed"], -1),
    "merge experts not a list": _set(["merge", "experts"], "math"),
    "reads as list": _set(["reads"], []),
    "reads backwards range": _set(["reads", "lm_head.weight", "code"], [[3, 1]]),
    "reads float index": _set(["reads", "lm_head.weight", "code"], [[0, 1.5]]),
    "reads not pairs": _set(["reads", "lm_head.weight", "code"], [0, 1]),
    "tensor_level names": _set(["tensor_level"], [3]),
    "cost by model as list": _set(["cost", "expert_bytes_by_model"], []),
    "cost by model value": _set(["cost", "expert_bytes_by_model", "math"], "300"),
    "error bound as text": _set(["error_bound", "value"], "0.1"),
    "error bound kind missing": lambda d: d["error_bound"].pop("kind"),
    "error share missing": lambda d: d["error_bound"].pop("share"),
    "error share as text": _set(["error_bound", "share"], "0.25"),
    "notes as text": _set(["notes"], "a note"),
    "note as number": _set(["notes"], [1]),
    "created_at as number": _set(["created_at"], 5),
    "policy null": _set(["policy"], None),
    "out_dtype as number": _set(["out_dtype"], 16),
    "budget bytes negative": _set(["budget", "bytes"], -1),
    "schema from the future": _set(["schema"], PLAN_SCHEMA + 1),
    "schema zero": _set(["schema"], 0),
    "digest as number": _set(["digest"], 5),
}

#: Edits that keep the plan well-formed: only the stored digest catches them.
EDITED = {
    "tampered digest": _set(["digest"], "0" * 64),
    "edited policy": _set(["policy"], "full"),
    "edited reads": _set(["reads", "lm_head.weight", "code"], [[0, 2]]),
    "edited weight": _set(["merge", "experts", 0, "params", "weight"], 2.0),
    "edited error bound": _set(["error_bound", "value"], 1),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_plans_are_plan_errors(case):
    """Without a stored digest, so that only the strict reader can refuse them."""
    data = stored()
    data.pop("digest")
    MALFORMED[case](data)
    if "digest" in data:
        expected = "digest mismatch"
    else:
        expected = "not a valid MergePipe plan"
    with pytest.raises(PlanError, match=expected):
        Plan.from_json(json.dumps(data))
    with pytest.raises(PlanError, match=expected):  # the same from the dict
        Plan.from_json(copy.deepcopy(data))


@pytest.mark.parametrize("case", sorted(EDITED))
def test_edited_plans_fail_the_digest_check(case):
    data = stored()
    EDITED[case](data)
    with pytest.raises(PlanError, match="digest mismatch"):
        Plan.from_json(json.dumps(data))
    data.pop("digest")
    Plan.from_json(json.dumps(data))  # well-formed: the digest was the only objection


@pytest.mark.parametrize("text", ["", "{", "not json", "[]", "null", "42", '"plan"', '{"schema": 1'])
def test_text_that_is_not_a_plan_object_is_a_plan_error(text):
    with pytest.raises(PlanError, match="not a valid MergePipe plan"):
        Plan.from_json(text)


def test_a_tampered_digest_names_both_digests():
    data = stored()
    real = data["digest"]
    data["digest"] = "0" * 64
    with pytest.raises(PlanError, match=f"stored 000000000000, recomputed {real[:12]}"):
        Plan.from_json(json.dumps(data))


def test_a_plan_without_digest_is_read_and_gets_its_digest():
    data = stored()
    real = data.pop("digest")
    assert Plan.from_json(json.dumps(data)).digest == real


@pytest.mark.parametrize("where", [["merge", "params", "lambda"], ["merge", "experts", 0, "params", "weight"]])
def test_non_finite_numbers_in_the_merge_settings_are_plan_errors(where):
    data = stored()
    _set(where, float("nan"))(data)
    with pytest.raises(PlanError):
        Plan.from_json(json.dumps(data))  # json.dumps writes NaN, json.loads reads it back


def full_plan() -> Plan:
    """A plan with every optional part set: reuse, delta-store reads, a copy map, seconds, the request."""
    return make_plan(
        reuse=PlanReuse("prev", "c" * 64, {"lm_head.weight": (0, 1)}, 64, saved={"math": 32}, errors={"t": {0: 0.5}}),
        entry_reads={"t": {"math": 2}}, sketch_reads={"u": {"code": 1}}, stores={"math": "d" * 64, "code": "e" * 64},
        copies=CopyMap((LayerSlice("base", 0, 2),), (TensorCopy("x", "base", "x"),)),
        seconds=Prediction("m", 1.5, 0.2, 3, {"fixed": 1.0, "experts": 0.25, "output": 0.25}),
        request=MergeRequest(base="base@1", experts=["math@1", "code@1"], params={"density": 0.5}, budget="30%"),
        out_shard_bytes=10**9, chat_template="{{ x }}", copy_tokenizer=False, side_files={"tokenizer.json": "f" * 64},
    )


def test_every_optional_part_round_trips_and_only_the_hashed_ones_move_the_digest():
    plan = full_plan()
    back = Plan.from_json(plan.to_json_str())
    assert back == plan and back.to_json_str() == plan.to_json_str()
    assert (back.request, back.seconds) == (plan.request, plan.seconds)  # kept, though outside __eq__
    assert make_plan(request=plan.request, seconds=plan.seconds, estimate=0.5).digest == make_plan().digest
    assert json.loads(plan.to_json_str())["entries"]["reads"] == {"t": {"math": 2}}


#: Edits of the optional parts that no plan is stored with, each refused with the key it names.
NESTED = {
    "reuse unknown key": (_set(["reuse", "extra"], 1), "unknown key 'reuse.extra'"),
    "reuse blocks not ranges": (_set(["reuse", "blocks", "lm_head.weight"], [0, 1]), "reuse.blocks"),
    "reuse error pairs": (_set(["reuse", "errors", "t"], [[0]]), "reuse.errors"),
    "copies row of two": (_set(["copies", "tensors", 0], ["x", "base"]), "copies.tensors.0"),
    "copies layer range": (_set(["copies", "slices", 0, "layer_range"], [2, 1]), "FIRST must be below END"),
    "entries without a store": (_set(["entries", "stores"], {"math": "d" * 64}), "have no store"),
    "entries chunk zero": (_set(["entries", "reads", "t", "math"], 0), "greater than or equal to 1"),
    "seconds terms": (_set(["seconds", "terms"], {"fixed": 1.0}), "the terms are fixed, experts, output"),
    "request unknown key": (_set(["request", "sed"], 1), "sed"),
    "stored default": (_set(["copy_tokenizer"], True), "copy_tokenizer is True, which is never stored"),
}


@pytest.mark.parametrize("case", sorted(NESTED))
def test_malformed_optional_parts_are_plan_errors_naming_the_key(case):
    data = json.loads(full_plan().to_json_str())
    data.pop("digest")
    edit, words = NESTED[case]
    edit(data)
    with pytest.raises(PlanError, match="not a valid MergePipe plan") as info:
        Plan.from_json(data)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


# ---------------------------------------------------------------- digest cache


def test_digest_is_computed_once_per_plan(monkeypatch):
    calls = []
    real = plan_module.digest

    def counting(value):
        calls.append(1)
        return real(value)

    monkeypatch.setattr(plan_module, "digest", counting)
    plan = make_plan()
    first = plan.digest
    assert plan.digest is first
    plan.to_json()
    plan.to_json_str()
    assert len(calls) == 1
    back = Plan.from_json(plan.to_json_str())  # checking the stored digest computes it...
    assert back.digest == first and back.to_json()["digest"] == first
    assert len(calls) == 2  # ...once for the new plan, and never again
