"""The bytes a plan moves, per phase of the cost model (``spec/seconds.py``), counted from the plan and the
base's tensor sizes alone: the planner attaches the prediction before anything is read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergepipe.spec.seconds import Work


@dataclass(frozen=True)
class TensorSizes:
    """What the model needs of one base tensor: its bytes, its blocks' bytes and how it is written."""

    nbytes: int
    out_bytes: int
    blocks: tuple[int, ...]
    mergeable: bool
    same_dtype: bool


def plan_work(plan: Any, sizes: Mapping[str, TensorSizes]) -> Work:
    """The bytes ``plan`` moves (a ``spec.plan.Plan``; ``sizes``: every base tensor), as the engine
    moves them: a tensor is copied, merged block by block (a block no expert is read for is copied
    when the dtype stays) or merged whole (``Plan.merge_mode``); reused blocks are neither."""
    merged = 0
    for name, t in sizes.items():
        mode = plan.merge_mode(name, t.mergeable, t.same_dtype)
        reused = set(plan.reuse.blocks.get(name, ())) if plan.reuse else set()
        if mode == "whole":
            merged += 0 if reused else t.nbytes
        elif mode == "blocks":
            read = {b for per in plan.reads.get(name, {}).values() for b in per}
            merged += sum(n for i, n in enumerate(t.blocks) if (i in read or not t.same_dtype) and i not in reused)
    expert = sum(plan.expert_bytes_to_read(e.id) for e in plan.experts)
    return Work(plan.operator, sum(t.nbytes for t in sizes.values()), expert, merged,
                sum(t.out_bytes for t in sizes.values()), expert_runs(plan))


def expert_runs(plan: Any) -> int:
    """The reads at a new offset ``plan`` makes in its experts' files: per tensor and expert, the runs of
    adjacent planned blocks (reused ones left out), and one per delta-store or sketch read of a tensor."""
    runs = 0
    for tensor, per_expert in plan.reads.items():
        reused = set(plan.reuse.blocks.get(tensor, ())) if plan.reuse else set()
        for blocks in per_expert.values():
            read = sorted(set(blocks) - reused)
            runs += sum(1 for k, index in enumerate(read) if k == 0 or index != read[k - 1] + 1)
    stored = (plan.entry_reads, plan.sketch_reads)
    return runs + sum(1 for counts in stored for per in counts.values() for n in per.values() if n)
