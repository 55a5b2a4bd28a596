"""Expert formats: how an expert's bytes become its delta Δ, and what reading them costs.

Everything after registration works on Δ = E − B per block of the *base's*
geometry (plans address blocks by index): statistics and trim thresholds
(``analyze``), the planner's units, the engine's kernels. An expert format
is how one kind of expert (``ModelRecord.kind``) meets that contract:

1. **Geometry** (``register``): for every base tensor it holds, the expert
   records blocks with the base's row ranges, block for block (same index,
   ``row_start``, ``row_end``), and the byte range in its own files that
   holds those rows (``aligned_block``). A tensor the expert does not hold
   has Δ = 0: no rows, never read, every block unchanged.
2. **Unchanged blocks** (``analyze``): blocks known to have Δ = 0 from hashes
   alone are recorded ``identical``: they cost nothing and are never read
   (``unchanged_flags``). The blake3 of every block's bytes is recorded, so
   the engine checks every byte it reads.
3. **Cost** (``planner``): one (expert, block) read costs the expert's
   recorded block bytes (``expert_block_bytes``); the engine's byte counters
   count exactly those ranges, so realized ≤ planned ≤ budget holds per
   expert whatever its dtype.
4. **Decode** (``engine/compute.py``, ``analyze``): the block's bytes as fp32,
   then Δ: minus the base block's fp32 values when ``needs_base``.

The formats:

* ``checkpoint`` (and ``snapshot``, a merge used as an expert): full weights
  with the base's layout; Δ = fp32(E) − fp32(B); unchanged ⟺ the block's hash
  equals the base block's.
* ``delta`` (``delta_checkpoint.py``): Δ itself, in F32, F16 or BF16 (the
  base's dtype or not: its blocks have the base's rows and their own byte
  sizes); Δ = fp32(bytes); unchanged ⟺ every byte is zero (+0.0: a −0.0 is
  what fp32(E) − fp32(B) gives where the expert holds −0 and the base +0,
  a block a full expert reads too).

* ``lora`` (``lora_expert.py``): a PEFT LoRA adapter, ΔW = s·B·A. A block
  needs its rows of B (the recorded ``begin, end``) and all of A (the
  tensor's recorded span less its blocks: ``a_nbytes``); its hash covers
  both; Δ = s · B[r0:r1] @ A in fp32 without the base; unchanged ⟺ the rows
  of B are zero, which only the values tell (analysis decodes every touched
  tensor). A transposed ΔW (``fan_in_fan_out``) records every block as both
  factors' span.

**Shared bytes.** Every block of a LoRA tensor needs all of A, so the
engine reads A once per tensor, with the first block it reads, and keeps it
for the others: a block costs its rows of B (``expert_block_bytes``), and A
is a *shared* cost, paid once for a tensor whenever any of its blocks is
read (``expert_shared_bytes``; a transposed ΔW's blocks cost 0 and its
whole span is shared). A 100% budget so reads every factor byte once. The
planner takes an adapter's tensor whole (one unit: its B rows and A), so
what it counts is what is read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockRecord, TensorRecord
from mergepipe.storage.geometry import BlockSpec
from mergepipe.storage.format import TensorEntry
from mergepipe.storage.hashing import block_digest

FULL = "checkpoint"
DELTA = "delta"
LORA = "lora"


@dataclass(frozen=True)
class ExpertFormat:
    """One kind of expert (see the module docstring)."""

    kind: str
    #: Δ of a block needs the base block's values (full weights); a delta holds Δ itself.
    needs_base: bool

    def unchanged_flags(self, hashes: Sequence[str | None], base_hashes: Sequence[str | None],
                        blocks: Sequence[BlockRecord]) -> list[bool]:
        """Per block: known from hashes to have Δ = 0 (an unknown hash is not)."""
        if self.needs_base:
            return [h is not None and h == b for h, b in zip(hashes, base_hashes)]
        if self.kind == LORA:  # every hash covers A too: only zero B rows say Δ = 0 (analysis reads them)
            return [False] * len(blocks)
        return [h is not None and h == zero_digest(block.nbytes) for h, block in zip(hashes, blocks)]


_FORMATS = {
    "checkpoint": ExpertFormat(FULL, needs_base=True),
    "snapshot": ExpertFormat(FULL, needs_base=True),
    "delta": ExpertFormat(DELTA, needs_base=False),
    "lora": ExpertFormat(LORA, needs_base=False),
}


def expert_format(kind: str) -> ExpertFormat:
    """The format of a model of ``kind`` used as an expert."""
    try:
        return _FORMATS[kind]
    except KeyError:
        raise ValueError(f"no expert format for model kind {kind!r}") from None


@functools.lru_cache(maxsize=64)
def zero_digest(nbytes: int) -> str:
    """The blake3 of ``nbytes`` zero bytes: the hash of an all-(+0.0) delta block of that size."""
    return block_digest(bytes(nbytes))


def aligned_block(entry: TensorEntry, base_block: BlockSpec) -> BlockSpec:
    """The expert's block holding the rows of ``base_block``: same index and rows, the byte range of
    those rows in ``entry`` (another dtype than the base's has other byte offsets)."""
    return BlockSpec(
        index=base_block.index,
        row_start=base_block.row_start,
        row_end=base_block.row_end,
        begin=entry.begin + base_block.row_start * entry.row_bytes,
        end=entry.begin + base_block.row_end * entry.row_bytes,
        row_numel=entry.row_numel,
    )


def aligned_records(entry: TensorEntry, base_blocks: Sequence[BlockRecord]) -> list[BlockRecord]:
    """The catalog rows of ``entry``'s blocks on the base's rows (hashes unknown until analysed)."""
    return [
        BlockRecord(entry.name, b.index, b.row_start, b.row_end,
                    entry.begin + b.row_start * entry.row_bytes, entry.begin + b.row_end * entry.row_bytes, None)
        for b in base_blocks
    ]


def a_nbytes(tensor: TensorRecord, blocks: Sequence[BlockRecord]) -> int:
    """Bytes of factor A of a LoRA tensor, which every block reads: its recorded span (both factors) less
    the rows of B its blocks cover; 0 where every block is recorded as the whole span (a transposed ΔW)."""
    if all((b.begin, b.end) == (tensor.begin, tensor.end) for b in blocks):
        return 0
    return tensor.nbytes - sum(b.nbytes for b in blocks)


def _lora_costs(tensor: TensorRecord, blocks: Sequence[BlockRecord]) -> tuple[list[int], int]:
    """(what each block of a LoRA tensor costs, what the tensor's reads share): B's rows and A, or 0 per
    block and the whole span for a transposed ΔW (whose blocks are each recorded as the span)."""
    shared = a_nbytes(tensor, blocks)
    if shared == 0:
        return [0] * len(blocks), tensor.nbytes
    return [b.nbytes for b in blocks], shared


def expert_block_bytes(catalog: Catalog, expert_id: str, base_id: str) -> Mapping[str, list[int]] | None:
    """Tensor -> what reading each block of ``expert_id`` costs, for every tensor of ``base_id``; ``None``
    for a full expert, whose blocks are the base's (same layout: analysis checks it). A tensor a delta
    or an adapter leaves out costs 0 per block: it is never read. A LoRA block costs its B rows (A is
    shared: ``expert_shared_bytes``)."""
    fmt = expert_format(catalog.models.get(expert_id).kind)
    if fmt.needs_base:
        return None
    own = catalog.blocks.by_tensor(expert_id)
    spans = {t.name: t for t in catalog.models.tensors(expert_id)} if fmt.kind == LORA else {}
    sizes = {}
    for name, blocks in catalog.blocks.by_tensor(base_id).items():
        mine = own.get(name)
        if mine is None:
            sizes[name] = [0] * len(blocks)
        else:
            sizes[name] = _lora_costs(spans[name], mine)[0] if name in spans else [b.nbytes for b in mine]
    return sizes


def expert_shared_bytes(catalog: Catalog, expert_id: str) -> Mapping[str, int]:
    """Tensor -> the bytes ``expert_id`` reads once per tensor whenever it reads any block of it (a LoRA
    adapter's A, module docstring); empty for the other formats."""
    if expert_format(catalog.models.get(expert_id).kind).kind != LORA:
        return {}
    own = catalog.blocks.by_tensor(expert_id)
    return {t.name: _lora_costs(t, own[t.name])[1] for t in catalog.models.tensors(expert_id) if t.name in own}


@dataclass(frozen=True)
class ReadCost:
    """What the engine reads of experts' blocks: ``block(expert, tensor, base block)`` per block (the base
    block's size for full experts, a delta checkpoint's or adapter's own), and ``shared(expert, tensor)``
    once per tensor of which any block is read."""

    own: Mapping[str, Mapping[str, list[int]] | None]
    shared_bytes: Mapping[str, Mapping[str, int]]

    def block(self, expert: str, tensor: str, block: BlockRecord) -> int:
        sizes = self.own.get(expert)
        return block.nbytes if sizes is None else sizes[tensor][block.index]

    def shared(self, expert: str, tensor: str) -> int:
        return self.shared_bytes.get(expert, {}).get(tensor, 0)

    def tensor(self, expert: str, tensor: str, blocks: Sequence[BlockRecord]) -> int:
        """The bytes reading ``blocks`` of one expert's tensor costs: theirs, and the shared part if any."""
        if not blocks:
            return 0
        return sum(self.block(expert, tensor, b) for b in blocks) + self.shared(expert, tensor)


def read_cost(catalog: Catalog, expert_ids: Sequence[str], base_id: str) -> ReadCost:
    """The read costs of ``expert_ids``' blocks against ``base_id``."""
    return ReadCost({e: expert_block_bytes(catalog, e, base_id) for e in expert_ids},
                    {e: expert_shared_bytes(catalog, e) for e in expert_ids})
