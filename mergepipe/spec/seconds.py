"""The cost model: seconds a merge will take, from the bytes its plan moves and a few measured rates.

A plan knows its bytes exactly (``PlanCost``); seconds need rates, which
belong to one machine and device (``mergepipe.machine``), are measured by
``mergepipe calibrate`` and kept in the catalog. The model has six phases:

* ``startup``: fixed seconds — ``startup_seconds`` from the process's start
  to its first read (Python, importing torch, the catalog, planning), and
  its exit (unloading torch takes a while) as ``exit_share`` of that: both
  are mostly the interpreter and torch, and grow alike with the machine's
  load, so a start-up refined by merges carries the exit along. A command a
  `mergepipe serve` process runs (``mergepipe/served.py``) imports nothing
  and exits at once: its start-up is ``served_startup_seconds`` (the client's
  interpreter and a fork, as ``calibrate`` times them, then refined by served
  merges, like the other, with the catalog and planning), no exit share;
* ``base_read``: the whole base read cold and in order, each block checked
  against its hash: ``base_bytes / sequential_read``;
* ``expert_read``: the planned expert blocks, read cold one block at a time
  at scattered offsets, checked: ``expert_bytes / random_read``;
* ``compute``: ``merged_bytes / compute_merged[op] + expert_bytes /
  compute_expert[op]`` — per block merged, the base block widened to fp32,
  the kernel, the result narrowed and hashed (the first rate); per expert
  block read, its widening and its part of the kernel (the second); copied
  blocks cost no compute — ``+ steal × (base_bytes + expert_bytes +
  output_bytes)``: the CPU the reading and writing threads take from the
  merging worker (copying, hashing) while the stream runs, per byte they
  move. ``calibrate`` times each operator alone (the faster of two sweeps), so
  the first two terms are the operator's own cost (a merge that computes in
  less speeds them up: ``refinement.faster_operator``); ``steal`` is the machine's (how many cores it has
  for the three), the same for every operator, and merges measure it
  (``observe``): ``calibrate`` ends with two small merges of synthetic
  checkpoints that measure it so (the lesser kept: ``cli/calibrate_probe.py``; calibrating
  again keeps what real merges measured), not in its ``overlap`` step, which
  charges the contention it sees to ``overlap`` (measured there too, it would
  be counted twice: 0.9 s per GiB against the 0.17–0.41 that merges see here);
* ``write``: every output byte written into the page cache and hashed:
  ``output_bytes / write``;
* ``publish``: a fixed ``publish_seconds`` (staging, manifest, rename,
  commit) plus the fsync of the output: ``output_bytes / flush``.

An own-process merge hands its plan's reads to the kernel while it loads
torch (``storage/prefetch.py``), so reading starts inside the start-up: the
first ``read_ahead_seconds`` of reads (``loading_seconds``, its start-up less
a served command's, all of it where none was measured; at most
``READ_AHEAD_BYTES``) cost the stream nothing, and ``base_read`` and
``expert_read`` are what is left after that window, in proportion. A
served command has torch loaded: its reads are all in the stream.

Reading (the read-ahead threads), merging (the worker) and writing (the
write-behind thread) run at once, so the stream of the three takes
``max(reads, compute, write, (reads + compute + write) / overlap)`` with
``reads = base_read + expert_read``: no less than its longest part, and the
sum of the parts shared out over ``overlap`` (between 1: one after another,
and 3: fully side by side), which says how far this machine's cores let the
three overlap (they compete for the CPU: hashing, copying, the kernel). So
``total = startup + stream + publish``.

Rates are bytes per second (seconds where the name says so; ``steal`` is
seconds per byte). Pure Python: the planner, the engine and the command line
share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mergepipe.spec import fields

#: The most an own-process merge reads ahead while it loads torch (``storage/prefetch.py``). More, on a
#: fast disk, costs the import CPU on a small machine (2 cores: the start-up grew by up to a second when a
#: whole 100% plan was read ahead) and is read beside the engine anyway.
READ_AHEAD_BYTES = 2 * 1024**3

#: The phases, in the order a merge goes through them.
PHASES = ("startup", "base_read", "expert_read", "compute", "write", "publish")
#: How people read the phases.
PHASE_LABELS = {"startup": "start-up", "base_read": "base read", "expert_read": "expert read",
                "compute": "compute", "write": "write", "publish": "publish"}
#: The rates that are not per operator, in the order ``calibrate`` prints them.
SCALAR_RATES = ("startup_seconds", "exit_share", "publish_seconds", "sequential_read", "random_read", "write",
                "flush", "overlap")
#: ``overlap`` lies between these: the three parts of the stream one after another, or all side by side.
OVERLAP_RANGE = (1.0, 3.0)
#: The names an operator's two compute rates are stored under: this prefix and the operator's name.
MERGED_RATE, EXPERT_RATE = "compute_merged:", "compute_expert:"
#: Seconds of the worker's compute lost per byte read or written beside it (``Rates.steal``): not a rate of
#: bytes per second, and 0 on a machine whose reading and writing threads never slow the merge.
STEAL = "steal"
#: The start-up of a served command (``Rates.served_startup_seconds``): optional, like ``steal``.
SERVED_STARTUP = "served_startup_seconds"
#: What the command line says instead of guessing.
UNCALIBRATED = "uncalibrated: run `mergepipe calibrate`"


@dataclass(frozen=True)
class Rates:
    """One machine's measured rates (see the module docstring for what each times)."""

    startup_seconds: float
    exit_share: float  # the exit's seconds over ``startup_seconds``
    publish_seconds: float
    sequential_read: float
    random_read: float
    write: float
    flush: float
    overlap: float  # how many of reading, merging and writing run at once, on average (``OVERLAP_RANGE``)
    # operator -> (merged base bytes per second, expert bytes per second), each operator timed alone
    compute: dict[str, tuple[float, float]] = field(default_factory=dict)
    steal: float = 0.0  # seconds of compute lost per byte read or written beside it (module docstring)
    served_startup_seconds: float | None = None  # a served command's start-up; None: never measured here

    def __post_init__(self) -> None:
        for name in SCALAR_RATES:
            _positive(getattr(self, name), name)
        for op, pair in self.compute.items():
            _positive(pair[0], MERGED_RATE + op)
            _positive(pair[1], EXPERT_RATE + op)
        if not (isinstance(self.steal, (int, float)) and 0 <= self.steal < 1):
            raise ValueError(f"{STEAL} must be seconds per byte, at least 0 and below 1, got {self.steal!r}")
        if self.served_startup_seconds is not None:
            _positive(self.served_startup_seconds, SERVED_STARTUP)

    def to_values(self) -> dict[str, float]:
        """Flat ``name -> value``, as the catalog stores them."""
        values = {name: float(getattr(self, name)) for name in SCALAR_RATES}
        for op, (merged, expert) in sorted(self.compute.items()):
            values[MERGED_RATE + op], values[EXPERT_RATE + op] = float(merged), float(expert)
        values[STEAL] = float(self.steal)
        if self.served_startup_seconds is not None:
            values[SERVED_STARTUP] = float(self.served_startup_seconds)
        return values

    @classmethod
    def from_values(cls, values: Mapping[str, float]) -> Rates | None:
        """The rates in ``values``; None when a scalar rate is missing (never calibrated). A catalog
        calibrated before ``steal`` was measured has none: 0 until the next calibration (and no served
        start-up: a served command is predicted as a fresh process until then)."""
        if not all(name in values for name in SCALAR_RATES):
            return None
        ops = {n[len(MERGED_RATE):] for n in values if n.startswith(MERGED_RATE)}
        compute = {op: (values[MERGED_RATE + op], values[EXPERT_RATE + op]) for op in ops if EXPERT_RATE + op in values}
        return cls(**{name: values[name] for name in SCALAR_RATES}, compute=compute, steal=values.get(STEAL, 0.0),
                   served_startup_seconds=values.get(SERVED_STARTUP))

    def startup(self, served: bool = False) -> float:
        """The start-up phase with its exit; for a served command (module docstring), its own start-up
        where it was measured."""
        if served and self.served_startup_seconds is not None:
            return self.served_startup_seconds
        return self.startup_seconds * (1 + self.exit_share)

    @property
    def loading_seconds(self) -> float:
        """What an own-process command's start-up spends that a served one's does not (loading torch and
        the engine): ``startup_seconds`` less ``served_startup_seconds``, all of it where no served command
        was measured."""
        return max(0.0, self.startup_seconds - (self.served_startup_seconds or 0.0))

    @property
    def read_ahead_seconds(self) -> float:
        """The seconds of reads an own-process merge does while it loads torch (module docstring): the
        loading, at most ``READ_AHEAD_BYTES`` at the sequential read rate."""
        return min(self.loading_seconds, READ_AHEAD_BYTES / self.sequential_read)

    def compute_seconds(self, operator: str, merged_bytes: int, expert_bytes: int, moved_bytes: int) -> float:
        """``operator``'s compute (module docstring): its own cost, and what ``moved_bytes`` read and
        written beside it take from it."""
        merged_rate, expert_rate = self.compute[operator]
        return merged_bytes / merged_rate + expert_bytes / expert_rate + self.steal * moved_bytes


