"""`mergepipe calibrate`: measure this machine's rates for the cost model (``spec/seconds.py``).

Disk (each rate the best of ``DISK_TRIES``), start-up and publishing are
measured by ``calibrate_io.py``; how far reading, merging and writing overlap
(``overlap``) by running the three side by side, as the engine does, and
comparing with their times alone. Compute is measured
per operator on the device, with the engine's own steps for one merged block
(``engine/compute.py``, ``engine/stream.py``): the base block and each
expert's block widened from bf16 to fp32 on the device, the deltas, the
checked kernel (``operators/registry.py``) with exact trim thresholds as the
catalog would give them, the result narrowed and hashed, its norm. Timing
the same blocks with few and with more experts separates the two compute
rates: what a merged block costs whatever is read, and what each expert
block read adds. Tensor-level operators (SLERP, model stock) are timed on a
whole tensor, as the engine merges them; SLERP takes one expert only, so
its time is split evenly between the two rates.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mergepipe.engine.calibrate_io import (
    MAX_FILE_BYTES,
    measure_publish,
    measure_served_startup,
    measure_startup,
    read_file,
    scattered_blocks,
    scratch_directory,
    write_file,
)
from mergepipe.engine.compute import to_device_float32
from mergepipe.engine.operators.context import BlockContext
from mergepipe.engine.operators.registry import merge
from mergepipe.spec.merge_spec import ExpertSpec, MergeSpec
from mergepipe.spec.operator import OperatorDef
from mergepipe.spec.operators import OPERATORS, validate_spec
from mergepipe.spec.seconds import OVERLAP_RANGE, Rates
from mergepipe.spec.thresholds import TrimThreshold, kept_count
from mergepipe.storage.convert import to_bytes
from mergepipe.storage.hashing import block_digest
from mergepipe.threads import compute_threads

#: Tries of each disk measurement, the fastest kept: other work on the disk (another process's write-back)
#: only ever slows a try, and one slowed try (a third of the speed, seen here) would slow every prediction.
DISK_TRIES = 2
#: Seconds of timed merges per operator and sweep (half with few experts, half with more).
SECONDS_PER_OPERATOR = 0.25
#: Sweeps over the operators, each operator's faster timing kept: other work on a small machine only ever
#: slows a timing, and one slowed sweep (task arithmetic, linear and average at a fifth to a quarter of
#: their speed, seen once in six calibrations on 2 cores) would slow every prediction of those operators.
#: The sweeps run seconds apart, so a disturbance of a second or two slows one of them only.
COMPUTE_TRIES = 2
#: Blocks in the tensor each operator merges: enough that one block is not the whole tensor.
TENSOR_BLOCKS = 2
#: The largest block timed: per byte, compute does not depend on the block size beyond this.
MAX_COMPUTE_BLOCK_BYTES = 4 * 1024 * 1024
#: Columns of the synthetic bf16 tensor (a 1024-wide hidden size, as in small LLMs).
COLUMNS = 1024
#: Density of the trimming operators while timed (a common choice; the kernel's cost barely depends on it).
DENSITY = 0.5
#: Every step, in order, as ``calibrate`` reports them.
STEPS = ("start-up", "write", "sequential read", "block reads", *(f"compute {op}" for op in OPERATORS),
         "compute again", "overlap", "publish")
#: Seconds each part of the overlap step takes alone (reading, merging, writing), as predicted from the
#: rates just measured; the step runs the three side by side.
OVERLAP_PART_SECONDS = 0.7
#: The operator the overlap step merges with (the cheapest per byte: the others' compute only lasts longer).
OVERLAP_OPERATOR = "task_arithmetic"

Step = Callable[[str], None]


def calibrate(directory: Path, device: str, block_bytes: int, on_step: Step = lambda step: None) -> Rates:
    """Measure every rate: start-up, the disk under ``directory`` (files in a scratch directory there,
    removed after), each operator's compute on ``device`` and how the three overlap; ``on_step`` hears each
    step as it starts."""
    on_step("start-up")
    startup, exit_share = measure_startup()
    served_startup = measure_served_startup()
    scratch = scratch_directory(directory)
    try:
        path = scratch / "calibrate.bin"
        on_step("write")
        writes = [write_file(path if i == 0 else scratch / f"again-{i}.bin", block_bytes) for i in range(DISK_TRIES)]
        size = writes[0][0]  # the file the reads read
        write_rate, flush_rate = (max(w[0] / w[k] for w in writes) for k in (1, 2))
        on_step("sequential read")
        sequential = max(size / read_file(path, block_bytes) for _ in range(DISK_TRIES))
        on_step("block reads")
        offsets = scattered_blocks(size, block_bytes)
        scattered = max(len(offsets) * block_bytes / read_file(path, block_bytes, offsets, scattered=True)
                        for _ in range(DISK_TRIES))
        compute: dict[str, tuple[float, float]] = {}
        with compute_threads():
            for sweep in range(COMPUTE_TRIES):
                if sweep == 1:
                    on_step("compute again")
                for name in OPERATORS:
                    if sweep == 0:
                        on_step(f"compute {name}")
                    compute[name] = faster(compute.get(name), measure_compute(name, torch.device(device), block_bytes))
            on_step("overlap")
            overlap = measure_overlap(path, block_bytes, torch.device(device), (sequential, write_rate),
                                      compute[OVERLAP_OPERATOR])
        on_step("publish")
        publish = measure_publish(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Rates(startup, exit_share, publish, sequential, scattered, write_rate, flush_rate, overlap, compute,
                 served_startup_seconds=served_startup)


def measure_overlap(path: Path, block_bytes: int, device: torch.device, io_rates: tuple[float, float],
                    compute: tuple[float, float]) -> float:
    """How many of reading, merging and writing run at once here: the seconds the three take alone (from
    ``io_rates``, ``(read, write)`` bytes per second, and ``compute``, the overlap operator's rates) over
    the seconds they take side by side: ``path`` read cold on the read-ahead threads, a file written and
    hashed on another thread, blocks merged on this one. Within ``OVERLAP_RANGE``. `mergepipe calibrate`
    keeps what its probe merges measure instead, where they measure one (``cli/calibrate_probe.py``: on 2
    cores this step measured 1.00 every time, and merges 1.2-1.9).

    Each part lasts ``OVERLAP_PART_SECONDS`` alone, or less where reading the file or writing
    ``MAX_FILE_BYTES`` (the most any calibration file holds) takes less: the three stay equal, and the
    write stays below what the kernel lets a writer dirty before it throttles it to the disk (on a 2-core,
    24 GB machine 1 GiB went to the page cache in 0.17 s and 1.9 GiB took 3.4 s; written so, the
    step measured the throttling, 1.00 in 6-12 s, instead of how the three share the CPU)."""
    read_rate, write_rate = io_rates
    size = path.stat().st_size
    part = min(OVERLAP_PART_SECONDS, size / read_rate, MAX_FILE_BYTES / write_rate)
    read_bytes = min(size, max(block_bytes, int(part * read_rate)) // block_bytes * block_bytes)
    write_bytes = max(block_bytes, int(part * write_rate)) // block_bytes * block_bytes
    merge = _Merges(OPERATORS[OVERLAP_OPERATOR], device, block_bytes)
    seconds_each = merge.unit / compute[0] + merge.unit / compute[1]
    merges = max(1, round(part / seconds_each))
    alone = read_bytes / read_rate + write_bytes / write_rate + merges * seconds_each
    out = path.with_name("overlap.bin")
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="mergepipe-calibrate") as pool:
        started = time.perf_counter()
        reading = pool.submit(read_file, path, block_bytes, list(range(0, read_bytes, block_bytes)))
        writing = pool.submit(write_file, out, block_bytes, write_bytes, math.inf, False)  # fsync is publishing's
        for i in range(merges):
            merge.once(i)
        reading.result(), writing.result()
        together = time.perf_counter() - started
    out.unlink(missing_ok=True)
    low, high = OVERLAP_RANGE
    return min(high, max(low, alone / together))


def measure_compute(operator: str, device: torch.device, block_bytes: int,
                    seconds: float | None = None) -> tuple[float, float]:
    """``(merged base bytes per second, expert bytes per second)`` of ``operator`` on ``device``.

    Merges with few and with more experts alternate, on the same blocks, so a change in the machine's
    load while it runs weighs on both alike."""
    merges = _Merges(OPERATORS[operator], device, block_bytes)
    few, more = merges.counts
    totals = {few: 0.0, more: 0.0}
    rounds, started = 0, time.perf_counter()
    while rounds < 3 or time.perf_counter() - started < (SECONDS_PER_OPERATOR if seconds is None else seconds):
        for k in totals:
            tick = time.perf_counter()
            merges.once(rounds, k)
            totals[k] += 0.0 if rounds == 0 else time.perf_counter() - tick  # the first round warms up
        rounds += 1
    t_few, t_more = (totals[k] / (rounds - 1) for k in (few, more))
    unit = merges.unit
    if few == more:  # one expert count only: split evenly
        return 2 * unit / t_few, 2 * few * unit / t_few
    per_expert = max((t_more - t_few) / (more - few), 0.05 * t_few / few) / unit
    per_merged = max(t_few / unit - few * per_expert, 0.05 * t_few / unit)
    return 1 / per_merged, 1 / per_expert


def faster(a: tuple[float, float] | None, b: tuple[float, float]) -> tuple[float, float]:
    """Of two timings of an operator, ``(merged, expert)`` bytes per second, the one whose merge of a block
    with two experts' blocks takes less time (both rates of one timing: they are measured together)."""
    if a is None:
        return b
    return a if 1 / a[0] + 2 / a[1] <= 1 / b[0] + 2 / b[1] else b


class _Merges:
    """Merges of a synthetic bf16 tensor's blocks (or of the whole tensor, for a tensor-level operator)
    with few or more experts, by the engine's steps: widen, deltas, kernel, narrow, hash, norm."""

    def __init__(self, definition: OperatorDef, device: torch.device, block_bytes: int) -> None:
        rows = max(1, min(block_bytes, MAX_COMPUTE_BLOCK_BYTES) // (2 * COLUMNS))
        shape = (rows * TENSOR_BLOCKS, COLUMNS)
        generator = torch.Generator().manual_seed(0)
        base = torch.randn(shape, generator=generator).mul_(0.02).to(torch.bfloat16)
        self.counts = _expert_counts(definition)
        experts = [(base.float() + torch.randn(shape, generator=generator).mul_(0.002)).to(torch.bfloat16)
                   for _ in range(self.counts[1])]
        self.device = device
        self.unit = base.numel() * 2 if not definition.streaming else rows * COLUMNS * 2  # base bytes per merge
        self.contexts = _contexts(definition, base, experts, self.counts)
        self.base = memoryview(base.view(torch.int16).numpy()).cast("B")
        self.experts = [memoryview(e.view(torch.int16).numpy()).cast("B") for e in experts]

    def once(self, index: int, experts: int | None = None) -> None:
        """Merge the ``index``-th block (cyclically) with ``experts`` experts (the fewer count by default)."""
        k = self.counts[0] if experts is None else experts
        ctx = self.contexts[k]
        begin = index % (len(self.base) // self.unit) * self.unit
        end = begin + self.unit
        shape = (self.unit // (2 * COLUMNS), COLUMNS)
        widened = to_device_float32(self.base[begin:end], "BF16", shape, self.device)
        deltas: list[torch.Tensor | None] = [to_device_float32(e[begin:end], "BF16", shape, self.device).sub_(widened)
                                             for e in self.experts[:k]]
        out = merge(widened, deltas, ctx.for_rows(begin // (2 * COLUMNS)))
        block_digest(to_bytes(out, "BF16"))
        float(torch.linalg.vector_norm(out))  # also waits for a GPU to finish


def _expert_counts(definition: OperatorDef) -> tuple[int, int]:
    """Few and more experts, within what the operator takes."""
    low = max(1, definition.min_experts)
    high = low + 2 if definition.max_experts is None else min(low + 2, definition.max_experts)
    return low, high


def _contexts(definition: OperatorDef, base: torch.Tensor, experts: Sequence[torch.Tensor],
              counts: Sequence[int]) -> dict[int, BlockContext]:
    """Per expert count, the tensor's context as the engine builds it, with the exact trim thresholds of
    each expert's delta (computed once)."""
    name = "model.layers.0.mlp.up_proj.weight"
    params = {"density": DENSITY} if "density" in definition.expert_params.names() else {}
    ids = [f"e{i}" for i in range(len(experts))]
    spec = MergeSpec(definition.name, tuple(ExpertSpec(e) for e in ids), params, 0)
    validate_spec(spec, [name], 1)
    resolved = definition.resolve(spec, name, 1)
    thresholds = [{d: _threshold(e.float() - base.float(), d) for d in definition.needs_thresholds(p)}
                  for e, p in zip(experts, resolved.experts)]
    contexts = {}
    for k in counts:
        spec_k = MergeSpec(definition.name, tuple(ExpertSpec(e) for e in ids[:k]), params, 0)
        contexts[k] = BlockContext.create(definition, name, tuple(base.shape), ids[:k],
                                          definition.resolve(spec_k, name, 1), seed=0, thresholds=thresholds[:k],
                                          owns_deltas=True)  # as the engine: fresh deltas per merge
    return contexts


def _threshold(delta: torch.Tensor, density: float) -> TrimThreshold:
    """The exact (τ, p) of ``delta`` at ``density`` (``spec/thresholds.py``): a stable descending sort's k-th."""
    k = kept_count(density, delta.numel())
    values, order = torch.sort(delta.abs().reshape(-1), descending=True, stable=True)
    return TrimThreshold(density, k, float(values[k - 1]), int(order[k - 1]))
