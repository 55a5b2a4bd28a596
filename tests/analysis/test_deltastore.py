"""Delta stores: every changed entry of an expert, largest |Δ| first, exact."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mergepipe.analysis import deltastore, deltastore as sketch, deltastore as store_order, analyze as windows
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.deltastore import JUST_CREATED_SECONDS, build_store, has_store, sweep_abandoned
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.errors import ConfigError, ModelChangedError
from mergepipe.storage.format import encode_varints
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.deltas import ref_sketch
from tests.fixtures.remote import RangeServer
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


def _check_store(catalog, report, expert_id: str, base: dict, expert: dict) -> dict:
    """Check a store against the tensors, independently of the build: every changed entry once, with the
    expert's own bytes, chunks by descending |Δ| (equal ones by position); the store's chunk rows."""
    data = Path(report.record.path).read_bytes()
    assert data[:8] == b"MPDELTA1" and len(data) == report.record.file_size
    chunks = catalog.deltas.chunks(expert_id, "base")
    assert set(chunks) == {n for n in base if not torch.equal(base[n], expert[n])}
    total = 0
    for name, tensor_chunks in chunks.items():
        flat_e = expert[name].reshape(-1)
        delta = (flat_e.float() - base[name].reshape(-1).float())
        seen, previous = [], (-math.inf, -1)  # (-|Δ|, position) of the last entry of the chunk before
        for index, chunk in enumerate(tensor_chunks):
            assert chunk.index == index
            assert chunk.hash == blake3.blake3(data[chunk.begin : chunk.end]).hexdigest()
            positions, raw = _decode(data, chunk, flat_e.element_size())
            assert positions == sorted(positions)
            assert raw == flat_e[positions].view(torch.int16).numpy().tobytes()  # the expert's own bf16 bytes
            ranks = sorted((-float(delta[i].abs()), i) for i in positions)
            assert ranks[0] > previous  # every entry ranks after every entry of an earlier chunk
            previous = ranks[-1]
            assert chunk.energy == pytest.approx(float((delta[positions].double() ** 2).sum()), rel=1e-12)
            seen += positions
        assert sorted(seen) == torch.nonzero(delta).flatten().tolist()
        total += len(seen)
    assert report.entries == total and report.chunks == sum(len(c) for c in chunks.values())
    return chunks


def test_store_holds_every_changed_entry_largest_first_with_exact_values(catalog, tiny_family, tmp_path):
    report = build_store(catalog, "e3", "base", tmp_path / "stores")
    chunks = _check_store(catalog, report, "e3", load_tensors(tiny_family["base"]), load_tensors(tiny_family["e3"]))
    assert "model.embed_tokens.weight" not in chunks  # e3 leaves embeddings alone


def _bands_seen(monkeypatch) -> list:
    """Record the bands every banded tensor is ordered by."""
    seen = []
    plan_bands = store_order.plan_bands

    def planned(*args):
        bands = plan_bands(*args)
        seen.extend(bands)
        return bands

    monkeypatch.setattr(deltastore, "plan_bands", planned)
    return seen


@pytest.mark.parametrize("expert_id", ["e1", "e3"])
def test_a_store_ordered_by_bands_is_the_same_bytes_as_one_built_whole(catalog, tmp_path, monkeypatch, expert_id):
    monkeypatch.setattr(sketch, "GROUP_ELEMENTS", 640)  # several row groups per tensor, cut across windows
    whole = build_store(catalog, expert_id, "base", tmp_path / "whole")
    rows = catalog.deltas.chunks(expert_id, "base"), catalog.deltas.stages(expert_id, "base")
    monkeypatch.setattr(windows, "WINDOW_ELEMENTS", 300)  # a window per 4 KiB block
    bands = _bands_seen(monkeypatch)
    banded = build_store(catalog, expert_id, "base", tmp_path / "banded", band_entries=64)
    assert banded.record.digest == whole.record.digest
    assert (catalog.deltas.chunks(expert_id, "base"), catalog.deltas.stages(expert_id, "base")) == rows
    assert len(bands) > 100 and any(b.streamed and b.count > 64 for b in bands)  # sorted and streamed bands


def test_progress_counts_each_tensor_s_bytes_once_and_names_the_band_being_ordered(catalog, tmp_path, monkeypatch):
    calls = []

    @contextlib.contextmanager
    def recording(label, total, enabled):
        calls.append(("total", total))
        yield lambda nbytes, description: calls.append((nbytes, description))

    monkeypatch.setattr(deltastore, "byte_progress", recording)
    monkeypatch.setattr(windows, "WINDOW_ELEMENTS", 300)
    build_store(catalog, "e1", "base", tmp_path / "stores", band_entries=64)
    (_, total), advances = calls[0], calls[1:]
    changed = catalog.deltas.chunks("e1", "base")
    assert total == sum(t.nbytes for t in catalog.models.tensors("e1") if t.name in changed)
    assert sum(n for n, _ in advances) == total
    assert any(n == 0 and ", band 1 of " in d for n, d in advances)


def test_many_equal_magnitudes_and_one_row_tensors_by_bands(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    base = {"w": (torch.randn(300, 40, generator=gen) * 0.02).to(torch.bfloat16),
            "b": (torch.randn(5000, generator=gen) * 0.02).to(torch.bfloat16),
            "c": torch.ones(128, 16, dtype=torch.bfloat16)}
    expert = {n: t.clone() for n, t in base.items()}
    flat_b, flat_e = base["w"].view(-1), expert["w"].view(-1)
    tied = torch.rand(flat_b.numel(), generator=gen) < 0.3  # Δ = ±1/16: one magnitude, 3,600 entries
    flat_b[tied] = torch.where(torch.rand(int(tied.sum()), generator=gen) < 0.5, 1.0, -1.0).to(torch.bfloat16)
    flat_e[tied] = flat_b[tied] * 1.0625
    moved = torch.rand(flat_b.numel(), generator=gen) < 0.3
    flat_e[moved & ~tied] += (torch.randn(int((moved & ~tied).sum()), generator=gen) * 1e-3).to(torch.bfloat16)
    expert["b"] += (torch.randn(5000, generator=gen) * 1e-3).to(torch.bfloat16)
    expert["c"] += 0.5  # every entry changed by the same amount
    for name, tensors in (("base", base), ("expert", expert)):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        register_model(catalog, "base", tmp_path / "base")
        register_model(catalog, "expert", tmp_path / "expert")
        analyze(catalog, ["expert"], base_id="base", progress=False)
        whole = build_store(catalog, "expert", "base", tmp_path / "whole")
        monkeypatch.setattr(windows, "WINDOW_ELEMENTS", 1000)
        bands = _bands_seen(monkeypatch)
        banded = build_store(catalog, "expert", "base", tmp_path / "banded", band_entries=100)
        _check_store(catalog, banded, "expert", base, expert)
    assert banded.record.digest == whole.record.digest
    streamed = {(b.low, b.count) for b in bands if b.streamed}
    sixteenth, half = (int(np.array([v], dtype=np.float32).view(np.int32)[0]) for v in (0.0625, 0.5))
    assert {(sixteenth, int(tied.sum())), (half, 128 * 16)} <= streamed


def _analysed_pair(tmp_path: Path, base: dict, expert: dict) -> Catalog:
    for name, tensors in (("base", base), ("expert", expert)):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    catalog = Catalog.create(tmp_path / "c.db", BLOCK_BYTES)
    register_model(catalog, "base", tmp_path / "base")
    register_model(catalog, "expert", tmp_path / "expert")
    analyze(catalog, ["expert"], base_id="base", progress=False)
    return catalog


def _spy(monkeypatch, owner, name: str) -> list:
    """Record every call of ``owner.name`` (its arguments), calling it still."""
    calls, original = [], getattr(owner, name)

    def spied(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spied)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_band_of_one_magnitude_shares_the_pass_of_the_band_after_it(tmp_path, monkeypatch, dtype):
    """A bf16 delta's oversized buckets hold one magnitude each: counted by the histogram's pass, no pass of
    their own. An fp32 one's may hold several: one more pass counts them. The bytes are those of a whole build."""
    gen = torch.Generator().manual_seed(3)
    base = {"w": (torch.randn(400, 40, generator=gen) * 0.02).to(dtype)}
    expert = {"w": base["w"].clone()}
    flat_b, flat_e = base["w"].view(-1), expert["w"].view(-1)
    flat_e += (torch.randn(flat_e.numel(), generator=gen) * 1e-3).to(dtype)
    for start, delta in ((0, 1.0), (1, 2.0)):  # two magnitudes over a band each, their bands apart
        flat_b[start::7] = 0.0
        flat_e[start::7] = delta
    if dtype == torch.float32:  # the first's bucket also holds a magnitude just above it
        flat_e[2::14] = float(np.nextafter(np.float32(1), np.float32(2)))
        flat_b[2::14] = 0.0
    with _analysed_pair(tmp_path, base, expert) as catalog:
        whole = build_store(catalog, "expert", "base", tmp_path / "whole")
        monkeypatch.setattr(windows, "WINDOW_ELEMENTS", 1000)
        bands = _bands_seen(monkeypatch)
        passes = []  # the passes of the ordering (the sketch's own pass, apart, reuses no buffer)
        windows_of = deltastore._Pair.windows

        def counted(self, entry, reuse=False):
            passes.extend([entry] if reuse else [])
            return windows_of(self, entry, reuse)

        monkeypatch.setattr(deltastore._Pair, "windows", counted)
        exact = _spy(monkeypatch, deltastore, "exact_counts")
        banded = build_store(catalog, "expert", "base", tmp_path / "banded", band_entries=1000)
        _check_store(catalog, banded, "expert", base, expert)
    assert banded.record.digest == whole.record.digest
    shared = sum(a.streamed and not b.streamed for a, b in zip(bands, bands[1:]))
    assert shared >= 1 and sum(b.streamed for b in bands) >= 1 + (dtype == torch.bfloat16)
    assert (len(exact) > 0) == (dtype == torch.float32)
    assert len(passes) == 1 + (dtype == torch.float32) + len(bands) - shared  # the histogram's, exact counts', bands'


