"""Seconds for plans: a plan's predicted seconds here, and time budgets turned into byte budgets.

The model is ``spec/time_model.py``, fitted each time to this catalog's rows
for the machine asking (``catalog/timings.py``): the last ``HISTORY`` merges
of the plan's operator on this host and device, over a prior from the read
rate analysis saw on this host and the operator's kernel probe on the device.
A freshly analysed catalog predicts from the prior alone, with its wider
uncertainty; no command needs to run first.

A time budget (``--budget 20s``) becomes the most expert bytes whose merge
the model predicts to take at most that long:
``(seconds − a − c·output_bytes) / b``, so the plan's own prediction equals
the time given or less. It is the model's central prediction: the plan states
how uncertain it is, and a merge may take longer by about that much.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import replace

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import TensorRecord
from mergepipe.catalog.timings import host_key
from mergepipe.errors import BudgetError, ConfigError
from mergepipe.spec.budget import Budget
from mergepipe.spec.plan import Plan
from mergepipe.spec.prediction import Prediction
from mergepipe.spec.time_model import Prior, TimeModel, fit
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES

#: The most recent merges a model is fitted to: enough to outweigh the prior many times over, recent enough to
#: follow a machine whose disk or load changed.
HISTORY = 50


def output_bytes(tensors: Sequence[TensorRecord], out_dtype: str | None) -> int:
    """The bytes a merge of the base ``tensors`` writes: mergeable tensors in ``out_dtype`` (the base's when
    None), the others as they are."""
    return sum(t.numel * DTYPE_SIZES[out_dtype] if (out_dtype and t.dtype in MERGEABLE_DTYPES) else t.nbytes
               for t in tensors)


def time_model(catalog: Catalog, operator: str, device: str, tensors: Sequence[TensorRecord]) -> tuple[str, TimeModel]:
    """``(machine, model)``: the model of ``operator`` merges on ``device`` here, for a base of ``tensors`` (whose
    dtype says how many bytes an element the kernel probe's seconds are for)."""
    if device != "cpu" and device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    host = host_key()
    mergeable = [t for t in tensors if t.dtype in MERGEABLE_DTYPES and t.numel]
    element_bytes = sum(t.nbytes for t in mergeable) / sum(t.numel for t in mergeable) if mergeable else 4.0
    prior = Prior.measured(catalog.timings.read_rate(host), catalog.timings.kernel_seconds(host, device).get(operator),
                           element_bytes)
    return f"{host}/{device}", fit(prior, catalog.timings.merges(host, device, operator, HISTORY))


def predict_plan(catalog: Catalog, plan: Plan, device: str = "cpu") -> Prediction:
    """``plan``'s seconds on ``device`` here: the expert bytes the engine reads (reused ones left out) and the
    output bytes it writes, through this machine's model."""
    machine, model = time_model(catalog, plan.operator, device, catalog.models.tensors(plan.base.id))
    expert_bytes = sum(plan.expert_bytes_to_read(e.id) for e in plan.experts)
    return model.predict(machine, expert_bytes, plan.cost.output_bytes)


def with_prediction(catalog: Catalog, plan: Plan, device: str = "cpu") -> Plan:
    """``plan`` carrying its predicted seconds on ``device`` here; the digest stays."""
    return replace(plan, seconds=predict_plan(catalog, plan, device))


def resolve_budget(catalog: Catalog, budget: Budget, full_bytes: int, tensors: Sequence[TensorRecord],
                   out_dtype: str | None, operator: str, device: str = "cpu") -> int:
    """The budget in bytes: its byte part (or the full read), and with a time part the most expert bytes the
    model predicts to fit in it, whichever is tighter. BudgetError when reading nothing already takes longer."""
    budget_bytes = budget.resolve(full_bytes)
    if budget.seconds is None:
        return budget_bytes
    _, model = time_model(catalog, operator, device, tensors)
    output = output_bytes(tensors, out_dtype)
    within = model.expert_bytes_within(budget.seconds, output)
    if within < 0:
        raise BudgetError(
            f"--budget {budget.text}: even reading no expert byte this merge is predicted to take "
            f"{model.seconds(0, output):.1f} s ± {100 * model.uncertainty:.0f}% here (reading the base, writing and "
            "publishing the output; start-up not included); give more time")
    return min(budget_bytes, full_bytes, math.floor(within) if math.isfinite(within) else full_bytes)
