"""Independent references for catalog tests: no MergePipe code here (but the type of a server URL)."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import torch

from mergepipe.catalog.database import ServerURL

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


def db_dump(path: Path | ServerURL) -> str:
    """The whole database as text, read with plain sqlite3 or psycopg ("nothing was written" checks): for a
    server, every table of the catalog's schema with its rows in order."""
    if isinstance(path, ServerURL):
        with psycopg.connect(path.url, autocommit=True) as conn:
            tables = [r[0] for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY tablename")]
            lines = []
            for table in tables:
                n = len(conn.execute(f"SELECT * FROM {table} LIMIT 0").description or ())
                order = ", ".join(str(i + 1) for i in range(n))
                lines += [f"{table}: {row!r}" for row in conn.execute(f"SELECT * FROM {table} ORDER BY {order}")]
                lines.append(f"{table} ({n} columns)")
            return "\n".join(lines)
    conn = sqlite3.connect(path)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


class RawDB:
    """A plain connection to a catalog's database, sqlite3 or psycopg, with ``?`` placeholders for both."""

    def __init__(self, conn, server: bool) -> None:
        self._conn = conn
        self.server = server

    def execute(self, sql: str, params: tuple = ()) -> list[tuple]:
        if self.server:
            cursor = self._conn.execute(sql.replace("?", "%s"), params or None)
            return [tuple(r) for r in cursor.fetchall()] if cursor.description else []
        return self._conn.execute(sql, params).fetchall()


@contextmanager
def raw_db(path: Path | ServerURL) -> Iterator[RawDB]:
    """``RawDB`` on the catalog at ``path``, in one transaction committed when the block ends."""
    if isinstance(path, ServerURL):
        with psycopg.connect(path.url) as pg:  # committed on leaving the block
            yield RawDB(pg, server=True)
        return
    conn = sqlite3.connect(path)
    try:
        with conn:
            yield RawDB(conn, server=False)
    finally:
        conn.close()


def row_count(path: Path | ServerURL, table: str) -> int:
    if isinstance(path, ServerURL):
        with psycopg.connect(path.url, autocommit=True) as pg:
            return pg.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()
