"""Independent references for catalog tests: no MergePipe code here."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import torch

BF16_BYTES = 2


def raw_header(path: Path) -> tuple[int, dict]:
    """Header length and JSON of a safetensors file, parsed here independently."""
    with open(path, "rb") as handle:
        n = int.from_bytes(handle.read(8), "little")
        return n, json.loads(handle.read(n))


def block_rows(shape: list[int], itemsize: int, block_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of each block, from the contract in docs/ARCHITECTURE.md."""
    rows = shape[0] if len(shape) >= 2 else 1
    row_bytes = (math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)) * itemsize
    if rows * row_bytes <= block_bytes:
        per = max(1, rows)
    else:
        per = max(1, block_bytes // row_bytes)
    count = max(1, -(-rows // per))
    return [(i * per, min((i + 1) * per, rows)) for i in range(count)]


def reference_block_stats(base: torch.Tensor, expert: torch.Tensor, block_bytes: int):
    """Per-block (l2, maxabs, nnz, identical) computed on whole tensors in plain torch."""
    delta = expert.float() - base.float()
    shape = list(base.shape)
    flat = delta.reshape(-1)
    row_numel = math.prod(shape[1:]) if len(shape) >= 2 else flat.numel()
    out = []
    for r0, r1 in block_rows(shape, base.element_size(), block_bytes):
        d = flat[r0 * row_numel : r1 * row_numel] if len(shape) >= 2 else flat
        b = base.reshape(-1)[r0 * row_numel : r1 * row_numel] if len(shape) >= 2 else base.reshape(-1)
        e = expert.reshape(-1)[r0 * row_numel : r1 * row_numel] if len(shape) >= 2 else expert.reshape(-1)
        identical = torch.equal(b.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8))
        out.append(
            (
                float(torch.linalg.vector_norm(d)),
                float(d.abs().max()) if d.numel() else 0.0,
                int((d != 0).sum()),
                identical,
            )
        )
    return out


def reference_thresholds(abs_flat: torch.Tensor, density: float) -> tuple[int, float, int]:
    """(k, tau, last kept index) by a stable descending sort: what a trim keeps."""
    n = abs_flat.numel()
    k = max(1, int(density * n))
    values, order = torch.sort(abs_flat, descending=True, stable=True)
    tau = float(values[k - 1])
    kept = order[:k]
    last = int(kept[values[:k] == tau].max())
    return k, tau, last


def db_dump(path: Path) -> str:
    """The whole database as SQL text, read with plain sqlite3 ("nothing was written" checks)."""
    conn = sqlite3.connect(path)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


def row_count(path: Path, table: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()
