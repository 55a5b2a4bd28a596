"""Delta stores: every changed entry of an expert, largest |Δ| first, exact."""

from __future__ import annotations

import fcntl
import math
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

from mergepipe.analysis import deltastore
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.deltastore import JUST_CREATED_SECONDS, build_store, has_store, largest_first, sweep_abandoned
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.errors import ConfigError
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.deltas import ref_sketch
from tests.planner.support import PYTHON, subprocess_env

BLOCK_BYTES = 4096


@pytest.fixture
def catalog(tiny_family, tmp_path):
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for name in ("base", "e1", "e3"):
            register_model(catalog, name, tiny_family[name])
        analyze(catalog, ["e1", "e3"], base_id="base", progress=False)
        yield catalog


def _decode(data: bytes, chunk, itemsize: int):
    """Positions and raw element bytes of a chunk, decoded here from the format's definition."""
    payload = data[chunk.begin : chunk.end]
    positions, value, shift, i = [], 0, 0, 0
    while len(positions) < chunk.entries:
        byte = payload[i]
        value |= (byte & 0x7F) << shift
        shift += 7
        i += 1
        if not byte & 0x80:
            positions.append(value + (positions[-1] if positions else 0))
            value, shift = 0, 0
    assert i == chunk.gap_bytes
    return positions, payload[i:]


def test_store_holds_every_changed_entry_largest_first_with_exact_values(catalog, tiny_family, tmp_path):
    report = build_store(catalog, "e3", "base", tmp_path / "stores")
    data = Path(report.record.path).read_bytes()
    assert data[:8] == b"MPDELTA1" and len(data) == report.record.file_size
    base, expert = load_tensors(tiny_family["base"]), load_tensors(tiny_family["e3"])
    chunks = catalog.deltas.chunks("e3", "base")
    changed = {n for n in base if not torch.equal(base[n], expert[n])}
    assert set(chunks) == changed and "model.embed_tokens.weight" not in chunks  # e3 leaves embeddings alone
    total = 0
    for name, tensor_chunks in chunks.items():
        flat_e = expert[name].reshape(-1)
        delta = (flat_e.float() - base[name].reshape(-1).float())
        seen, previous_min = [], math.inf
        for index, chunk in enumerate(tensor_chunks):
            assert chunk.index == index
            assert chunk.hash == blake3.blake3(data[chunk.begin : chunk.end]).hexdigest()
            positions, raw = _decode(data, chunk, 2)
            assert positions == sorted(positions)
            assert raw == flat_e[positions].view(torch.int16).numpy().tobytes()  # the expert's own bf16 bytes
            magnitudes = delta[positions].abs()
            assert float(magnitudes.max()) <= previous_min  # no entry outranks one of an earlier chunk
            previous_min = float(magnitudes.min())
            assert chunk.energy == pytest.approx(float((delta[positions].double() ** 2).sum()), rel=1e-12)
            seen += positions
        assert sorted(seen) == torch.nonzero(delta).flatten().tolist()
        total += len(seen)
    assert report.entries == total and report.chunks == sum(len(c) for c in chunks.values())


def test_rebuilding_replaces_the_record_and_removes_the_old_file(catalog, tmp_path):
    first = build_store(catalog, "e1", "base", tmp_path / "stores").record
    second = build_store(catalog, "e1", "base", tmp_path / "stores").record
    assert first.path != second.path and first.digest == second.digest
    assert not (tmp_path / "stores" / first.path).exists()
    assert [p.name for p in (tmp_path / "stores").iterdir()] == [second.path.rsplit("/", 1)[1]]
    assert has_store(catalog, "e1", "base") and not has_store(catalog, "e3", "base")


def test_re_registering_the_expert_drops_its_store(catalog, tiny_family, tmp_path):
    build_store(catalog, "e1", "base", tmp_path / "stores")
    register_model(catalog, "e1", tiny_family["e2"], force=True)
    assert catalog.deltas.find("e1", "base") is None
    assert catalog.deltas.chunks("e1", "base") == {}


