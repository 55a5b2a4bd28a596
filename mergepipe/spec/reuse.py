"""The part of a plan that reuses an earlier snapshot's output (``merge --from``).

An incremental merge is the from-scratch plan (same reads, same result) plus
this record: which output blocks are copied from the previous snapshot
because the catalog shows they would be computed from exactly the same
inputs (``analysis/provenance.py``), and what that saves. The engine reads
those blocks from the previous snapshot's files, checked against the hashes
recorded when it was published, instead of reading base and expert blocks.
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
    # expert id -> bytes of its planned blocks that need not be read
    saved: dict[str, int] = field(default_factory=dict)

    @property
    def block_count(self) -> int:
        return sum(len(ix) for ix in self.blocks.values())

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    def reuses(self, tensor: str, block: int) -> bool:
        return block in self.blocks.get(tensor, ())

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot": self.snapshot,
            "manifest": self.manifest_hash,
            "blocks": {t: compress_indices(ix) for t, ix in sorted(self.blocks.items()) if ix},
            "bytes": self.output_bytes,
            "saved": dict(sorted(self.saved.items())),
        }

    @classmethod
    def from_json(cls, data: Any) -> PlanReuse:
        d = fields.keys(data, ("snapshot", "manifest", "blocks", "bytes", "saved"), "plan reuse")
        blocks = {
            t: tuple(expand_ranges(fields.array(r, f"reused blocks of {t}")))
            for t, r in fields.mapping(d["blocks"], "plan reuse blocks").items()
        }
        return cls(
            snapshot=fields.text(d["snapshot"], "plan reuse snapshot"),
            manifest_hash=fields.text(d["manifest"], "plan reuse manifest"),
            blocks=blocks,
            output_bytes=fields.integer(d["bytes"], "plan reuse bytes"),
            saved={e: fields.integer(n, f"bytes of {e} saved by reuse")
                   for e, n in fields.mapping(d["saved"], "plan reuse saved").items()},
        )
