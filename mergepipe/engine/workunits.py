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

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.sharding import OutputFile, mirror_layout

#: Target bytes of base data per unit: large enough that per-unit start-up
#: (opening files, a read-ahead pipeline) is negligible, small enough that
#: several workers get balanced shares of a 1 GB shard.
DEFAULT_UNIT_BYTES = 256 * 1024 * 1024
#: A target no file reaches: one unit per output file (a single worker gains nothing from smaller units).
WHOLE_FILES = sys.maxsize
#: Units per worker when a merge is shared by several: run largest first, the last units to finish are
#: small, so the workers finish within about a unit of each other instead of one worker finishing alone.
UNITS_PER_WORKER = 4


@dataclass(frozen=True)
class WorkUnit:
    """Tensors ``tensors`` (in file order) of output file ``shard``."""

    index: int
    shard: str
    tensors: tuple[str, ...]
    nbytes: int


def balanced_target(total_bytes: int, workers: int) -> int:
    """The unit size for ``workers`` sharing a merge of ``total_bytes`` of base data: whole files for one
    worker; else about ``UNITS_PER_WORKER`` units each, at most ``DEFAULT_UNIT_BYTES`` (a large model
    then gets many more units, and the balance only improves)."""
    if workers <= 1:
        return WHOLE_FILES
    return max(1, min(DEFAULT_UNIT_BYTES, -(-total_bytes // (UNITS_PER_WORKER * workers))))


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
