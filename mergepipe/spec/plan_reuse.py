"""The part of a plan that reuses an earlier snapshot's output (``merge --from``).

An incremental merge is the from-scratch plan (same reads, same result) plus
this record: which output blocks are copied from the previous snapshot
because the catalog shows they would be computed from exactly the same
inputs (``analysis/provenance.py``), and what that saves. The engine reads
those blocks from the previous snapshot's files, checked against the hashes
recorded when it was published, instead of reading base and expert blocks.

With ``--delta-update`` (fixed-coefficient operators only) a block whose
only changed inputs are new versions of experts (``replaced``: new id ->
old id) is *updated*: ``new = old + Σ c·(E_new − E_old)`` from the previous
output, reading only the replaced experts' two blocks. Not bit-identical
(the previous output was rounded to its dtype): ``errors`` bounds, per
block, how far it may be from the from-scratch merge (a block updated again
adds to what it inherits), and a delta-update merge may reuse such blocks,
carrying their bound; a merge without ``--delta-update`` never does.
``bound`` is the Frobenius norm over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mergepipe.spec import fields
from mergepipe.spec.ranges import compress_indices, expand_ranges


@dataclass(frozen=True)
class PlanReuse:
    """Output blocks taken from a previous snapshot instead of being merged again."""

    snapshot: str  # the previous snapshot's model id
    manifest_hash: str  # its manifest hash, as the catalog recorded it at publish time
    # tensor name -> output block indices copied from it (sorted)
    blocks: dict[str, tuple[int, ...]]
    output_bytes: int  # bytes of those blocks (output dtype): read from the previous snapshot
    # expert id -> bytes of its planned blocks that need not be read (negative: a replaced expert's
    # earlier version is read for delta updates)
    saved: dict[str, int] = field(default_factory=dict)
    # tensor name -> output blocks updated from the previous output (delta updates)
    updated: dict[str, tuple[int, ...]] = field(default_factory=dict)
    updated_bytes: int = 0  # bytes of those blocks: read from the previous snapshot too
    replaced: dict[str, str] = field(default_factory=dict)  # expert id -> the version it replaced
    bound: float = 0.0  # Frobenius norm the output may differ from the from-scratch merge by
    # tensor -> block -> its bound (updated blocks, and reused blocks that were updated before)
    errors: dict[str, dict[int, float]] = field(default_factory=dict)
    # tensor -> block -> the fp32 arithmetic term of an updated block's bound, from which the engine
    # computes its a-posteriori bound (planner/delta_update.py); in JSON only when there are updates, so
    # other plans keep their digests
    slack: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def block_count(self) -> int:
        return sum(len(ix) for ix in self.blocks.values())

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    @property
    def updated_count(self) -> int:
        return sum(len(ix) for ix in self.updated.values())

    def reuses(self, tensor: str, block: int) -> bool:
        return block in self.blocks.get(tensor, ())

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot": self.snapshot,
            "manifest": self.manifest_hash,
            "blocks": {t: compress_indices(ix) for t, ix in sorted(self.blocks.items()) if ix},
            "bytes": self.output_bytes,
            "saved": dict(sorted(self.saved.items())),
            "updated": {t: compress_indices(ix) for t, ix in sorted(self.updated.items()) if ix},
            "updated_bytes": self.updated_bytes,
            "replaced": dict(sorted(self.replaced.items())),
            "bound": self.bound,
            "errors": _per_block(self.errors),
            **({"slack": _per_block(self.slack)} if self.slack else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> PlanReuse:
        d = fields.keys(data, ("snapshot", "manifest", "blocks", "bytes", "saved", "updated", "updated_bytes",
                               "replaced", "bound", "errors"), "plan reuse", optional=("slack",))
        blocks, updated = (
            {t: tuple(expand_ranges(fields.array(r, f"{what} blocks of {t}")))
             for t, r in fields.mapping(d[key], f"plan reuse {key}").items()}
            for key, what in (("blocks", "reused"), ("updated", "updated"))
        )
        return cls(
            snapshot=fields.text(d["snapshot"], "plan reuse snapshot"),
            manifest_hash=fields.text(d["manifest"], "plan reuse manifest"),
            blocks=blocks,
            output_bytes=fields.integer(d["bytes"], "plan reuse bytes"),
            saved={e: fields.integer(n, f"bytes of {e} saved by reuse", minimum=None)
                   for e, n in fields.mapping(d["saved"], "plan reuse saved").items()},
            updated=updated,
            updated_bytes=fields.integer(d["updated_bytes"], "plan reuse updated_bytes"),
            replaced={e: fields.text(v, f"version {e} replaced")
                      for e, v in fields.mapping(d["replaced"], "plan reuse replaced").items()},
            bound=fields.number(d["bound"], "plan reuse bound"),
            errors=_read_per_block(d["errors"], "error"),
            slack=_read_per_block(d.get("slack", {}), "slack"),
        )


def _per_block(values: dict[str, dict[int, float]]) -> dict[str, list[list[float]]]:
    """tensor -> [[block, value], ...] in block order, tensors without values left out."""
    return {t: [[b, e] for b, e in sorted(per.items())] for t, per in sorted(values.items()) if per}


def _read_per_block(data: Any, what: str) -> dict[str, dict[int, float]]:
    """``_per_block``'s JSON, checked."""
    return {t: {fields.integer(p[0], f"block of {t}"): fields.number(p[1], f"{what} of {t}")
                for p in (fields.array(x, f"{what} of {t}") for x in fields.array(v, f"{what}s of {t}"))}
            for t, v in fields.mapping(data, f"plan reuse {what}").items()}