def test_a_model_changed_on_disk_since_analysis_stops_the_build(catalog, tiny_family, tmp_path):
    """Blocks are checked on every read, read whole on the worker thread or by bands on this one."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_family["e1"], copy)
    register_model(catalog, "copy", copy)
    analyze(catalog, ["copy"], base_id="base", progress=False)
    path = next(copy.glob("*.safetensors"))
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor; same size and mtime: only the block hashes tell
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    for band_entries in (deltastore.BAND_ENTRIES, 64):
        with pytest.raises(ModelChangedError, match="'copy' changed on disk since it was analysed"):
            build_store(catalog, "copy", "base", tmp_path / "stores", band_entries=band_entries)
    assert catalog.deltas.find("copy", "base") is None and list((tmp_path / "stores").iterdir()) == []


def test_gaps_are_leb128_varints_whatever_their_widths():
    gen = np.random.default_rng(5)
    for _ in range(300):
        top = int(gen.choice([1, 127, 128, 300, 16_383, 16_384, 1 << 21, 1 << 40]))
        values = gen.integers(0, top + 1, int(gen.integers(0, 40)))
        if len(values) and gen.random() < 0.5:
            values[0] = int(gen.integers(0, 1 << 35))  # a chunk's first position, often the widest
        expected = bytearray()
        for value in values.tolist():
            while value >= 0x80:
                expected.append(value & 0x7F | 0x80)
                value >>= 7
            expected.append(value)
        assert encode_varints(values) == bytes(expected)


def test_a_remote_tensor_is_fetched_once_however_many_passes_order_it(tiny_family, catalog, tmp_path, monkeypatch):
    local = build_store(catalog, "e1", "base", tmp_path / "local")
    monkeypatch.setattr(windows, "WINDOW_ELEMENTS", 300)
    monkeypatch.setenv("MERGEPIPE_REMOTE_HEADER_PROBE_BYTES", "8")  # header reads touch no data byte
    with RangeServer(tiny_family["base"].parent) as http, Catalog.create(tmp_path / "r.db", BLOCK_BYTES) as remote:
        for name in ("base", "e1"):
            register_model(remote, name, f"{http.url}/{tiny_family[name].name}")
        analyze(remote, ["e1"], base_id="base", progress=False)
        http.log.clear()
        banded = build_store(remote, "e1", "base", tmp_path / "remote", band_entries=64)
        gets = [(g.path, g.range) for g in http.log.gets(".safetensors")]
    assert banded.record.digest == local.record.digest
    assert len(gets) > 20 and len(set(gets)) == len(gets)  # every range once: later passes read the local copy
    for path in {p for p, _ in gets}:
        ranges = sorted(r for p, r in gets if p == path)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # and no byte twice
    assert [p.name for p in (tmp_path / "remote").iterdir()] == [Path(banded.record.path).name]


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


KILLED_AT_RENAME = textwrap.dedent("""
    import os, signal, sys
    from mergepipe.analysis import deltastore
    from mergepipe.catalog import Catalog

    def die(*args):  # the store is written, fsynced and recorded: die before it is renamed into place
        os.kill(os.getpid(), signal.SIGKILL)
    deltastore.os.rename = die
    with Catalog.open(sys.argv[1]) as catalog:
        deltastore.build_store(catalog, "e1", "base", sys.argv[2])
