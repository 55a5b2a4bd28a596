"""Cutting a plan into work units: groups of consecutive tensors of one output
file, of similar byte size.

Every output byte has a fixed offset (the coordinator creates the staged
shards with their headers first), so units are independent: each reads its
own inputs and writes its own tensors, in any order, on any worker. A tensor
is never split across units (tensor-level operators need it whole); one
larger than the target is a unit of its own. Output files are the base's
(mirrored) or shards of another size: a unit's tensors may then come from
several base files, each read from the file that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.sharding import OutputFile, mirror_layout

#: Target bytes of base data per unit: large enough that per-unit start-up
#: (opening files, a read-ahead pipeline) is negligible, small enough that
#: several workers get balanced shares of a 1 GB shard.
DEFAULT_UNIT_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class WorkUnit:
    """Tensors ``tensors`` (in file order) of output file ``shard``."""

    index: int
    shard: str
    tensors: tuple[str, ...]
    nbytes: int


def cut_units(base: Checkpoint, target_bytes: int = DEFAULT_UNIT_BYTES,
              files: Sequence[OutputFile] | None = None) -> list[WorkUnit]:
    """The units of a merge of ``base`` into the output ``files`` (by default the base's own), in output
    order; a unit's size counts the base bytes of its tensors."""
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    units: list[WorkUnit] = []
    for file in mirror_layout(base).files if files is None else files:
        names: list[str] = []
        size = 0
        for entry in (base.tensor(name) for name in file.tensors):
            if names and entry.nbytes >= target_bytes:  # a big tensor is a unit of its own
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
            names.append(entry.name)
            size += entry.nbytes
            if size >= target_bytes:
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
        if names or not file.tensors:
            units.append(WorkUnit(len(units), file.name, tuple(names), size))
    return units