def test_a_store_needs_an_analysed_pair_and_a_directory(catalog, tmp_path):
    with pytest.raises(Exception, match="not been analysed|analy"):
        build_store(catalog, "base", "e1", tmp_path / "stores")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        build_store(catalog, "e1", "base", tmp_path / "file")


def test_sketch_stages_decode_to_the_reference_approximation(catalog, tiny_family, tmp_path):
    record = build_store(catalog, "e1", "base", tmp_path / "stores").record
    data = Path(record.path).read_bytes()
    base, expert = load_tensors(tiny_family["base"]), load_tensors(tiny_family["e1"])
    stages = catalog.deltas.stages("e1", "base")
    assert set(stages) == set(catalog.deltas.chunks("e1", "base"))
    for name, tensor_stages in stages.items():
        delta = expert[name].float() - base[name].float()
        expected = ref_sketch(delta, 3)
        rows = delta.shape[0] if delta.dim() >= 2 else 1
        approx = torch.zeros(rows, delta.numel() // rows)
        for number, (stage, reference) in enumerate(zip(tensor_stages, expected), start=1):
            assert stage.stage == number and stage.rows == rows
            payload = data[stage.begin : stage.end]
            assert len(payload) == 4 * rows + -(-delta.numel() // 5)
            assert stage.hash == blake3.blake3(payload).hexdigest()
            scales = torch.from_numpy(np.frombuffer(payload[: 4 * rows], dtype="<f4").copy())
            packed = np.frombuffer(payload[4 * rows :], dtype=np.uint8).astype(np.int64)
            trits = np.stack([packed // 3**j % 3 for j in range(5)], axis=1).reshape(-1)[: delta.numel()] - 1
            approx = approx + torch.from_numpy(trits.astype(np.float32)).view(rows, -1) * scales[:, None]
            assert torch.equal(approx.reshape(delta.shape), reference), (name, number)
            assert stage.residual == pytest.approx(float(((delta - reference).double() ** 2).sum()), rel=1e-9)
            assert stage.norm == pytest.approx(float(reference.double().norm()), rel=1e-9)
        residuals = [stage.residual for stage in tensor_stages]
        assert residuals == sorted(residuals, reverse=True)  # every stage leaves less
        assert residuals[-1] < 0.1 * float((delta.double() ** 2).sum())


def test_a_bf16_entry_costs_three_to_four_store_bytes_plus_the_sketches(catalog, tmp_path):
    report = build_store(catalog, "e3", "base", tmp_path / "stores")
    sketches = sum(s.nbytes for per in catalog.deltas.stages("e3", "base").values() for s in per)
    entries = report.record.file_size - 8 - sketches
    # 2 value bytes and a 1- or 2-byte gap per entry (chunks spread over their tensor)
    assert 3 * report.entries <= entries <= 4 * report.entries
    changed = [t for t in catalog.models.tensors("e3") if t.name in catalog.deltas.chunks("e3", "base")]
    # per stage: 1.6 bits per element and an fp32 scale per row
    assert sketches == sum(3 * (4 * (t.shape[0] if len(t.shape) >= 2 else 1) + -(-t.numel // 5)) for t in changed)


KILLED_BUILD = textwrap.dedent("""
    import os, signal, sys
    from mergepipe.analysis import deltastore
    from mergepipe.catalog import Catalog

    written = deltastore._tensor_stages
    def stages_then_die(*args):
        rows = written(*args)
        args[-1].flush()  # the first tensor's bytes are in the staging file: now die as a kill -9 would
        os.kill(os.getpid(), signal.SIGKILL)
    deltastore._tensor_stages = stages_then_die
    with Catalog.open(sys.argv[1]) as catalog:
        deltastore.build_store(catalog, "e1", "base", sys.argv[2])
""")


def test_a_build_killed_mid_write_leaves_a_staging_file_the_next_build_removes(catalog, tmp_path):
    stores = tmp_path / "stores"
    proc = subprocess.run([PYTHON, "-c", KILLED_BUILD, str(tmp_path / "c.db"), str(stores)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (left,) = stores.iterdir()  # half a store, under its staging name, and nothing recorded
    assert left.name.startswith(".e1--base-") and left.name.endswith(".mpdelta.writing")
    assert left.stat().st_size > 8 and catalog.deltas.find("e1", "base") is None

    report = build_store(catalog, "e3", "base", stores)
    assert report.swept == [left] and not left.exists()
    assert [p.name for p in stores.iterdir()] == [Path(report.record.path).name]


def test_a_live_build_s_staging_file_and_other_files_are_left_alone(tmp_path):
    live = tmp_path / ".e1--base-0123abcd.mpdelta.writing"
    dead = tmp_path / ".e2--base-4567cdef.mpdelta.writing"
    fresh = tmp_path / ".e3--base-89abcdef.mpdelta.writing"  # empty, just created: its build may lock it next
    other = tmp_path / ".notes.writing"
    for path in (live, dead, other):
        path.write_bytes(b"MPDELTA1 and more")
    fresh.touch()
    old = os.stat(dead).st_mtime - 2 * JUST_CREATED_SECONDS
    os.utime(dead, (old, old))
    with open(live, "rb") as held:  # another open file description holding the lock, as a live build does
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert sweep_abandoned(tmp_path) == [dead]
    assert live.exists() and fresh.exists() and other.exists() and not dead.exists()
    os.utime(fresh, (old, old))
    assert sweep_abandoned(tmp_path) == [live, fresh]  # unlocked now, and an empty file left for a minute


def _reference_order(values: np.ndarray) -> list[int]:
    """Non-zero positions by descending |v| (every NaN alike and largest), equal ones by position: in Python."""
    def magnitude(i):
        v = abs(float(values[i]))
        return math.inf if math.isnan(v) else v  # NaN first; inf next (ties with NaN broken below)
    nonzero = [i for i in range(len(values)) if values[i] != 0 or math.isnan(values[i])]
    return sorted(nonzero, key=lambda i: (not math.isnan(values[i]), -magnitude(i), i))


ADVERSARIAL = {
    "empty": [],
    "one element": [0.5],
    "one zero": [0.0],
    "all equal": [0.25] * 9,
    "signed ties and zeros": [0.0, -1.0, 1.0, -0.0, 0.5, -0.5, 0.0, 1.0, -2.0],
    "extremes": [1e-45, -1e-45, 3.4e38, -3.4e38, 1e-38, float("inf"), -float("inf"), 2.0],
    "nans": [1.0, float("nan"), -float("nan"), float("inf"), 0.0, float("nan")],
}


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_largest_first_orders_entries_as_a_stable_descending_sort_of_magnitudes(case, narrow, monkeypatch):
    if narrow:  # the fallback for positions too wide to share a key with the magnitude
        monkeypatch.setattr(deltastore, "_KEY_BITS", 31)
    values = np.array(ADVERSARIAL[case], dtype=np.float32)
    if case == "nans":
        values.view(np.int32)[5] = 0x7FC00123  # another NaN payload: NaNs are alike all the same
    assert largest_first(values).tolist() == _reference_order(values)


def test_largest_first_on_many_bf16_like_ties_matches_the_torch_stable_sort():
    gen = torch.Generator().manual_seed(3)
    delta = (torch.randn(200_003, generator=gen) * 1e-3).to(torch.bfloat16).float()
    delta[torch.rand(200_003, generator=gen) < 0.3] = 0
    nonzero = torch.nonzero(delta).flatten()
    reference = nonzero[torch.sort(delta[nonzero].abs(), descending=True, stable=True).indices]
    assert np.array_equal(largest_first(delta.numpy()), reference.numpy())


def test_without_flock_a_build_still_works_and_no_staging_file_is_removed(catalog, tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(37, "No locks available")  # ENOLCK, as some network filesystems answer

    stores = tmp_path / "stores"
    stores.mkdir()
    leftover = stores / ".e2--base-0123abcd.mpdelta.writing"
    leftover.write_bytes(b"MPDELTA1 half a store")
    monkeypatch.setattr(deltastore.fcntl, "flock", no_locks)
    report = build_store(catalog, "e1", "base", stores)
    assert report.swept == [] and leftover.exists()  # live or dead cannot be told apart: left alone
    assert has_store(catalog, "e1", "base")
