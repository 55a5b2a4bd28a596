"""Analyse registered models: block content hashes and (expert, base) delta statistics.

Analysis is paid once per expert and reused by every later plan, so it must
be cheap: it reads every needed byte exactly once per call and does all work
on that one buffer.

* Every model gets a blake3 hash per block (block geometry from the catalog).
* Every expert analysed against a base gets, per block, statistics of
  Δ = E − B in fp32 (‖Δ‖₂, max|Δ|, non-zeros, identical-to-base), and per
  mergeable tensor exact trim thresholds at every density of ``DENSITY_GRID``
  (complements for breadcrumbs, e.g. the top γ to drop, are grid values too;
  an off-grid density falls back to a whole-tensor computation in the engine).

How it stays fast: tensors are processed base-major (base tensor read once,
then that tensor of every expert), each tensor in one read; a background
thread reads and hashes the next tensor while the main thread computes
statistics of the current one with a few vectorised torch ops over the whole
tensor (blocks are equal-sized row ranges, so per-block sums are a reshape);
buffers are pooled. Blocks known to be identical (equal hashes) are never
converted, and tensors whose hashes are already known to be equal are not
even read.

Non-mergeable tensors (integer, F64, FP8 dtypes) are carried through from the
base by the engine and never merged, so only their identical flags are
recorded (statistics ``None``, no thresholds). A NaN or Inf in a delta is
refused: the thresholds and error bounds would be meaningless.

Each (expert, base) result and each model's new hashes are written in one
transaction after all reads finish, so an interruption records nothing
half-done, and a re-run skips what is recorded (reading nothing for it).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.prefetch import BufferPool, prefetch_reads
from mergepipe.catalog.records import BlockDelta, BlockRecord, ModelRecord, TensorRecord, TensorStats
from mergepipe.catalog.thresholds import DENSITY_GRID, TrimThreshold, kept_count, trim_thresholds
from mergepipe.errors import CatalogError, LayoutMismatchError
from mergepipe.storage.convert import MERGEABLE_DTYPES, raw_view, to_float32
from mergepipe.storage.reader import BlockReader
from mergepipe.threads import compute_threads

# Layout differences listed in a mismatch message.
_MAX_DIFFERENCES = 5


@dataclass(frozen=True)
class AnalyzeReport:
    """What one ``analyze`` call did and what it cost."""

    base_id: str | None
    hashed: tuple[str, ...]
    analyzed: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_read: int
    bytes_by_model: dict[str, int]
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "base_id": self.base_id,
            "hashed": list(self.hashed),
            "analyzed": list(self.analyzed),
            "skipped": list(self.skipped),
            "bytes_read": self.bytes_read,
            "bytes_by_model": dict(self.bytes_by_model),
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class _Read:  # a prefetch.TensorRead
    """One whole-tensor read of one model."""

    model_id: str
    role: str  # "base", "expert" or "hash"
    tensor: TensorRecord
    path: Path
    blocks: list[BlockRecord]
    needs_hash: bool


@dataclass
class _Job:
    """Everything one analyze call knows before it reads, and what it computes."""

    base_id: str | None
    records: dict[str, ModelRecord]
    tensors: dict[str, list[TensorRecord]]
    blocks: dict[str, dict[str, list[BlockRecord]]]
    experts: list[str]  # to analyse against base_id
    skipped: list[str]
    schedule: list[_Read] = field(default_factory=list)
    new_hashes: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    deltas: dict[str, list[BlockDelta]] = field(default_factory=dict)
    stats: dict[str, list[TensorStats]] = field(default_factory=dict)

    def hashes(self, model_id: str, tensor: str) -> list[str | None]:
        computed = self.new_hashes.get(model_id, {}).get(tensor)
        if computed is not None:
            return list(computed)
        return [b.hash for b in self.blocks[model_id][tensor]]


def analyze(
    catalog: Catalog,
    model_ids: Sequence[str] | None = None,
    base_id: str | None = None,
    progress: bool = True,
) -> AnalyzeReport:
    """Hash ``model_ids`` and, with ``base_id``, analyse each against the base.

    ``model_ids=None`` means every registered checkpoint (not snapshots)
    other than the base when a base is given, and every model otherwise.
    """
    start = time.perf_counter()
    job = _prepare(catalog, model_ids, base_id)
    with BlockReader() as reader, compute_threads():
        _run(job, reader, progress)
        bytes_read, by_model = reader.bytes_read, reader.bytes_by_tag()
    _record(catalog, job)
    hashed = tuple(m for m in job.records if m in job.new_hashes)
    return AnalyzeReport(
        base_id=base_id,
        hashed=hashed,
        analyzed=tuple(job.experts),
        skipped=tuple(job.skipped),
        bytes_read=bytes_read,
        bytes_by_model=by_model,
        seconds=time.perf_counter() - start,
    )


# --------------------------------------------------------------------------- planning


def _prepare(catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None) -> _Job:
    if base_id is not None:
        catalog.get_model(base_id)
    if model_ids is None:
        models = catalog.list_models()
        if base_id is not None:
            models = [m for m in models if m.kind == "checkpoint" and m.id != base_id]
        ids = [m.id for m in models]
    else:
        ids = list(dict.fromkeys(model_ids))
    records = {m: catalog.get_model(m) for m in ([base_id] if base_id else []) + ids}

    experts: list[str] = []
    skipped: list[str] = []
    if base_id is not None:
        for m in ids:
            if m == base_id:
                continue
            (skipped if catalog.is_analyzed(m, base_id) else experts).append(m)

    tensors = {m: catalog.tensors(m) for m in records}
    for expert in experts:
        _check_layout(expert, tensors[expert], base_id, tensors[base_id])  # type: ignore[arg-type]
    for m in records:
        catalog.open_checkpoint(m)  # refuses a model changed on disk since registration
    job = _Job(
        base_id=base_id,
        records=records,
        tensors=tensors,
        blocks={m: catalog.blocks(m) for m in records},
        experts=experts,
        skipped=skipped,
    )
    _schedule(job)
    return job


def _check_layout(expert: str, expert_tensors: list[TensorRecord], base: str, base_tensors: list[TensorRecord]) -> None:
    mine = {t.name: t for t in expert_tensors}
    theirs = {t.name: t for t in base_tensors}
    problems = []
    for name, b in theirs.items():
        e = mine.get(name)
        if e is None:
            problems.append(f"tensor '{name}' is missing")
        elif e.shape != b.shape:
            problems.append(f"'{name}' has shape {list(e.shape)}, base {list(b.shape)}")
        elif e.dtype != b.dtype:
            problems.append(f"'{name}' is {e.dtype}, base {b.dtype}")
    problems.extend(f"extra tensor '{name}'" for name in mine if name not in theirs)
    if problems:
        shown = "; ".join(problems[:_MAX_DIFFERENCES])
        more = f"; … {len(problems) - _MAX_DIFFERENCES} more" if len(problems) > _MAX_DIFFERENCES else ""
        raise LayoutMismatchError(
            f"expert '{expert}' does not match the layout of base '{base}' "
            f"({len(problems)} difference{'s' if len(problems) > 1 else ''}: {shown}{more}); "
            "analyse it against a base of the same architecture and size"
        )


def _all_known(hashes: list[str | None]) -> bool:
    return all(h is not None for h in hashes)


def _schedule(job: _Job) -> None:
    """Decide which tensors of which models to read, in read order.

    (expert, tensor) pairs whose result follows from known hashes alone are
    recorded right here, without a read.
    """
    roots = {m: Path(r.uri) for m, r in job.records.items()}

    def read(model_id: str, role: str, t: TensorRecord) -> _Read:
        blocks = job.blocks[model_id][t.name]
        needs_hash = not _all_known([b.hash for b in blocks])
        return _Read(model_id, role, t, roots[model_id], blocks, needs_hash)

    base = job.base_id
    if base is not None:
        expert_tensors = {e: {t.name: t for t in job.tensors[e]} for e in job.experts}
        for e in job.experts:
            job.deltas[e], job.stats[e] = [], []
        for bt in job.tensors[base]:
            base_hashes = [b.hash for b in job.blocks[base][bt.name]]
            mergeable = bt.dtype in MERGEABLE_DTYPES
            expert_reads = []
            need_base = not _all_known(base_hashes)
            for e in job.experts:
                et = expert_tensors[e][bt.name]
                e_hashes = [b.hash for b in job.blocks[e][bt.name]]
                known = _all_known(e_hashes) and _all_known(base_hashes)
                if known and (not mergeable or e_hashes == base_hashes):
                    flags = [x == y for x, y in zip(e_hashes, base_hashes)]
                    _record_from_hashes(job, e, bt, all(flags), flags)
                    continue
                expert_reads.append(read(e, "expert", et))
                need_base = need_base or mergeable
            if need_base:
                job.schedule.append(read(base, "base", bt))
            job.schedule.extend(expert_reads)
    for m in job.records:
        if m == base or m in job.experts:
            continue
        job.schedule.extend(
            read(m, "hash", t) for t in job.tensors[m] if not _all_known([b.hash for b in job.blocks[m][t.name]])
        )


# ------------------------------------------------------------------------- statistics


def _zero_thresholds(numel: int) -> dict[float, TrimThreshold]:
    """Thresholds of an all-zero |Δ|: tau 0, the first k entries kept (what
    ``trim_thresholds`` returns for zeros; a test pins the equality)."""
    if numel == 0:
        return {t.density: t for t in trim_thresholds(torch.zeros(0), DENSITY_GRID)}
    return {
        d: TrimThreshold(float(d), kept_count(d, numel), 0.0, kept_count(d, numel) - 1) for d in DENSITY_GRID
    }


def _record_from_hashes(job: _Job, expert: str, t: TensorRecord, identical: bool, flags: list[bool]) -> None:
    """Record a tensor whose result needs no bytes: all blocks identical, or
    a non-mergeable tensor (only identical flags are kept)."""
    mergeable = t.dtype in MERGEABLE_DTYPES
    blocks = job.blocks[expert][t.name]
    job.deltas[expert].extend(
        BlockDelta(t.name, b.index, 0.0, 0.0, 0, True) if same else BlockDelta(t.name, b.index, None, None, None, False)
        for b, same in zip(blocks, flags)
    )
    thresholds = _zero_thresholds(t.numel) if mergeable else {}
    job.stats[expert].append(TensorStats(t.name, t.numel, mergeable, identical, thresholds))


# Counts up to 2**24 are exact in fp32, so below it the (faster) fp32 L0 norm
# counts non-zeros exactly; larger blocks use the integer count.
_EXACT_FP32_COUNT = 1 << 24


def _count_nonzero(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    per_row = x.shape[-1] if dim is not None else x.numel()
    if per_row < _EXACT_FP32_COUNT:
        return torch.linalg.vector_norm(x, ord=0, dim=dim).to(torch.int64)
    return torch.count_nonzero(x, dim=dim)


def _block_stats(abs_delta: torch.Tensor, sizes: list[int]) -> tuple[list[float], list[float], list[int]]:
    """Per-block (‖Δ‖₂, max|Δ|, nnz) of a flat |Δ| cut into consecutive runs
    of ``sizes`` elements: all equal but the last, so one reshape covers the
    full blocks and one more op the tail."""
    first = sizes[0]
    if any(s != first for s in sizes[:-1]):  # never for tensor_blocks geometry; kept exact anyway
        parts = torch.split(abs_delta, sizes)
        return (
            [float(torch.linalg.vector_norm(p)) for p in parts],
            [float(p.max()) if p.numel() else 0.0 for p in parts],
            [int(_count_nonzero(p)) for p in parts],
        )
    full = len(sizes) if sizes[-1] == first else len(sizes) - 1
    l2: list[float] = []
    mx: list[float] = []
    nnz: list[int] = []
    if full and first:
        head = abs_delta[: full * first].view(full, first)
        l2 = torch.linalg.vector_norm(head, dim=1).tolist()
        mx = head.amax(dim=1).tolist()
        nnz = _count_nonzero(head, dim=1).tolist()
    elif full:
        l2, mx, nnz = [0.0] * full, [0.0] * full, [0] * full
    if full < len(sizes):
        tail = abs_delta[full * first :]
        l2.append(float(torch.linalg.vector_norm(tail)))
        mx.append(float(tail.max()) if tail.numel() else 0.0)
        nnz.append(int(_count_nonzero(tail)))
    return l2, mx, nnz


class _DeltaWorkspace:
    """A reusable fp32 buffer for Δ, grown to the largest tensor seen."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def abs_delta(self, expert_raw: torch.Tensor, base32: torch.Tensor) -> torch.Tensor:
        n = base32.numel()
        if self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.float32)
        out = self._buf[:n].view(base32.shape)
        # bf16/f16 -> fp32 is exact, so E − B here equals e.float() − b.float().
        torch.sub(expert_raw, base32, out=out)
        return out.abs_().view(-1)


