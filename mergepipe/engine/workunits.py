"""Cutting a plan into work units: groups of consecutive tensors of one shard,
of similar byte size.

Every output byte has a fixed offset (the coordinator creates the staged
shards with their headers first), so units are independent: each reads its
own inputs and writes its own tensors, in any order, on any worker. A tensor
is never split across units (tensor-level operators need it whole); one
larger than the target is a unit of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from mergepipe.storage.checkpoint import Checkpoint

#: Target bytes of base data per unit: large enough that per-unit start-up
#: (opening files, a read-ahead pipeline) is negligible, small enough that
#: several workers get balanced shares of a 1 GB shard.
DEFAULT_UNIT_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class WorkUnit:
    """Tensors ``tensors`` (in file order) of output shard ``shard``."""

    index: int
    shard: str
    tensors: tuple[str, ...]
    nbytes: int


def cut_units(base: Checkpoint, target_bytes: int = DEFAULT_UNIT_BYTES) -> list[WorkUnit]:
    """The units of a merge whose output mirrors ``base``, in output order."""
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    units: list[WorkUnit] = []
    for file in base.files:
        names: list[str] = []
        size = 0
        for entry in file.header.tensors.values():
            if names and entry.nbytes >= target_bytes:  # a big tensor is a unit of its own
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
            names.append(entry.name)
            size += entry.nbytes
            if size >= target_bytes:
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
        if names or not file.header.tensors:
            units.append(WorkUnit(len(units), file.name, tuple(names), size))
    return units
