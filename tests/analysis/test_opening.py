"""Opening a registered model: its files are checked against the registration first."""

from __future__ import annotations

import os
import shutil

import pytest

from mergepipe.analysis.experts import check_unchanged, open_registered
from mergepipe.analysis.register import register_model
from mergepipe.errors import ModelChangedError, UnknownModelError
from tests.fixtures.checkpoints import load_tensors

CHANGED = (
    r"model 'e1' changed on disk since registration \(file .*model\.safetensors\); "
    r"re-register it with `mergepipe register --force`"
)


@pytest.fixture
def registered_copy(catalog, tiny_family, tmp_path):
    """A copy of e1 registered as 'e1' (tests may damage the copy)."""
    ckpt = shutil.copytree(tiny_family["e1"], tmp_path / "e1")
    register_model(catalog, "e1", ckpt)
    return catalog, ckpt


def test_unchanged_model_opens(registered_copy):
    catalog, ckpt = registered_copy
    check_unchanged(catalog, "e1")
    opened = open_registered(catalog, "e1")
    assert opened.root.resolve() == ckpt.resolve()
    assert set(opened.tensor_files) == set(load_tensors(ckpt))
    assert len(opened.tensor_files) == catalog.models.get("e1").n_tensors


def test_new_mtime_detected(registered_copy):
    catalog, ckpt = registered_copy
    weights = ckpt / "model.safetensors"
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ModelChangedError, match=CHANGED):
        check_unchanged(catalog, "e1")
    with pytest.raises(ModelChangedError, match=CHANGED):
        open_registered(catalog, "e1")
    register_model(catalog, "e1", ckpt, force=True)  # re-registering accepts the new state
    check_unchanged(catalog, "e1")


def test_new_size_detected(registered_copy):
    catalog, ckpt = registered_copy
    weights = ckpt / "model.safetensors"
    st = os.stat(weights)
    with open(weights, "ab") as handle:
        handle.write(b"\0")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: the size alone tells
    with pytest.raises(ModelChangedError, match=CHANGED):
        check_unchanged(catalog, "e1")


def test_missing_file_detected(registered_copy):
    catalog, ckpt = registered_copy
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelChangedError, match=r"model\.safetensors is missing"):
        check_unchanged(catalog, "e1")
    with pytest.raises(ModelChangedError, match="is missing"):
        open_registered(catalog, "e1")


def test_same_size_same_mtime_but_new_header_detected(registered_copy):
    catalog, ckpt = registered_copy
    weights = ckpt / "model.safetensors"
    st = os.stat(weights)
    blob = weights.read_bytes()
    assert b'"format":"pt"' in blob[:4096]
    weights.write_bytes(blob.replace(b'"format":"pt"', b'"format":"pu"', 1))  # same length
    assert os.stat(weights).st_size == st.st_size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    check_unchanged(catalog, "e1")  # size and mtime alone cannot tell
    with pytest.raises(ModelChangedError, match=r"model 'e1' changed on disk since registration \(file headers in "):
        open_registered(catalog, "e1")


@pytest.mark.parametrize("call", [check_unchanged, open_registered])
def test_unknown_model(catalog, call):
    with pytest.raises(UnknownModelError, match="unknown model 'zz'"):
        call(catalog, "zz")
