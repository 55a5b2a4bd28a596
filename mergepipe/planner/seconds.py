"""Seconds for plans: a plan's predicted seconds, and time budgets turned into byte budgets.

The model is ``spec/seconds.py``; its rates are this machine's, as this
catalog stores them (``catalog/rates.py``, measured by ``mergepipe
calibrate``). Without them nothing is guessed: a plan carries no prediction
(the command line says "uncalibrated"), and a time budget is an error.

A time budget (``--budget 20s``) becomes the most expert bytes whose merge
the model predicts to finish in time: the seconds left after start-up,
publishing and the base read — or after start-up, publishing, writing and
computing what the reads make the engine merge — converted at the expert
read rate (with the expert's share of compute). How many base bytes a read
makes the engine merge is bounded from above (a block read from any expert
is merged; a tensor merged whole is merged whole), so the plan's own
prediction never exceeds the time given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import TensorRecord
from mergepipe.errors import BudgetError
from mergepipe.machine import machine_key
from mergepipe.planner.budget import Budget
from mergepipe.planner.units import ALL, TensorPlan, Units
from mergepipe.served import is_served
from mergepipe.spec.plan import Plan
from mergepipe.spec.seconds import (
    BudgetWork,
    Prediction,
    Rates,
    TensorSizes,
    expert_bytes_within,
    minimum_seconds,
    plan_work,
    predict,
)
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES
from mergepipe.units import format_bytes


def tensor_sizes(catalog: Catalog, base_id: str, out_dtype: str | None) -> dict[str, TensorSizes]:
    """Every tensor of the base as the model sees it: bytes read, bytes written, its blocks."""
    blocks = catalog.blocks.by_tensor(base_id)
    sizes = {}
    for t in catalog.models.tensors(base_id):
        mergeable = t.dtype in MERGEABLE_DTYPES
        dtype = out_dtype if (out_dtype and mergeable) else t.dtype
        sizes[t.name] = TensorSizes(t.nbytes, t.numel * DTYPE_SIZES[dtype] if mergeable else t.nbytes,
                                    tuple(b.nbytes for b in blocks.get(t.name, [])), mergeable, dtype == t.dtype)
    return sizes


def predict_plan(catalog: Catalog, plan: Plan, device: str = "cpu") -> Prediction | None:
    """``plan``'s seconds on ``device`` here, from this catalog's rates, run as this process is (served by
    `mergepipe serve` or not); None when uncalibrated (or the plan's operator never was)."""
    machine = machine_key(device)
    rates = catalog.rates.get(machine)
    if rates is None:
        return None
    work = plan_work(plan, tensor_sizes(catalog, plan.base.id, plan.out_dtype))
    seconds = predict(work, rates, is_served())
    return None if seconds is None else Prediction(machine, work, seconds)


def with_prediction(catalog: Catalog, plan: Plan, device: str = "cpu") -> Plan:
    """``plan`` carrying its predicted seconds on ``device`` (none when uncalibrated); the digest stays."""
    return replace(plan, seconds=predict_plan(catalog, plan, device))


def resolve_budget(catalog: Catalog, budget: Budget, full_bytes: int, plans: Sequence[TensorPlan], units: Units,
                   tensors: Sequence[TensorRecord], out_dtype: str | None, operator: str, policy: str,
                   device: str = "cpu") -> int:
    """The budget in bytes: its byte part (or the full read), and with a time part the model's conversion
    of it, whichever is tighter. BudgetError when the time part cannot be converted (uncalibrated) or
    cannot be met even reading nothing."""
    budget_bytes = budget.resolve(full_bytes)
    if budget.seconds is None:
        return budget_bytes
    machine = machine_key(device)
    rates = catalog.rates.get(machine)
    if rates is None or operator not in rates.compute:
        what = "has no measured rates for" if rates is None else f"has no {operator} compute rate for"
        raise BudgetError(f"--budget {budget.text}: a time budget needs this machine's measured rates, and catalog "
                          f"{catalog.path} {what} {machine}; run `mergepipe calibrate --db {catalog.path}` first")
    work = budget_work(plans, units, tensors, out_dtype, operator, policy)
    within = expert_bytes_within(budget.seconds, work, rates, is_served())
    if within < 0:
        raise BudgetError(
            f"--budget {budget.text}: even reading no expert byte this merge is predicted to take "
            f"{minimum_seconds(work, rates, is_served()):.1f} s here (start-up, base read, write); give more time")
    return min(budget_bytes, full_bytes, math.floor(within))


def budget_work(plans: Sequence[TensorPlan], units: Units, tensors: Sequence[TensorRecord], out_dtype: str | None,
                operator: str, policy: str) -> BudgetWork:
    """What a merge of ``plans`` costs whatever its expert budget, and the most base bytes its reads can
    make the engine merge (``BudgetWork``)."""
    fixed = variable = 0
    changing = {p.record.name: p for p in plans}
    for t in tensors:
        if t.dtype not in MERGEABLE_DTYPES:
            continue
        if out_dtype and out_dtype != t.dtype:
            fixed += t.nbytes  # converted whatever is read
        elif t.name in changing:
            p = changing[t.name]
            any_changed = p.changed.any(axis=0)
            whole = p.tensor_level or not p.streams
            variable += t.nbytes if whole and any_changed.any() else int(p.block_bytes[any_changed].sum())
    if policy == "entries":  # a delta-store read merges its tensor whole, however small: assume all of them
        fixed, variable, rho = fixed + variable, 0, 0.0
    else:
        rho = _merged_per_expert_byte(plans, units)
    output = sum(t.numel * DTYPE_SIZES[out_dtype] if (out_dtype and t.dtype in MERGEABLE_DTYPES) else t.nbytes
                 for t in tensors)
    return BudgetWork(operator, sum(t.nbytes for t in tensors), output, fixed, variable, rho)


def _merged_per_expert_byte(plans: Sequence[TensorPlan], units: Units) -> float:
    """The most base bytes one expert byte read makes the engine merge: over every unit, the base bytes
    it covers (its block, or its whole tensor) over what it costs."""
    if not len(units) or not plans:
        return 0.0
    offsets = np.cumsum([0] + [len(p.block_bytes) for p in plans])
    flat = np.concatenate([np.asarray(p.block_bytes, dtype=np.float64) for p in plans])
    whole = np.array([p.record.nbytes for p in plans], dtype=np.float64)
    block = np.where(units.block == ALL, 0, units.block)
    covered = np.where(units.block == ALL, whole[units.tensor], flat[offsets[units.tensor] + block])
    paid = units.cost > 0
    return float((covered[paid] / units.cost[paid]).max()) if paid.any() else 0.0


def describe_rates(rates: Rates) -> list[tuple[str, str]]:
    """``(rate, value)`` rows for people, in the order ``calibrate`` measures them."""
    served = "not measured" if rates.served_startup_seconds is None else f"{rates.served_startup_seconds:.2f} s"
    rows = [("start-up", f"{rates.startup_seconds:.2f} s"), ("exit", f"{rates.exit_share:.0%} of the start-up"),
            ("start-up under `mergepipe serve`", served),
            ("publish (fixed)", f"{rates.publish_seconds:.2f} s"),
            ("cold sequential read, checked", _speed(rates.sequential_read)),
            ("cold block reads, checked", _speed(rates.random_read)),
            ("write, hashed", _speed(rates.write)), ("fsync", _speed(rates.flush)),
            ("reading, merging, writing at once", f"{rates.overlap:.2f} of 3"),
            ("compute lost to reads and writes", _steal(rates.steal))]
    for op, (merged, expert) in sorted(rates.compute.items()):
        rows.append((f"compute {op}", f"{_speed(merged)} merged + {_speed(expert)} of experts"))
    return rows


def _steal(steal: float) -> str:
    """``steal`` for people. Merges measure it (``spec/seconds.py``), calibrate's own probe merge included;
    rates calibrated before that probe existed have 0 until a merge measures it, and then the first merge's
    compute is predicted low (30% on the standard suite's first row here): say so rather than print a
    measured-looking 0."""
    if steal == 0:
        return "not measured yet: the next merge measures it (until then compute may be predicted low)"
    return f"{steal * 2**30:.2f} s per GiB moved"


def _speed(bytes_per_second: float) -> str:
    return f"{format_bytes(bytes_per_second)}/s"
