"""The engine's sum of a tensor's sketch stages: each stage decoded into a reused buffer and added in place,
bit for bit the plain ``total + q * scale`` from zeros, even where that sum makes -0 into +0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergepipe.catalog.statistics import DeltaStage
from mergepipe.engine.stream import _sketch_span
from mergepipe.storage.format import encode_stage
from mergepipe.storage.format import TensorEntry

ROWS, COLS = 6, 7


def _sketch(stages, view, entry, device):
    """The whole tensor's sum: ``_sketch_span`` over all of it."""
    parts = [(s, view[s.begin - stages[0].begin : s.end - stages[0].begin]) for s in stages]
    return _sketch_span(parts, entry, 0, entry.numel, device).reshape(entry.shape)


def _stages(scales: list[np.ndarray], seed: int) -> tuple[list[DeltaStage], bytes, list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    payloads, qs = [], []
    for s in scales:
        q = rng.integers(-1, 2, size=ROWS * COLS).astype(np.int8)
        payloads.append(encode_stage(q, s.astype(np.float32)))
        qs.append(torch.from_numpy(q.astype(np.float32)).view(ROWS, COLS))
    stages, begin = [], 100
    for number, payload in enumerate(payloads, start=1):
        stages.append(DeltaStage("w", number, begin, begin + len(payload), ROWS, 0.0, 0.0, ""))
        begin += len(payload)
    return stages, b"".join(payloads), qs


@pytest.mark.parametrize("first", ["positive", "zero rows", "minus zero", "negative", "nan"])
def test_stages_sum_as_the_plain_sum_from_zeros(first):
    rng = np.random.default_rng(5)
    head = rng.random(ROWS).astype(np.float32) + 0.1
    head[1] = {"positive": head[1], "zero rows": 0.0, "minus zero": -0.0, "negative": -0.5, "nan": np.nan}[first]
    scales = [head, rng.random(ROWS).astype(np.float32), np.zeros(ROWS, dtype=np.float32)]
    stages, data, qs = _stages(scales, seed=len(first))
    entry = TensorEntry("w", "BF16", (ROWS, COLS), 0, 2 * ROWS * COLS)
    for count in (1, 2, 3):
        got = _sketch(stages[:count], memoryview(data), entry, torch.device("cpu"))
        expected = torch.zeros(ROWS, COLS)
        for q, s in zip(qs[:count], scales[:count]):
            expected = expected + q * torch.from_numpy(s)[:, None]
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (first, count)


@pytest.mark.parametrize("first", ["positive", "minus zero", "negative"])
@pytest.mark.parametrize(("row_start", "row_end"), [(0, ROWS), (0, 1), (1, 3), (2, 6), (5, 6)])
def test_any_rows_of_the_stages_sum_as_those_rows_of_the_whole(first, row_start, row_end):
    """A merge in pieces decodes a piece's rows at a time (rows of 7 elements: spans that start and end
    inside a byte of five trits), and gets those rows of the whole tensor's sum, bit for bit."""
    rng = np.random.default_rng(8)
    head = rng.random(ROWS).astype(np.float32) + 0.1
    head[2] = {"positive": head[2], "minus zero": -0.0, "negative": -0.5}[first]
    head[4] = 0.0
    stages, data, _ = _stages([head, rng.random(ROWS).astype(np.float32)], seed=3)
    entry = TensorEntry("w", "BF16", (ROWS, COLS), 0, 2 * ROWS * COLS)
    for count in (1, 2):
        whole = _sketch(stages[:count], memoryview(data), entry, torch.device("cpu"))
        parts = [(s, memoryview(data)[s.begin - stages[0].begin : s.end - stages[0].begin]) for s in stages[:count]]
        got = _sketch_span(parts, entry, row_start * COLS, row_end * COLS, torch.device("cpu"))
        assert torch.equal(got.view(torch.int32), whole[row_start:row_end].reshape(-1, COLS).view(torch.int32))
