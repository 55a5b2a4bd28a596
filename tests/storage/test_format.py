"""Header parsing of valid files, checked against safetensors and a raw JSON parse."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe.storage.writer import torch_dtype
from mergepipe.storage.format import DTYPE_SIZES, TensorEntry, float64_values, read_header
from tests.fixtures.checkpoints import checkpoint_files
from tests.storage.helpers import raw_header


def test_header_matches_safetensors(any_checkpoint):
    for path in checkpoint_files(any_checkpoint):
        header = read_header(path)
        header_len, doc = raw_header(path)
        assert header.header_len == header_len
        assert header.data_start == 8 + header_len
        assert header.file_size == path.stat().st_size
        raw = path.read_bytes()[8 : 8 + header_len]
        assert header.header_sha256 == hashlib.sha256(raw).hexdigest()
        with safe_open(str(path), framework="pt") as handle:
            assert header.metadata == handle.metadata()
            assert set(header.tensors) == set(handle.keys())
            for name, entry in header.tensors.items():
                sl = handle.get_slice(name)
                assert entry.name == name
                assert entry.dtype == sl.get_dtype()
                assert entry.shape == tuple(sl.get_shape())
                begin, end = doc[name]["data_offsets"]
                assert (entry.begin, entry.end) == (8 + header_len + begin, 8 + header_len + end)
                tensor = handle.get_tensor(name)
                assert entry.nbytes == tensor.numel() * tensor.element_size()
                assert entry.numel == tensor.numel()
                assert entry.itemsize == tensor.element_size()
        begins = [e.begin for e in header.tensors.values()]
        assert begins == sorted(begins)


def test_edge_tensors(tmp_path):
    path = tmp_path / "edge.safetensors"
    tensors = {
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "empty_rows": torch.zeros((0, 4), dtype=torch.bfloat16),
        "empty_cols": torch.zeros((5, 0), dtype=torch.float16),
        "vector": torch.arange(7, dtype=torch.int64),
        "matrix": torch.ones((3, 5), dtype=torch.bfloat16),
        "cube": torch.ones((2, 3, 4), dtype=torch.uint8),
    }
    save_file(tensors, str(path), metadata={"k": "v"})
    header = read_header(path)
    assert header.metadata == {"k": "v"}
    e = header.tensors
    assert (e["scalar"].rows, e["scalar"].row_bytes, e["scalar"].numel) == (1, 4, 1)
    assert (e["vector"].rows, e["vector"].row_bytes) == (1, 56)
    assert (e["matrix"].rows, e["matrix"].row_bytes) == (3, 10)
    assert (e["cube"].rows, e["cube"].row_bytes) == (2, 12)
    assert (e["empty_rows"].nbytes, e["empty_rows"].rows) == (0, 0)
    assert (e["empty_cols"].nbytes, e["empty_cols"].rows, e["empty_cols"].row_bytes) == (0, 5, 0)
    for entry in e.values():
        if entry.rows:
            assert entry.row_bytes == entry.nbytes // entry.rows


def test_empty_file_is_valid(tmp_path):
    path = tmp_path / "empty.safetensors"
    save_file({}, str(path))
    header = read_header(path)
    assert header.tensors == {}
    assert header.data_start == header.file_size


def test_entry_properties_pure():
    entry = TensorEntry("w", "F32", (10, 3), begin=100, end=220)
    assert (entry.nbytes, entry.numel, entry.rows, entry.row_bytes, entry.itemsize) == (120, 30, 10, 12, 4)


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_dtype_sizes_match_torch(dtype):
    assert torch_dtype(dtype).itemsize == DTYPE_SIZES[dtype]


def test_common_dtypes_present():
    required = {"BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64",
                "F8_E4M3", "F8_E5M2"}
    assert required <= DTYPE_SIZES.keys()


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_float64_values_without_torch_equal_torch_widening(dtype):
    values = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 100
    values[:3] = torch.tensor([0.0, -0.0, 1e-30])
    raw = values.to(torch_dtype(dtype)).view(torch.uint8).numpy().tobytes()
    got = float64_values(raw, dtype)
    assert got.tolist() == values.to(torch_dtype(dtype)).double().tolist()


def test_float64_values_refuses_other_dtypes():
    with pytest.raises(ValueError, match="not a mergeable dtype"):
        float64_values(b"\x00" * 8, "I32")

