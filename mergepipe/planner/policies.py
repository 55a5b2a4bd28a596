"""How a budget is spent: which units a plan reads.

* ``energy`` (default): greedy by value per byte; a unit that does not fit
  is skipped and the scan goes on, so smaller valuable units still use what
  is left. Ties keep creation order (tensor, expert, block).
* ``uniform``: first the same fraction f = budget / full of every tensor's
  units, picked by a deterministic hash of (tensor, block) that ignores the
  catalog's statistics (a baseline), then what the floors left, one more
  unit each to the tensors furthest below f.
* ``full``: everything (the budget must cover it).
* ``entries``: experts' largest delta entries from their delta stores,
  blocks for experts without one (``entries.py``; the planner calls it,
  since it needs the stores).
"""

from __future__ import annotations

import numpy as np

from mergepipe.errors import ConfigError
from mergepipe.planner.units import Units
from mergepipe.spec.request import POLICIES


def choose(units: Units, budget_bytes: int, policy: str, tensor_names: list[str]) -> np.ndarray:
    """Indices of the chosen units, under ``budget_bytes``."""
    if policy == "full":
        return np.arange(len(units))
    if policy == "energy":
        ratio = np.divide(units.value, units.cost, out=np.full(len(units), np.inf), where=units.cost > 0)
        ranked = np.argsort(-ratio, kind="stable")
        chosen, _ = greedy_fill(ranked, units.cost, budget_bytes, 0)
        return chosen
    if policy == "uniform":
        return _uniform(units, budget_bytes, tensor_names)
    raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def greedy_fill(ranked: np.ndarray, cost: np.ndarray, budget_bytes: int, spent: int) -> tuple[np.ndarray, int]:
    """Take units in ``ranked`` order while they fit: ``(taken, spent)``.

    Equal to a loop that adds each unit if ``spent + cost <= budget``, done
    in vectorised steps: take the longest prefix that fits, skip the unit
    that does not, and go on with only the units small enough for what is
    left (a unit too big now never fits later, since spending only grows).
    """
    taken: list[np.ndarray] = []
    candidates = ranked
    while len(candidates):
        cumulative = np.cumsum(cost[candidates])
        fit = int(np.searchsorted(cumulative, budget_bytes - spent, side="right"))
        if fit:
            taken.append(candidates[:fit])
            spent += int(cumulative[fit - 1])
        if fit == len(candidates):
            break
        rest = candidates[fit + 1:]
        candidates = rest[cost[rest] <= budget_bytes - spent]
    out = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    return out, spent


def _uniform(units: Units, budget_bytes: int, tensor_names: list[str]) -> np.ndarray:
    total = units.total_cost
    fraction = min(1.0, budget_bytes / total) if total else 0.0
    tensors = [int(t) for t in dict.fromkeys(units.tensor.tolist())]  # ordinal order
    by_tensor = {}
    for t in tensors:
        members = np.flatnonzero(units.tensor == t)
        by_tensor[t] = members[np.argsort(units.rank[members], kind="stable")]  # hash order
    chosen: list[np.ndarray] = []
    picked = np.zeros(len(units), dtype=bool)
    spent = 0
    deficit = {}
    for t in tensors:
        members = by_tensor[t]
        head = members[: int(fraction * len(members))]
        taken, spent = greedy_fill(head, units.cost, budget_bytes, spent)
        chosen.append(taken)
        picked[taken] = True
        deficit[t] = fraction * len(members) - len(taken)
    # What floors left of the budget goes to the tensors furthest below the
    # fraction, at most one more unit each: every tensor stays within one
    # unit of f * its units.
    for t in sorted(tensors, key=lambda t: (-deficit[t], tensor_names[t])):
        if deficit[t] <= 0:
            continue
        members = by_tensor[t]
        fits = members[~picked[members] & (units.cost[members] <= budget_bytes - spent)]
        if len(fits):
            chosen.append(fits[:1])
            picked[fits[0]] = True
            spent += int(units.cost[fits[0]])
    return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)
