"""Execute a copy plan (a passthrough, ``spec/copy_map.py``): every output tensor is one source tensor,
copied block by block into the staged shards.

This is the engine's stream without a kernel, inside the same publish (``engine.py``: staging, manifest,
rename, commit). The output cannot mirror the base's files, since its tensors are others: its files are
shards of the plan's ``out_shard_bytes``, else of ``DEFAULT_SHARD_BYTES``, holding the tensors in the
map's order. Each shard is created with its header first (fixed offsets); then every block of every
source tensor is read by the read-ahead, checked against the blake3 analysis recorded for it (a source
changed on disk aborts the merge, naming it), converted to the output dtype where the plan has one
(float tensors only; torch's round to nearest even, as mergekit's cast), and queued to the write-behind,
which feeds the file's streamed hash. A copy has nothing to compute that other workers could share, so
it runs in this process whatever the executor. Bytes read are counted per source under the engine's
tags (the base's ``base``), and the realized cost must be the plan's to the byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from mergepipe.analysis.opening import open_registered
from mergepipe.catalog import Catalog
from mergepipe.engine.job import BASE_TAG, output_dtype
from mergepipe.engine.record import write_side_files
from mergepipe.engine.stream import file_digests, file_hashers
from mergepipe.errors import EngineError, ModelChangedError
from mergepipe.manifest.parts import RealizedCost
from mergepipe.progress import Advance, byte_progress
from mergepipe.spec.copy_map import TensorCopy
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.convert import to_bytes, to_float32
from mergepipe.storage.format import DTYPE_SIZES, TensorEntry
from mergepipe.storage.geometry import BlockSpec, tensor_blocks
from mergepipe.storage.hashing import FileHash, block_digest
from mergepipe.storage.location import RemotePath
from mergepipe.storage.readahead import BlockCheck, ByteRange, Fetched, ReadAhead, WorkItem
from mergepipe.storage.remote import TransferMeter
from mergepipe.storage.remote_source import CheckpointSource
from mergepipe.storage.sharding import packed_layout
from mergepipe.storage.writebehind import WriteBehind
from mergepipe.storage.writer import ShardLayout, ShardWriter, create_shard

#: The largest output shard when the plan sets none: mergekit's and transformers' default (5 GB).
DEFAULT_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class _Piece:
    """One block of a source tensor, and the output tensor it goes to."""

    copy: TensorCopy
    entry: TensorEntry
    block: BlockSpec


@dataclass(frozen=True)
class _Sources:
    """The plan's opened sources, the tag each one's reads are counted under and its recorded hashes."""

    checkpoints: Mapping[str, Checkpoint]
    tags: Mapping[str, str]
    hashes: Mapping[str, Mapping[str, list[str | None]]]

    def entry(self, copy: TensorCopy) -> TensorEntry:
        return self.checkpoints[copy.model].tensor(copy.tensor)


def copy_snapshot(catalog: Catalog, plan: Plan, staging: Path, window_bytes: int, io_threads: int,
                  progress: bool) -> tuple[RealizedCost, dict[str, str]]:
    """Write the copy plan ``plan``'s weight files and side files into ``staging``; the realized cost
    (checked against the plan) and each weight file's hash, streamed as it was written."""
    copies = plan.copies
    assert copies is not None, "copy_snapshot executes copy plans"
    models = list(dict.fromkeys([plan.base.id, *copies.models]))
    # each checked against its registration; the base's side files too: the output gets them
    checkpoints = {m: open_registered(catalog, m, sides=m == plan.base.id) for m in models}
    sources = _Sources(checkpoints, {m: BASE_TAG if m == plan.base.id else m for m in models},
                       {m: catalog.blocks.hashes(m) for m in models})
    entries = {c.output: sources.entry(c) for c in copies.copies}
    base = checkpoints[plan.base.id]
    layout = packed_layout([(name, _out_bytes(plan, e)) for name, e in entries.items()],
                           plan.out_shard_bytes or DEFAULT_SHARD_BYTES, base.files[0].header.metadata)
    shards = {f.name: create_shard(staging / f.name, [(n, output_dtype(plan, entries[n]), entries[n].shape)
                                                       for n in f.tensors], f.metadata) for f in layout.files}
    hashers = file_hashers(shards)
    remote = any(isinstance(c.root, RemotePath) for c in checkpoints.values())
    seconds = {"read_wait": 0.0, "compute": 0.0, "write": 0.0, "write_wait": 0.0}
    written = 0
    bar = byte_progress("copy", plan.cost.output_bytes, progress)
    with CheckpointSource(TransferMeter() if remote else None) as source, bar as advance:
        readahead = ReadAhead(source, source.read_threads(io_threads), window_bytes, on_read=_verifier(sources))
        by_name = {c.output: c for c in copies.copies}
        for file in layout.files:
            items = source.planned(_items(plan, sources, [by_name[n] for n in file.tensors]))
            written += _write_file(plan, shards[file.name], hashers, readahead.run(items), seconds, advance)
        by_tag, requests = source.bytes_by_tag(), source.requests_by_tag()
    write_side_files(plan, base, layout, sum(_out_bytes(plan, e) for e in entries.values()), staging)
    header_bytes = sum(shard.data_start for shard in shards.values())
    return _realized(plan, by_tag, requests, header_bytes + written, seconds), file_digests(hashers)


