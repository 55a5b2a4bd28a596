"""Provenance of a snapshot's output: per output block a key (sha256 of what decides its bytes) for
incremental merges; bump ``KEY_VERSION`` whenever what decides an output changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mergepipe.analysis.experts import LORA, layer_count, read_ahead
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import TensorRecord
from mergepipe.errors import EngineError
from mergepipe.spec.canonical import digest
from mergepipe.spec.operators import find_threshold, get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.settings import family
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.format import MERGEABLE_DTYPES, float64_values
from mergepipe.storage.lora import ADAPTER_CONFIG_FILE
from mergepipe.storage.source import ByteRange, CheckpointSource, WorkItem, block_digest

#: 2: each expert's decoding (kind, dtype, delta base, adapter config); 3: a block no expert is read for is
#: merged, not copied, where the operator does not keep the base
KEY_VERSION = 3


#: Expert id in a plan -> (the version it replaced, that version's planned block reads per tensor): the keys a
#: block would have had with the replaced versions (delta updates).
Substitute = Mapping[str, tuple[str, Mapping[str, tuple[int, ...]]]]


def output_keys(catalog: Catalog, plan: Plan, substitute: Substitute | None = None) -> dict[tuple[str, int], str]:
    """(tensor, block) -> provenance key of every output block of ``plan``."""
    return dict(_keys(_Context(catalog, plan, substitute or {})))


def is_merged(plan: Plan, t: TensorRecord, block: int, num_layers: int) -> bool:
    """Whether the engine merges (rather than copies) block ``block`` of base tensor ``t``."""
    mode, _, copies_unread = tensor_mode(plan, t, num_layers)
    if mode != "blocks":
        return mode == "whole"
    return bool(plan.experts_reading(t.name, block)) or not copies_unread


class _Context:
    """What the keys are computed from, fetched from the catalog once."""

    def __init__(self, catalog: Catalog, plan: Plan, substitute: Substitute) -> None:
        self.plan = plan
        self.substitute = substitute
        self.definition = get_operator(plan.operator)
        base = plan.base.id
        self.tensors = catalog.models.tensors(base)
        self.blocks = catalog.blocks.by_tensor(base)
        self.ids = plan.merge.expert_ids
        self.order = sorted(range(len(self.ids)), key=lambda i: self.ids[i])
        self.hashes = {m: catalog.blocks.hashes(m) for m in (base, *self.ids)}
        self.decoding = {e: _decoding(catalog, e) for e in self.ids}
        for expert, (older, _) in substitute.items():
            self.hashes[expert] = catalog.blocks.hashes(older)
            self.decoding[expert] = _decoding(catalog, older)
        self.stats = {e: catalog.stats.tensor_stats(e, base) for e in self.ids}
        self.stores = {e: (catalog.deltas.chunks(e, base), catalog.deltas.stages(e, base)) for e in plan.stores}
        self.num_layers = layer_count(catalog, base)

    def reading(self, tensor: str, block: int) -> set[str]:
        """The experts read for a block (a substituted expert: as its earlier version was)."""
        out = set(self.plan.experts_reading(tensor, block))
        for expert, (_, reads) in self.substitute.items():
            out.discard(expert)
            if block in reads.get(tensor, ()):
                out.add(expert)
        return out


def _keys(ctx: _Context) -> Iterator[tuple[tuple[str, int], str]]:
    plan = ctx.plan
    for t in ctx.tensors:
        mode, out_dtype, _ = tensor_mode(plan, t, ctx.num_layers)
        blocks = ctx.blocks[t.name]
        base_hashes = ctx.hashes[plan.base.id][t.name]
        head = {"v": KEY_VERSION, "tensor": t.name, "dtype": t.dtype, "shape": list(t.shape), "out": out_dtype}
        if mode == "copy":
            for b in blocks:
                copied = {"copy": [b.row_start, b.row_end], "base": base_hashes[b.index]}
                yield (t.name, b.index), digest({**head, **copied})
            continue
        common, experts, neutral = _merge_inputs(ctx, t)
        if mode == "whole":
            key = digest({**head, **common, "experts": experts, "whole": _whole_inputs(ctx, t, base_hashes)})
            yield from (((t.name, b.index), key) for b in blocks)
            continue
        for b in blocks:
            reading = ctx.reading(t.name, b.index)
            read = [
                (e, ctx.hashes[ctx.ids[i]][t.name][b.index] if ctx.ids[i] in reading else None)
                for i, e in zip(ctx.order, experts)
            ]
            if neutral:  # the experts not read for this block take no part in it
                read = [(e, h) for e, h in read if h is not None]
            block = {"rows": [b.row_start, b.row_end], "base": base_hashes[b.index]}
            yield (
                (t.name, b.index),
                digest({**head, **common, "block": block, "experts": [{**e, "read": h} for e, h in read]}),
            )


def tensor_mode(plan: Plan, t: TensorRecord, num_layers: int) -> tuple[str, str, bool]:
    """``(merge mode, output dtype, whether a block no expert is read for is the base's bytes)`` of a base
    tensor under ``plan`` (see ``Plan.merge_mode``; the engine's ``items._mode``)."""
    mergeable = t.dtype in MERGEABLE_DTYPES
    out_dtype = plan.out_dtype if (plan.out_dtype and mergeable) else t.dtype
    keeps = plan.keeps_base(t.name, num_layers)
    return plan.merge_mode(t.name, mergeable, out_dtype == t.dtype, keeps), out_dtype, out_dtype == t.dtype and keeps


def _merge_inputs(ctx: _Context, t: TensorRecord) -> tuple[dict[str, Any], list[dict[str, Any]], bool]:
    """What the kernel is given for this tensor besides the blocks' bytes."""
    params = ctx.definition.resolve(ctx.plan.merge, t.name, ctx.num_layers)
    experts = []
    for i in ctx.order:
        table = ctx.stats[ctx.ids[i]].get(t.name)
        found = [
            find_threshold(table.thresholds if table else None, d)
            for d in ctx.definition.needs_thresholds(params.experts[i])
        ]
        model, dtypes = ctx.decoding[ctx.ids[i]]
        part = {
            "params": params.experts[i].model_dump(),
            "thresholds": [None if f is None else [f.tau, f.last_index] for f in found],
            "decode": {**model, "dtype": dtypes.get(t.name)},
        }
        if ctx.definition.random:
            part["stream"] = family(ctx.ids[i])
        experts.append(part)
    common: dict[str, Any] = {"operator": ctx.plan.operator, "global": params.global_.model_dump()}
    if ctx.definition.random:
        common["seed"] = ctx.plan.merge.seed
    return common, experts, ctx.definition.absent_neutral(params)


def _decoding(catalog: Catalog, model_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    """How an expert's bytes become Δ: (its kind, delta base and adapter config's sha256; tensor -> dtype)."""
    record = catalog.models.get(model_id)
    model: dict[str, Any] = {"kind": record.kind}
    if record.delta_base is not None:
        model["base"] = record.delta_base
    if record.kind == LORA:
        configs = [f.header_sha256 for f in catalog.models.files(model_id) if f.name == ADAPTER_CONFIG_FILE]
        if len(configs) != 1:
            raise EngineError(f"internal error: adapter '{model_id}' has no recorded {ADAPTER_CONFIG_FILE}")
        model["config"] = configs[0]
    return model, {t.name: t.dtype for t in catalog.models.tensors(model_id)}


def _whole_inputs(ctx: _Context, t: TensorRecord, base_hashes: list[str | None]) -> dict[str, Any]:
    plan = ctx.plan
    experts = []
    for i in ctx.order:
        expert = ctx.ids[i]
        read = plan.reads_of(t.name, expert)
        entry: dict[str, Any] = {"blocks": [[b, ctx.hashes[expert][t.name][b]] for b in read]}
        if plan.chunks_of(t.name, expert) or plan.stages_of(t.name, expert):
            chunks, stages = ctx.stores[expert]
            entry["chunks"] = [c.hash for c in chunks.get(t.name, [])[: plan.chunks_of(t.name, expert)]]
            entry["stages"] = [s.hash for s in stages.get(t.name, [])[: plan.stages_of(t.name, expert)]]
        experts.append(entry)
    return {"base": base_hashes, "experts": experts, "tensor_level": t.name in plan.tensor_level}


class BlockOutput(NamedTuple):
    """What the engine measured of one output block as it wrote it."""

    hash: str  # blake3 of its bytes
    l2: float | None  # a bound on the norm of its values where merged, else None
    # a bound on its distance to the fp32 values a from-scratch merge computes for it (fixed-coefficient
    # operators; None: not measured)
    drift: float | None = None
    # a delta-updated block's a-posteriori bound on its distance to the from-scratch merge (None: the plan's)
    error: float | None = None


#: One row of ``output_blocks``: (tensor, block, key, hash, norm bound, error bound, drift).
OutputRow = tuple[str, int, str, str, float | None, float, float | None]


def output_rows(catalog: Catalog, plan: Plan, outputs: Mapping[tuple[str, int], BlockOutput]) -> list[OutputRow]:
    """The rows of every output block, for the snapshot's catalog record (an empty block hashes the empty string)."""
    keys = output_keys(catalog, plan)
    unknown = set(outputs) - set(keys)
    if unknown:
        raise EngineError(f"internal error: output hashes for blocks the plan does not have: {sorted(unknown)[:3]}")
    errors = plan.reuse.errors if plan.reuse is not None else {}
    empty = BlockOutput(block_digest(b""), None)
    rows = []
    for (t, b), key in keys.items():
        out = outputs.get((t, b), empty)
        error = out.error if out.error is not None else errors.get(t, {}).get(b, 0.0)
        rows.append((t, b, key, out.hash, out.l2, error, out.drift))
    return rows


def file_outputs(catalog: Catalog, plan: Plan, directory: Path) -> dict[tuple[str, int], BlockOutput]:
    """The output blocks' (blake3, norm of merged blocks) read back from a published snapshot, for ``recover``."""
    checkpoint = open_checkpoint(directory)
    blocks = catalog.blocks.by_tensor(plan.base.id)
    records = {t.name: t for t in catalog.models.tensors(plan.base.id)}
    num_layers = layer_count(catalog, plan.base.id)
    items = [
        WorkItem(
            (e, b), [ByteRange(f.path, e.begin + b.row_start * e.row_bytes, e.begin + b.row_end * e.row_bytes, "")]
        )
        for f, e in checkpoint.iter_tensors()
        for b in blocks[e.name]
    ]
    out: dict[tuple[str, int], BlockOutput] = {}
    with CheckpointSource() as source:
        for fetched in read_ahead(source, items, lambda _, views: block_digest(views[0])).run(items):
            (entry, b), data = fetched.item.payload, fetched.views[0]
            norm = None
            if data and is_merged(plan, records[entry.name], b.index, num_layers):
                norm = float(np.linalg.norm(float64_values(data, entry.dtype)))  # exact values: no margin needed
            out[(entry.name, b.index)] = BlockOutput(fetched.result, norm)
            fetched.release()
    return out