def _positive(value: float, name: str) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and value != float("inf")):
        raise ValueError(f"rate {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Work:
    """The bytes one merge moves, per phase of the model."""

    operator: str
    base_bytes: int  # read in order
    expert_bytes: int  # read block by block
    merged_bytes: int  # base bytes of the blocks and tensors merged (not copied)
    output_bytes: int  # written

    def to_json(self) -> dict[str, Any]:
        return {"operator": self.operator, "base_bytes": self.base_bytes, "expert_bytes": self.expert_bytes,
                "merged_bytes": self.merged_bytes, "output_bytes": self.output_bytes}

    @classmethod
    def from_json(cls, data: Any) -> Work:
        names = ("base_bytes", "expert_bytes", "merged_bytes", "output_bytes")
        d = fields.keys(data, ("operator", *names), "predicted work")
        return cls(fields.text(d["operator"], "work operator"),
                   *(fields.integer(d[n], f"work {n}") for n in names))


def predict(work: Work, rates: Rates, served: bool = False) -> dict[str, float] | None:
    """Seconds per phase and ``total`` (module docstring) of a merge in a fresh process, or a ``served``
    one; None when the operator was never calibrated."""
    if work.operator not in rates.compute:
        return None
    base_read, expert_read = work.base_bytes / rates.sequential_read, work.expert_bytes / rates.random_read
    reads = base_read + expert_read
    left = 1.0 if served or reads == 0 else max(0.0, reads - rates.read_ahead_seconds) / reads  # after the loading
    seconds = {
        "startup": rates.startup(served),
        "base_read": base_read * left,
        "expert_read": expert_read * left,
        "compute": rates.compute_seconds(work.operator, work.merged_bytes, work.expert_bytes, moved_bytes(work)),
        "write": work.output_bytes / rates.write,
        "publish": rates.publish_seconds + work.output_bytes / rates.flush,
    }
    seconds["total"] = total_seconds(seconds, rates.overlap)
    return seconds


def moved_bytes(work: Work) -> int:
    """The bytes the reading and writing threads move while the worker merges: every byte read, and
    every byte written."""
    return work.base_bytes + work.expert_bytes + work.output_bytes


def total_seconds(seconds: Mapping[str, float], overlap: float) -> float:
    """The total of predicted phases: start-up, the stream, publishing (module docstring)."""
    return seconds["startup"] + stream_seconds(seconds, overlap) + seconds["publish"]


def stream_seconds(seconds: Mapping[str, float], overlap: float) -> float:
    """Reading, merging and writing at once: their longest, or their sum over ``overlap``."""
    parts = (seconds["base_read"] + seconds["expert_read"], seconds["compute"], seconds["write"])
    return max(*parts, sum(parts) / overlap)


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted seconds: on which machine, for which bytes, per phase (and ``total``)."""

    machine: str
    work: Work
    seconds: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "work": self.work.to_json(), "phases": dict(self.seconds)}

    @classmethod
    def from_json(cls, data: Any) -> Prediction:
        d = fields.keys(data, ("machine", "work", "phases"), "plan seconds")
        phases = fields.mapping(d["phases"], "plan seconds.phases")
        return cls(fields.text(d["machine"], "plan seconds.machine"), Work.from_json(d["work"]),
                   {fields.text(k, "phase"): fields.number(v, f"seconds of {k}") for k, v in phases.items()})


# ---------------------------------------------------------------- the bytes of a plan


class _Tensor(Protocol):
    name: str
    dtype: str
    nbytes: int
    numel: int


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
                sum(t.out_bytes for t in sizes.values()))


# ---------------------------------------------------------------- time budgets


@dataclass(frozen=True)
class BudgetWork:
    """What a merge costs whatever its expert budget, and how its merged bytes grow with it: at most
    ``merged_fixed + min(merged_variable, merged_per_expert_byte × expert bytes)``."""

    operator: str
    base_bytes: int
    output_bytes: int
    merged_fixed: int  # merged whatever is read (dtype conversions)
    merged_variable: int  # the most that reads can add
    merged_per_expert_byte: float  # the most one expert byte read can add


def expert_bytes_within(seconds: float, work: BudgetWork, rates: Rates, served: bool = False) -> float:
    """The most expert bytes a merge may read and still be predicted to take at most ``seconds``.

    What is left after start-up and publishing must hold each part of the stream: the reads (the base,
    then the expert bytes at the expert read rate), the compute (of the bytes merged whatever is read and
    what moving the base and the output takes from it, then of each expert byte, moved and merged, and of
    the base bytes it makes the engine merge), the write, and their sum
    over ``overlap``. Negative when even reading nothing takes longer. A conservative bound: with its
    actual merged bytes, the plan's own prediction is never above ``seconds``.

    An own-process merge's reads are ``max(0, base + E/random_read − loading)``: up to the expert bytes
    read while torch loads (``covered``) they cost nothing, and past them they grow as when served."""
    merged_rate, expert_rate = rates.compute[work.operator]
    fixed = rates.startup(served) + rates.publish_seconds
    left = seconds - fixed - work.output_bytes / rates.flush
    write = work.output_bytes / rates.write
    if write > left:
        return -1.0
    # what the threads moving the base and the output take from compute is fixed; each expert byte adds its own
    compute = (work.merged_fixed / merged_rate + rates.steal * (work.base_bytes + work.output_bytes),
               1 / expert_rate + rates.steal, 1 / merged_rate)

    def most(reads: tuple[float, float, float]) -> float:
        together = tuple(x / rates.overlap for x in (reads[0] + compute[0] + write, reads[1] + compute[1],
                                                      compute[2]))
        return min(_most_bytes(left, *part, work) for part in (reads, compute, together))

    hidden = 0.0 if served else rates.read_ahead_seconds
    base = work.base_bytes / rates.sequential_read
    covered = max(0.0, (hidden - base) * rates.random_read)
    if covered > 0:
        unread = most((0.0, 0.0, 0.0))  # every read inside the loading
        if unread < covered:
            return unread
    # past ``covered`` the reads are linear again (and >= 0), so the linear bound is the exact one
    return most((base - hidden, 1 / rates.random_read, 0.0))


def _most_bytes(left: float, fixed: float, per_byte: float, per_merged: float, work: BudgetWork) -> float:
    """The largest E with ``fixed + per_byte·E + per_merged·min(merged_variable, merged_per_expert_byte·E)``
    at most ``left`` (increasing and piecewise linear in E); negative when E = 0 is already over."""
    if fixed > left:
        return -1.0
    rho, cap = work.merged_per_expert_byte, work.merged_variable
    slope = per_byte + per_merged * rho
    most = (left - fixed) / slope if slope > 0 else math.inf
    if rho * most > cap:  # every changed block merged before the time runs out
        most = (left - fixed - per_merged * cap) / per_byte if per_byte > 0 else math.inf
    return most


def minimum_seconds(work: BudgetWork, rates: Rates, served: bool = False) -> float:
    """The predicted total of the merge reading no expert byte."""
    nothing = Work(work.operator, work.base_bytes, 0, work.merged_fixed, work.output_bytes)
    seconds = predict(nothing, rates, served)
    assert seconds is not None, "callers check the operator is calibrated"
    return seconds["total"]


def ordered_phases(seconds: Mapping[str, float], names: Sequence[str] = PHASES) -> list[tuple[str, float]]:
    """``(label, seconds)`` of the model's phases present in ``seconds``, in order, then the total."""
    rows = [(PHASE_LABELS[p], seconds[p]) for p in names if p in seconds]
    return rows + ([("total", seconds["total"])] if "total" in seconds else [])