def _out_bytes(plan: Plan, entry: TensorEntry) -> int:
    return entry.numel * DTYPE_SIZES[output_dtype(plan, entry)]


def _items(plan: Plan, sources: _Sources, copies: list[TensorCopy]) -> Iterator[WorkItem]:
    """A read per block of each source tensor, with the check of its recorded hash."""
    for copy in copies:
        entry = sources.entry(copy)
        recorded = sources.hashes[copy.model][copy.tensor]
        path = sources.checkpoints[copy.model].file_of(copy.tensor).path
        for block in tensor_blocks(entry, plan.block_bytes):
            if not block.nbytes:  # an empty tensor needs no bytes
                continue
            digest = recorded[block.index]
            assert digest is not None, "a copy plan is made only once its sources are hashed (copy_plan.py)"
            check = BlockCheck(block.index, block.begin, block.end, digest)
            read = ByteRange(path, block.begin, block.end, sources.tags[copy.model], copy.tensor, (check,))
            yield WorkItem(_Piece(copy, entry, block), [read])


def _write_file(plan: Plan, shard: ShardLayout, hashers: Mapping[str, FileHash], fetches: Iterator[Fetched],
                seconds: dict[str, float], advance: Advance) -> int:
    """Write one output shard from its fetched source blocks; the data bytes written."""
    writer = ShardWriter(shard, hasher=hashers[shard.path.name])
    with writer:
        with WriteBehind() as behind:  # written (and hashed) on its own thread while the next block is read
            while True:
                started = time.perf_counter()
                fetched = next(fetches, None)
                seconds["read_wait"] += time.perf_counter() - started
                if fetched is None:
                    break
                piece: _Piece = fetched.item.payload
                entry, block, dtype = piece.entry, piece.block, output_dtype(plan, piece.entry)
                offset = block.row_start * entry.row_numel * DTYPE_SIZES[dtype]
                if dtype == entry.dtype:  # the source's bytes as they are: the buffer goes back once written
                    behind.write(writer, piece.copy.output, offset, fetched.views[0], fetched.release)
                    advance(block.nbytes, piece.copy.output)
                    continue
                started = time.perf_counter()
                shape = (block.num_rows, *entry.shape[1:]) if len(entry.shape) >= 2 else entry.shape
                data = to_bytes(to_float32(fetched.views[0], entry.dtype, shape), dtype)
                fetched.release()
                seconds["compute"] += time.perf_counter() - started
                behind.write(writer, piece.copy.output, offset, data)
                advance(len(data), piece.copy.output)
        seconds["write"] += behind.write_seconds
        seconds["write_wait"] += behind.wait_seconds
        writer.finish()
        return writer.bytes_written


def _verifier(sources: _Sources) -> Callable[[WorkItem, list[memoryview]], None]:
    """The read-ahead's ``on_read``: every block must hash to what analysis recorded."""
    model_of = {tag: model for model, tag in sources.tags.items()}

    def verify(item: WorkItem, views: list[memoryview]) -> None:
        for read, view in zip(item.reads, views):
            for check in read.checks:
                if block_digest(view[check.begin - read.begin : check.end - read.begin]) != check.digest:
                    raise ModelChangedError(
                        f"model '{model_of[read.tag]}' changed on disk since it was analysed: block {check.index} "
                        f"of tensor '{read.tensor}' in {read.path} no longer matches its recorded hash; nothing "
                        "was published. Re-register it (`mergepipe register --force`), analyse it and plan again"
                    )

    return verify


def _realized(plan: Plan, by_tag: Mapping[str, int], requests: Mapping[str, int], output_bytes: int,
              seconds: dict[str, float]) -> RealizedCost:
    """The realized cost, which must be the plan's: a copy reads exactly what its map names."""
    experts = {e.id: by_tag.get(e.id, 0) for e in plan.experts}
    base_bytes = by_tag.get(BASE_TAG, 0)
    if experts != plan.cost.expert_bytes_by_model or base_bytes != plan.cost.base_bytes:
        raise EngineError(f"internal error: the copy read {base_bytes} base bytes and {experts} of the other "
                          f"sources, not the planned {plan.cost.base_bytes} and {plan.cost.expert_bytes_by_model}; "
                          "please report it")
    return RealizedCost(
        base_bytes=base_bytes,
        expert_bytes=sum(experts.values()),
        output_bytes=output_bytes,
        expert_bytes_by_model=experts,
        seconds=seconds,
        requests_by_model={plan.base.id if tag == BASE_TAG else tag: n for tag, n in requests.items()},
    )