""")


def test_a_build_killed_before_its_rename_leaves_no_store_file_that_nothing_records(catalog, tmp_path):
    """Recorded before renamed: a kill in between leaves a record without its file (so no store, built again
    on demand) and an unlocked staging file, never a store file no catalog records; the replaced store's
    file is gone with its record."""
    stores = tmp_path / "stores"
    old = Path(build_store(catalog, "e1", "base", stores).record.path)
    proc = subprocess.run([PYTHON, "-c", KILLED_AT_RENAME, str(tmp_path / "c.db"), str(stores)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    record = catalog.deltas.find("e1", "base")
    final = Path(record.path)
    assert final != old and not final.exists() and not old.exists()
    (left,) = stores.iterdir()  # the whole store under its staging name, its lock gone with the process
    assert left.name == f".{final.name}.writing" and left.stat().st_size == record.file_size
    assert not has_store(catalog, "e1", "base")

    report = build_store(catalog, "e1", "base", stores)  # built again on demand: the leftover swept first
    assert report.swept == [left] and has_store(catalog, "e1", "base")
    assert [p.name for p in stores.iterdir()] == [Path(report.record.path).name]


def test_a_live_build_s_staging_file_and_other_files_are_left_alone(tmp_path):
    live = tmp_path / ".e1--base-0123abcd.mpdelta.writing"
    dead = tmp_path / ".e2--base-4567cdef.mpdelta.writing"
    fresh = tmp_path / ".e3--base-89abcdef.mpdelta.writing"  # empty, just created: its build may lock it next
    copy = tmp_path / ".mpdelta-spill-k3x9q2"  # a killed build's local copy of a remote tensor
    other = tmp_path / ".notes.writing"
    for path in (live, dead, copy, other):
        path.write_bytes(b"MPDELTA1 and more")
    fresh.touch()
    old = os.stat(dead).st_mtime - 2 * JUST_CREATED_SECONDS
    os.utime(dead, (old, old))
    with open(live, "rb") as held:  # another open file description holding the lock, as a live build does
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert sweep_abandoned(tmp_path) == [dead, copy]
    assert live.exists() and fresh.exists() and other.exists() and not dead.exists() and not copy.exists()
    os.utime(fresh, (old, old))
    assert sweep_abandoned(tmp_path) == [live, fresh]  # unlocked now, and an empty file left for a minute


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
