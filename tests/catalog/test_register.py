"""register_model: what is recorded, idempotence, refusals, change detection."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from mergepipe.catalog.register import register_model
from mergepipe.errors import CatalogError, CheckpointError, ConfigError, ModelChangedError, UnknownModelError
from tests.catalog.conftest import SMALL_BLOCK_BYTES
from tests.catalog.helpers import block_rows, db_dump, raw_header
from tests.fixtures.checkpoints import checkpoint_files, make_base, write_raw_safetensors

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _expected_tensors(ckpt: Path) -> dict[str, tuple[str, str, list[int], int, int]]:
    """name -> (file, dtype, shape, absolute begin, absolute end), from raw headers."""
    out = {}
    for f in checkpoint_files(ckpt):
        n, header = raw_header(f)
        header.pop("__metadata__", None)
        for name, info in header.items():
            b, e = info["data_offsets"]
            out[name] = (f.name, info["dtype"], info["shape"], 8 + n + b, 8 + n + e)
    return out


@pytest.mark.parametrize("family", ["tiny_family", "sharded_family"])
def test_register_records_tensors_blocks_and_files(catalog, family, request):
    ckpt = request.getfixturevalue(family)["base"]
    record = register_model(catalog, "base", ckpt)

    expected = _expected_tensors(ckpt)
    tensors = catalog.tensors("base")
    assert {t.name: (t.file, t.dtype, list(t.shape), t.begin, t.end) for t in tensors} == expected
    # ordinal order is file order, then offset order
    assert [t.ordinal for t in tensors] == list(range(len(tensors)))
    assert [(t.file, t.begin) for t in tensors] == sorted((t.file, t.begin) for t in tensors)

    blocks = catalog.blocks("base")
    for t in tensors:
        rows = block_rows(list(t.shape), ITEMSIZE[t.dtype], SMALL_BLOCK_BYTES)
        got = blocks[t.name]
        assert [(b.index, b.row_start, b.row_end) for b in got] == [(i, r0, r1) for i, (r0, r1) in enumerate(rows)]
        assert got[0].begin == t.begin and got[-1].end == t.end
        assert all(a.end == b.begin for a, b in zip(got, got[1:]))
        assert all(b.hash is None for b in got)

    files = catalog.files("base")
    assert [f.name for f in files] == [p.name for p in checkpoint_files(ckpt)]
    for f in files:
        st = os.stat(ckpt / f.name)
        n, _ = raw_header(ckpt / f.name)
        raw = (ckpt / f.name).read_bytes()[8 : 8 + n]
        assert (f.size, f.mtime_ns, f.header_sha256) == (st.st_size, st.st_mtime_ns, hashlib.sha256(raw).hexdigest())

    assert record == catalog.get_model("base")
    assert record.uri == str(ckpt.resolve())
    assert record.kind == "checkpoint"
    assert record.n_tensors == len(expected)
    assert record.n_blocks == sum(len(v) for v in blocks.values())
    assert record.total_bytes == sum(e - b for _, _, _, b, e in expected.values())
    assert record.num_layers == 2
    assert record.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")


def test_same_id_same_content_is_a_no_op(family_catalog, tiny_family):
    before = db_dump(family_catalog.path)
    again = register_model(family_catalog, "e1", tiny_family["e1"])
    assert again == family_catalog.get_model("e1")
    assert db_dump(family_catalog.path) == before


def test_different_content_refused(family_catalog, tmp_path):
    other = make_base(tmp_path / "qwen", arch="qwen3")
    before = db_dump(family_catalog.path)
    with pytest.raises(CatalogError, match="model 'e1' is already registered with different content; use a new id or --force"):
        register_model(family_catalog, "e1", other)
    assert db_dump(family_catalog.path) == before


def test_force_replaces_and_drops_statistics(family_catalog, tmp_path):
    other = make_base(tmp_path / "qwen", arch="qwen3")
    family_catalog.set_block_hashes("e1", [("lm_head.weight", 0, "ab" * 32)])
    record = register_model(family_catalog, "e1", other, force=True)
    assert record.architecture == "Qwen3ForCausalLM"
    assert family_catalog.get_model("e1") == record
    assert all(b.hash is None for bs in family_catalog.blocks("e1").values() for b in bs)
    assert {t.name for t in family_catalog.tensors("e1")} == set(_expected_tensors(other))


def test_moved_checkpoint_needs_force(family_catalog, tiny_family, tmp_path):
    moved = shutil.copytree(tiny_family["e1"], tmp_path / "moved")
    with pytest.raises(CatalogError, match="already registered from"):
        register_model(family_catalog, "e1", moved)
    assert register_model(family_catalog, "e1", moved, force=True).uri == str(moved.resolve())


def test_missing_dir_refused_with_nothing_written(family_catalog, tmp_path):
    before = db_dump(family_catalog.path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        register_model(family_catalog, "x", tmp_path / "nope")
    assert db_dump(family_catalog.path) == before


def test_corrupt_checkpoint_refused_with_nothing_written(family_catalog, tiny_family, tmp_path):
    bad = shutil.copytree(tiny_family["base"], tmp_path / "bad")
    n, header = raw_header(bad / "model.safetensors")
    data = (bad / "model.safetensors").read_bytes()[8 + n :]
    write_raw_safetensors(bad / "model.safetensors", header, data[:-2])  # wrong byte length
    before = db_dump(family_catalog.path)
    for model_id, force in (("new", False), ("e1", True)):
        with pytest.raises(CheckpointError, match="corrupt safetensors file"):
            register_model(family_catalog, model_id, bad, force=force)
    assert db_dump(family_catalog.path) == before


@pytest.mark.parametrize("bad_id", ["", " x", "a b", "x;rm", "-flag", "x" * 201])
def test_invalid_model_id_refused(catalog, tiny_family, bad_id):
    with pytest.raises(ConfigError, match="invalid model id"):
        register_model(catalog, bad_id, tiny_family["base"])


def test_unknown_model_lists_registered(family_catalog):
    with pytest.raises(
        UnknownModelError,
        match=r"unknown model 'zz'; registered: base, e1, e2, e3 \(register it with `mergepipe register`\)",
    ):
        family_catalog.get_model("zz")
    for query in (family_catalog.tensors, family_catalog.blocks, family_catalog.files, family_catalog.parents):
        with pytest.raises(UnknownModelError):
            query("zz")
    assert family_catalog.model_exists("e1") and not family_catalog.model_exists("zz")
    assert [m.id for m in family_catalog.list_models()] == ["base", "e1", "e2", "e3"]


def test_unknown_model_in_empty_catalog(catalog):
    with pytest.raises(UnknownModelError, match="none registered yet"):
        catalog.get_model("x")


def test_model_changed_on_disk_detected(catalog, tiny_family, tmp_path):
    ckpt = shutil.copytree(tiny_family["e1"], tmp_path / "e1")
    register_model(catalog, "e1", ckpt)
    catalog.check_unchanged("e1")
    assert catalog.open_checkpoint("e1").num_tensors == catalog.get_model("e1").n_tensors

    weights = ckpt / "model.safetensors"
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    message = r"model 'e1' changed on disk since registration \(file .*model\.safetensors\); re-register it with `mergepipe register --force`"
    with pytest.raises(ModelChangedError, match=message):
        catalog.check_unchanged("e1")
    with pytest.raises(ModelChangedError):
        catalog.open_checkpoint("e1")

    register_model(catalog, "e1", ckpt, force=True)
    catalog.check_unchanged("e1")
    weights.unlink()
    with pytest.raises(ModelChangedError, match="is missing"):
        catalog.check_unchanged("e1")


def test_same_size_same_mtime_but_new_header_detected(catalog, tiny_family, tmp_path):
    ckpt = shutil.copytree(tiny_family["e1"], tmp_path / "e1")
    register_model(catalog, "e1", ckpt)
    weights = ckpt / "model.safetensors"
    st = os.stat(weights)
    blob = weights.read_bytes()
    assert b'"format":"pt"' in blob[:4096]
    weights.write_bytes(blob.replace(b'"format":"pt"', b'"format":"pu"', 1))  # same length
    assert os.stat(weights).st_size == st.st_size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ModelChangedError, match="headers"):
        catalog.open_checkpoint("e1")


def test_fingerprint_is_deterministic_and_layout_sensitive(catalog, tiny_family, sharded_family):
    a = register_model(catalog, "a", tiny_family["base"])
    b = register_model(catalog, "b", tiny_family["e1"])
    c = register_model(catalog, "c", sharded_family["base"])
    # headers of a base and its expert are byte-identical: same layout fingerprint
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 64
