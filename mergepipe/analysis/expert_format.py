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

* ``lora`` (``lora_expert.py``): a PEFT LoRA adapter, ΔW = s·B·A. Its block
  reads two byte ranges, the block's rows of B (the recorded ``begin, end``)
  and all of A (the tensor's recorded span less its blocks: ``a_nbytes``);
  its cost is their sum, its hash covers both; Δ = s · B[r0:r1] @ A in fp32
  without the base; unchanged ⟺ the rows of B are zero, which only the
  values tell (analysis decodes every touched tensor). A transposed ΔW
  (``fan_in_fan_out``) records every block as both factors' span.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockRecord, TensorRecord
from mergepipe.storage.blocks import BlockSpec
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


def expert_block_bytes(catalog: Catalog, expert_id: str, base_id: str) -> Mapping[str, list[int]] | None:
    """Tensor -> what reading each block of ``expert_id`` costs, for every tensor of ``base_id``; ``None``
    for a full expert, whose blocks are the base's (same layout: analysis checks it). A tensor a delta
    or an adapter leaves out costs 0 per block: it is never read. A LoRA block costs its B rows and A."""
    fmt = expert_format(catalog.models.get(expert_id).kind)
    if fmt.needs_base:
        return None
    own = catalog.blocks.by_tensor(expert_id)
    spans = {t.name: t for t in catalog.models.tensors(expert_id)} if fmt.kind == LORA else {}
    sizes = {}
    for name, blocks in catalog.blocks.by_tensor(base_id).items():
        mine = own.get(name)
        shared = a_nbytes(spans[name], mine) if mine is not None and name in spans else 0
        sizes[name] = [b.nbytes + shared for b in mine] if mine is not None else [0] * len(blocks)
    return sizes


def read_cost(catalog: Catalog, expert_ids: Sequence[str], base_id: str) -> Callable[[str, str, BlockRecord], int]:
    """``cost(expert, tensor, base block)``: the bytes the engine reads for that block of that expert (the
    base block's size for full experts, a delta checkpoint's own)."""
    own = {e: expert_block_bytes(catalog, e, base_id) for e in expert_ids}

    def cost(expert: str, tensor: str, block: BlockRecord) -> int:
        sizes = own.get(expert)
        return block.nbytes if sizes is None else sizes[tensor][block.index]

    return cost
