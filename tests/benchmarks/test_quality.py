"""The quality benchmark's own parts that need no real model: corpora splits, windows, deviation, table."""

from __future__ import annotations

import math

import torch
from safetensors.torch import save_file

from benchmarks.quality import corpora, models
from benchmarks.quality.__main__ import table
from benchmarks.quality.merges import deviation


def test_files_are_split_by_path_and_never_in_both_parts(tmp_path):
    paths = []
    for i in range(64):
        path = tmp_path / f"f{i}.txt"
        path.write_text(f"file {i}\n")
        paths.append(path)
    train, held = corpora._collect(paths, lambda p: p.read_text())
    held_files = {p for p in paths if corpora._held_out(p)}
    assert 0 < len(held_files) < len(paths)
    assert set(held.split("\n")) - {""} == {p.read_text().strip() for p in held_files}
    assert not set(train.split("\n")) & set(held.split("\n")) - {""}


def test_arithmetic_corpus_is_correct_and_deterministic():
    train, held = corpora.build("arith")
    assert (train, held) == corpora.build("arith") and train != held
    for line in held.splitlines()[:200]:
        left, value = line.split(" = ")
        a, op, b = left.split(" ")
        assert int(value) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_windows_are_consecutive_and_fixed():
    tokens = torch.arange(1000)
    w = models.windows(tokens, 5)
    assert w.shape == (5, models.SEQ_LEN) and torch.equal(w[1], torch.arange(128, 256))
    assert models.windows(tokens, 100).shape[0] == 1000 // models.SEQ_LEN


def test_deviation_is_the_relative_distance_to_the_full_merge(tmp_path):
    def write(name, tensors):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    base = write("base", {"a": torch.zeros(2), "b": torch.zeros(1)})
    full = write("full", {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])})
    merged = write("m", {"a": torch.tensor([3.0, 1.0]), "b": torch.tensor([2.0])})
    assert math.isclose(deviation(merged, full, base), math.sqrt(1 + 4) / 5)


def test_table_prints_gaps_for_budgeted_rows_and_losses_for_the_others():
    rows = [{"label": "ties 100%", "loss": {n: 2.0 for n in corpora.NAMES}, "expert_bytes": 10**6,
             "error_bound": 0.0, "error_share": 0.0},
            {"label": "ties 10% entries", "loss": {n: 2.02 for n in corpora.NAMES}, "expert_bytes": 10**5,
             "gap_pct": {n: 1.0 for n in corpora.NAMES}, "deviation": 0.5, "error_bound": 3.0, "error_share": 0.4}]
    text = table(rows, corpora.NAMES)
    assert "  2.000" in text and "  +1.00" in text and "40.0%" in text and "0.500" in text
