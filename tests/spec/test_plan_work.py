"""The bytes and expert runs a plan moves (spec/plan_work.py), counted by hand from make_plan's reads."""

from __future__ import annotations

from mergepipe.spec.plan_work import expert_runs
from mergepipe.spec.reuse import PlanReuse
from tests.spec.test_plan_json import make_plan


def test_each_run_of_adjacent_planned_blocks_is_one_read_at_a_new_offset():
    # up_proj: math reads 0, 1, 2 and 7 (two runs), code reads 3 (one); lm_head: code reads 0 and 1 (one)
    assert expert_runs(make_plan()) == 4


def test_reused_blocks_are_not_read_and_split_a_run():
    reuse = PlanReuse("snap", "c" * 64, {"model.layers.0.mlp.up_proj.weight": (1,)}, 2048)
    # math's 0, 1, 2, 7 less the reused 1: 0, 2 and 7 are three runs; code's 3 and lm_head's 0-1 as before
    assert expert_runs(make_plan(reuse=reuse)) == 5


def test_a_delta_store_or_sketch_read_of_a_tensor_is_one_run():
    plan = make_plan(entry_reads={"model.norm.weight": {"math": 3, "code": 0}},
                     sketch_reads={"lm_head.weight": {"math": 2}})
    assert expert_runs(plan) == 4 + 1 + 1  # code's 0 chunks read nothing
