"""Raw safetensors bytes <-> torch tensors.

Merging math runs in fp32: ``to_float32`` turns the bytes of a block into an
fp32 tensor, ``to_bytes`` turns the result back into bytes of the output
dtype. Safetensors stores little-endian data and so do the hosts we run on;
these functions refuse to run on a big-endian host rather than byte-swap.
"""

from __future__ import annotations

import math
import sys

import torch

from mergepipe.errors import CheckpointError
from mergepipe.storage.format import DTYPE_SIZES

_TORCH_DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}

# Resolved once: a dtype missing from this torch build is simply absent.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, name) for st, name in _TORCH_DTYPE_NAMES.items() if hasattr(torch, name)
}

Buffer = bytes | bytearray | memoryview


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string."""
    try:
        return _TORCH_DTYPES[st_dtype]
    except KeyError:
        raise CheckpointError(
            f"dtype {st_dtype!r} is not supported by torch {torch.__version__}; "
            "upgrade torch or convert the checkpoint to F32/F16/BF16"
        ) from None


def _check_host() -> None:
    if sys.byteorder != "little":
        raise CheckpointError("safetensors data is little-endian; MergePipe needs a little-endian host")


def raw_view(buf: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf`` as a tensor of its native dtype and ``shape``.

    Zero-copy for writable buffers: the tensor aliases ``buf``, so it is only
    valid while ``buf`` is neither reused nor freed. A read-only buffer
    (``bytes``) is copied once, because torch tensors must be writable.
    """
    _check_host()
    target = torch_dtype(dtype)
    view = memoryview(buf).cast("B")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if len(view) != expected:
        raise ValueError(f"{len(view)} bytes cannot hold {dtype} of shape {tuple(shape)} ({expected} bytes)")
    if expected == 0:
        return torch.empty(shape, dtype=target)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=target).reshape(shape)


def to_float32(buf: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The values in ``buf`` as a new fp32 tensor of ``shape`` (exact for F16/BF16).

    The result owns its memory (even for F32 input), so the caller may reuse
    ``buf`` at once.
    """
    return raw_view(buf, dtype, shape).to(torch.float32, copy=True)


def to_bytes(t: torch.Tensor, dtype: str) -> memoryview:
    """The raw little-endian bytes of ``t`` cast to ``dtype``.

    The cast rounds to nearest even, as torch does; a tensor on a GPU is cast
    there and only the (often half-size) result copied back. A contiguous
    CPU tensor already in ``dtype`` is not copied: the returned view shares
    its memory and keeps it alive.
    """
    _check_host()
    target = torch_dtype(dtype)
    out = t.detach().to(dtype=target).to(device="cpu").contiguous()
    if out.numel() == 0:
        return memoryview(b"")
    return out.reshape(-1).view(torch.uint8).numpy().data
