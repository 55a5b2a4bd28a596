"""Learning rates from merges: what one merge measured (``observe``) and how far it moves the rates
(``refine``). The model and its rates are ``spec/seconds.py``; every merge's manifest carries its
realized seconds per phase, and the engine refines this machine's rates with them after commit."""

from __future__ import annotations

from collections.abc import Mapping

from mergepipe.spec.seconds import (
    EXPERT_RATE,
    MERGED_RATE,
    OVERLAP_RANGE,
    SERVED_STARTUP,
    STEAL,
    Rates,
    Work,
    moved_bytes,
    predict,
)

#: How far one merge moves a rate toward what it measured: ``new = old + (measured − old) / 3``, an
#: exponentially weighted average in which a merge's weight shrinks by a third with every merge after it:
#: the model follows a machine whose load changes within a few merges, and one odd merge moves it only a
#: third of the way. Why a third and not a half: a merge's own start-up and compute vary by ±20% run to
#: run on a busy 2-core machine, and a half passed that noise on to the next prediction (replayed on five
#: recorded ``benchmarks.predict`` runs, 465 merges: a third was within ±20% on 440, a half on 430, a
#: quarter on 429 and a fifth on 428; BENCHMARKS.md, "Plans that predict seconds").
REFINE_WEIGHT = 1 / 3
#: A measurement further than this factor from the rate (either way) is not used: one disturbed run (a
#: swapping machine, or a Python process that was running long before it merged) must not throw the
#: model off. Recalibrate after changing the machine.
OUTLIER_FACTOR = 10.0
#: ``steal`` may be 0 (nothing slowed the merge): it is compared with at least this (0.1 s per GB), so a
#: measurement up to ten times that is used, and one beyond (a tiny merge's fixed costs) is not.
STEAL_SCALE = 0.1e-9


def observe(work: Work, rates: Rates, realized: Mapping[str, float], served: bool = False) -> dict[str, float]:
    """The rates one merge (``served`` or not) measured, from its manifest's realized seconds
    (``name -> value``).

    Measured directly: ``startup`` (process start to the first read; the exit follows it), ``compute``
    (the worker merging) and ``write`` (writing the output). What compute took beyond the operator's own
    cost (its rates, timed alone by ``calibrate``) is ``steal``: per byte read and written beside it;
    where compute took less than that own cost, the operator's timing was slowed, and its rates speed up
    (``faster_operator``). The worker's time is its ``read_wait``, ``compute`` and ``write_wait`` (waiting
    for the write-behind thread), or, where it writes itself (no ``write_wait``), its ``write``; the rest
    of the engine's ``total`` — staging, opening the inputs, hashing, the manifest, fsync, rename, commit
    — is publishing, whose two rates move by the same factor: the one that would have predicted it
    exactly. The worker's time, against the compute and write measured and the reads as predicted (the
    read-ahead threads are not timed alone), measures ``overlap`` when it is longer than each of them.
    """
    out: dict[str, float] = {}
    if realized.get("startup", 0.0) > 0:
        out[SERVED_STARTUP if served else "startup_seconds"] = realized["startup"]
    predicted = predict(work, rates, served)
    if predicted is None or "total" not in realized:
        return out
    compute, write = realized.get("compute", 0.0), realized.get("write", 0.0)
    moved = moved_bytes(work)
    if compute > 0 and moved:
        own = rates.compute_seconds(work.operator, work.merged_bytes, work.expert_bytes, 0)
        out[STEAL] = max(0.0, compute - own) / moved
        if compute < own:  # the operator merged faster than it was timed alone: that timing was slowed
            out.update(faster_operator(work.operator, rates, own / compute))
    if work.output_bytes and write > 0:
        out["write"] = work.output_bytes / write
    worker = realized.get("read_wait", 0.0) + compute + realized.get("write_wait", write)
    tail = realized["total"] - worker
    if tail > 0:
        factor = predicted["publish"] / tail
        out["publish_seconds"] = rates.publish_seconds / factor
        if work.output_bytes:
            out["flush"] = rates.flush * factor
    parts = (predicted["base_read"] + predicted["expert_read"], compute or predicted["compute"], write)
    if worker > max(parts):
        low, high = OVERLAP_RANGE
        out["overlap"] = min(high, max(low, sum(parts) / worker))
    return out


def faster_operator(operator: str, rates: Rates, factor: float) -> dict[str, float]:
    """``operator``'s two compute rates ``factor`` times faster.

    Why only faster: a merge's compute is the operator's own cost plus what the I/O threads take from it
    (``steal``, at least 0), so a merge that computed in less than the own cost shows that the
    calibration timed the operator while something else slowed it (seen on a 2-core machine: task
    arithmetic, linear and average timed at a fifth to a quarter of their speed in one calibration of
    six, and every task-arithmetic merge then predicted 25-48% too long until the next calibration). A
    merge slower than the own cost says nothing about the operator alone: ``steal`` takes that."""
    merged, expert = rates.compute[operator]
    return {MERGED_RATE + operator: merged * factor, EXPERT_RATE + operator: expert * factor}


def refine(rates: Rates, observed: Mapping[str, float], weight: float = REFINE_WEIGHT) -> tuple[Rates, list[str]]:
    """``rates`` moved toward ``observed`` by ``weight`` (``REFINE_WEIGHT``), outliers
    (``OUTLIER_FACTOR``) left out; the refined rates and the names that moved."""
    values = rates.to_values()
    moved = []
    for name, value in sorted(observed.items()):
        old = values.get(name)
        if old is None or not _plausible(name, old, value):
            continue
        values[name] = old + weight * (value - old)
        moved.append(name)
    refined = Rates.from_values(values)
    assert refined is not None, "every scalar rate was there before"
    return refined, moved


def _plausible(name: str, old: float, value: float) -> bool:
    """Whether a measured ``value`` is close enough to the rate's ``old`` one to be learned
    (``OUTLIER_FACTOR``; ``STEAL_SCALE``)."""
    if name == STEAL:
        return value <= max(old, STEAL_SCALE) * OUTLIER_FACTOR
    return old / OUTLIER_FACTOR <= value <= old * OUTLIER_FACTOR
