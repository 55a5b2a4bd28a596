"""Bytes <-> tensors, checked against numpy references."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import save

from mergepipe.errors import CheckpointError
from mergepipe.storage.writer import (
    raw_view,
    to_bytes,
    to_float32,
    torch_dtype,
)
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES

SPECIALS = np.array(
    [0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, 1e-40, -3e-39, 65504.0, 6e-8, 3.4e38, 1.0000001],
    dtype=np.float32,
)


def random_f32(n=4096, seed=0):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(n) * rng.choice([1e-6, 1e-2, 1.0, 1e4], n)).astype(np.float32)
    return np.concatenate([values, SPECIALS])


def bf16_bits_rne(values: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even, computed with integer arithmetic."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def test_mergeable_dtypes():
    assert MERGEABLE_DTYPES == {"F32", "F16", "BF16"}


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_torch_dtype_is_what_safetensors_calls_it(dtype):
    """The safetensors library, saving a tensor of the mapped torch dtype,
    writes the same dtype string in its header, with the same item size."""
    target = torch_dtype(dtype)
    blob = save({"x": torch.zeros(3, dtype=target)})
    n = int.from_bytes(blob[:8], "little")
    assert json.loads(blob[8 : 8 + n])["x"]["dtype"] == dtype
    assert torch.zeros(1, dtype=target).element_size() == DTYPE_SIZES[dtype]


def test_unsupported_dtype():
    with pytest.raises(CheckpointError):
        torch_dtype("F4")


def test_to_float32_bf16_exact():
    bits = bf16_bits_rne(random_f32())
    expected = (bits.astype(np.uint32) << 16).view(np.float32)
    got = to_float32(bits.tobytes(), "BF16", (len(bits),))
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)


def test_to_float32_f16_exact():
    with np.errstate(over="ignore"):  # out-of-range values become inf, as intended
        halves = random_f32().astype(np.float16)
    got = to_float32(bytearray(halves.tobytes()), "F16", (len(halves),))
    np.testing.assert_array_equal(got.numpy(), halves.astype(np.float32))


def test_to_float32_f32_owns_memory():
    values = random_f32()[:12]
    buf = bytearray(values.tobytes())
    got = to_float32(buf, "F32", (3, 4))
    np.testing.assert_array_equal(got.numpy().reshape(-1), values)
    buf[:] = bytes(len(buf))  # reuse of the read buffer must not change the result
    np.testing.assert_array_equal(got.numpy().reshape(-1), values)


def test_read_only_buffer_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = to_float32(np.ones(6, dtype=np.float16).tobytes(), "F16", (2, 3))
    assert torch.equal(got, torch.ones(2, 3))


def test_to_bytes_bf16_rounds_to_nearest_even():
    values = random_f32()
    # exact ties: fp32 values halfway between two bf16 values
    ties = (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    values = np.concatenate([values, ties, -ties])
    got = np.frombuffer(bytes(to_bytes(torch.from_numpy(values), "BF16")), dtype=np.uint16)
    np.testing.assert_array_equal(got, bf16_bits_rne(values))


def test_to_bytes_f16_and_f32():
    values = random_f32()
    tensor = torch.from_numpy(values)
    with np.errstate(over="ignore"):
        assert bytes(to_bytes(tensor, "F16")) == values.astype(np.float16).tobytes()
    assert bytes(to_bytes(tensor, "F32")) == values.tobytes()
    assert bytes(to_bytes(tensor.reshape(-1, 4).t(), "F32")) == values.reshape(-1, 4).T.copy().tobytes()


def test_round_trip_through_bytes():
    halves = bf16_bits_rne(random_f32()).tobytes()
    assert bytes(to_bytes(to_float32(halves, "BF16", (len(halves) // 2,)), "BF16")) == halves


@pytest.mark.parametrize("dtype, np_dtype", [("I64", np.int64), ("U8", np.uint8), ("I32", np.int32)])
def test_raw_view_native(dtype, np_dtype):
    values = np.arange(24, dtype=np_dtype) * 3
    buf = bytearray(values.tobytes())
    view = raw_view(buf, dtype, (2, 3, 4))
    assert view.dtype == torch_dtype(dtype) and view.shape == (2, 3, 4)
    np.testing.assert_array_equal(view.numpy().reshape(-1), values)
    assert bytes(to_bytes(view, dtype)) == bytes(buf)


def test_zero_size_and_scalar():
    assert to_float32(b"", "BF16", (0, 4)).shape == (0, 4)
    assert bytes(to_bytes(torch.zeros(0, 4), "BF16")) == b""
    scalar = to_float32(np.float32(2.5).tobytes(), "F32", ())
    assert scalar.shape == () and scalar.item() == 2.5
    assert bytes(to_bytes(torch.tensor(2.5), "F32")) == np.float32(2.5).tobytes()


def test_length_mismatch():
    with pytest.raises(ValueError):
        to_float32(b"\0" * 6, "F32", (2,))