def _analyse_tensor(
    job: _Job,
    expert: str,
    t: TensorRecord,
    expert_view: memoryview,
    base32: torch.Tensor,
    flags: list[bool],
    workspace: _DeltaWorkspace,
) -> None:
    blocks = job.blocks[expert][t.name]
    itemsize = t.nbytes // t.numel if t.numel else 1
    sizes = [(b.end - b.begin) // itemsize for b in blocks]
    a = workspace.abs_delta(raw_view(expert_view, t.dtype, t.shape), base32)
    l2, mx, nnz = _block_stats(a, sizes)
    if not all(map(math.isfinite, mx)):
        raise CatalogError(
            f"cannot analyse '{expert}' against '{job.base_id}': tensor '{t.name}' has a NaN or infinite "
            "delta; check both checkpoints for NaN/Inf weights"
        )
    job.deltas[expert].extend(
        BlockDelta(t.name, b.index, 0.0, 0.0, 0, True)
        if same
        else BlockDelta(t.name, b.index, l2[i], mx[i], nnz[i], False)
        for i, (b, same) in enumerate(zip(blocks, flags))
    )
    thresholds = {x.density: x for x in trim_thresholds(a, DENSITY_GRID)}
    job.stats[expert].append(TensorStats(t.name, t.numel, True, False, thresholds))


# ---------------------------------------------------------------------------- run


def _progress(enabled: bool) -> Progress:
    console = Console(stderr=True)
    return Progress(
        TextColumn("[bold]analyze[/] {task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled or not console.is_terminal,
        transient=False,
    )


def _run(job: _Job, reader: BlockReader, progress: bool) -> None:
    total = sum(r.tensor.nbytes for r in job.schedule)
    pool = BufferPool()
    workspace = _DeltaWorkspace()
    stop = threading.Event()
    base_tensor: str | None = None
    base_view: memoryview | None = None
    base_buf: np.ndarray | None = None
    base32: torch.Tensor | None = None
    stream = prefetch_reads(job.schedule, reader, pool, stop)
    with _progress(progress and bool(job.schedule)) as bar, closing(stream):
        task = bar.add_task(", ".join(job.records), total=total)
        for item, view, buf, hashes in stream:
            t = item.tensor
            if hashes is not None:
                job.new_hashes.setdefault(item.model_id, {})[t.name] = hashes
            if item.role == "base":
                pool.put(base_buf)
                base_tensor, base_view, base_buf, base32 = t.name, view, buf, None
            elif item.role == "expert":
                base_hashes = job.hashes(job.base_id, t.name)  # type: ignore[arg-type]
                expert_hashes = job.hashes(item.model_id, t.name)
                flags = [x == y for x, y in zip(expert_hashes, base_hashes)]
                if all(flags) or t.dtype not in MERGEABLE_DTYPES:
                    _record_from_hashes(job, item.model_id, t, all(flags), flags)
                else:
                    if base_tensor != t.name or base_view is None:
                        raise AssertionError(f"base tensor {t.name} was not read before the expert's")
                    if base32 is None:
                        base32 = to_float32(base_view, t.dtype, t.shape)
                    _analyse_tensor(job, item.model_id, t, view, base32, flags, workspace)
                pool.put(buf)
            else:
                pool.put(buf)
            bar.advance(task, t.nbytes)


# ---------------------------------------------------------------------------- record


def _record(catalog: Catalog, job: _Job) -> None:
    """Write new hashes and analyses: one transaction per model / per expert."""

    def check_same(model_id: str) -> None:
        if catalog.find_model(model_id) != job.records[model_id]:
            raise CatalogError(
                f"model '{model_id}' was re-registered while analyze ran; run `mergepipe analyze` again"
            )

    def flat(model_id: str) -> list[tuple[str, int, str]]:
        return [
            (tensor, i, h) for tensor, hashes in job.new_hashes.get(model_id, {}).items() for i, h in enumerate(hashes)
        ]

    for model_id in job.records:
        if model_id in job.experts or model_id not in job.new_hashes:
            continue
        with catalog.transaction():
            check_same(model_id)
            catalog.set_block_hashes(model_id, flat(model_id))
    for expert in job.experts:
        with catalog.transaction():
            check_same(expert)
            check_same(job.base_id)  # type: ignore[arg-type]
            catalog.set_block_hashes(expert, flat(expert))
            if not catalog.is_analyzed(expert, job.base_id):  # type: ignore[arg-type]
                catalog.record_analysis(expert, job.base_id, job.deltas[expert], job.stats[expert])  # type: ignore[arg-type]
