"""Hugging Face checkpoint directories on disk, as the benchmarks need them.

List the weight files of a checkpoint, write a safetensors file tensor by
tensor (the safetensors library only writes whole dicts), compare two merged
checkpoints by relative Frobenius error, and remove an output even when its
files were made read-only. Independent of the ``mergepipe`` package on purpose.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
# Files that sit beside the weights and are copied with them (config, tokenizer).
SIDECAR_SUFFIXES = (".json", ".txt", ".model", ".jinja")
# Elements per chunk when comparing: fp32 temporaries of ~16 MiB, partial sums in fp64.
COMPARE_CHUNK_ELEMENTS = 4 << 20


def weight_files(ckpt: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order when sharded."""
    ckpt = Path(ckpt)
    index = ckpt / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [ckpt / name for name in dict.fromkeys(weight_map.values())]
    if (ckpt / SINGLE_NAME).exists():
        return [ckpt / SINGLE_NAME]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {ckpt}; is it a checkpoint directory?")
    return files


def sidecar_files(ckpt: Path) -> list[Path]:
    """config.json, tokenizer files and the like (not the weight index)."""
    return sorted(
        p
        for p in Path(ckpt).iterdir()
        if p.is_file() and p.suffix in SIDECAR_SUFFIXES and p.name != INDEX_NAME
    )


def weight_bytes(ckpts: Iterable[Path]) -> int:
    """Total size of the weight files of several checkpoints."""
    return sum(f.stat().st_size for c in ckpts for f in weight_files(c))


def tensor_files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    where: dict[str, Path] = {}
    for path in weight_files(ckpt):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                where[name] = path
    return where


class StreamingSafetensorsWriter:
    """Write one safetensors file whose tensor list is known up front.

    The header goes first, then each tensor's bytes in header order, so a
    large file never sits in memory. ``write_rows`` appends consecutive rows of
    the current tensor; a tensor is complete when all its bytes are written.
    """

    def __init__(self, path: Path, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path = Path(path)
        self._order = [name for name, _, _ in specs]
        self._sizes: dict[str, int] = {}
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in specs:
            size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self._sizes[name] = size
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the library writes
        self._file: BinaryIO = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._current = 0
        self._written = 0

    def write_rows(self, name: str, rows: torch.Tensor) -> None:
        expected = self._order[self._current]
        if name != expected:
            raise ValueError(f"writer expected tensor {expected}, got {name}")
        data = rows.contiguous().view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._written += data.nbytes
        if self._written > self._sizes[name]:
            raise ValueError(f"{name}: wrote {self._written} bytes, expected {self._sizes[name]}")
        if self._written == self._sizes[name]:
            self._current += 1
            self._written = 0

    def close(self) -> None:
        if self._current != len(self._order):
            self._file.close()
            raise ValueError(f"{self.path}: only {self._current}/{len(self._order)} tensors written")
        self._file.close()

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


@dataclass(frozen=True)
class Comparison:
    """Frobenius comparison of a checkpoint against a reference (fp64 sums)."""

    sq_diff: float  # sum over tensors of ||a - ref||^2
    sq_ref: float  # ||ref||^2
    sq_ref_delta: float  # ||ref - base||^2
    identical: bool  # every tensor byte-identical to the reference

    @property
    def rel_error(self) -> float:
        """||a - ref|| / ||ref||: the error relative to the merged weights."""
        return math.sqrt(self.sq_diff / self.sq_ref) if self.sq_ref else 0.0

    @property
    def delta_rel_error(self) -> float | None:
        """||a - ref|| / ||ref - base||: the share of the merged task vector lost."""
        return math.sqrt(self.sq_diff / self.sq_ref_delta) if self.sq_ref_delta else None


class _ChunkedSquares:
    """Sums of squares of differences of low-precision tensors, chunk by chunk.

    Differences of bf16/fp16 values are exact in fp32; each chunk's sum is taken
    in fp32 and accumulated in fp64. Buffers are reused: allocating fresh
    chunk-sized temporaries costs more in page faults than the arithmetic.
    """

    def __init__(self) -> None:
        self._x = torch.empty(COMPARE_CHUNK_ELEMENTS)
        self._y = torch.empty(COMPARE_CHUNK_ELEMENTS)

    def sq_diff(self, a: torch.Tensor, b: torch.Tensor | None) -> float:
        """||a - b||^2 (||a||^2 when b is None) over flattened tensors."""
        a = a.reshape(-1)
        if b is not None and torch.equal(a, b.reshape(-1)):
            return 0.0
        total = 0.0
        for start in range(0, a.numel(), COMPARE_CHUNK_ELEMENTS):
            stop = min(start + COMPARE_CHUNK_ELEMENTS, a.numel())
            x = self._x[: stop - start]
            x.copy_(a[start:stop])
            if b is not None:
                y = self._y[: stop - start]
                y.copy_(b.reshape(-1)[start:stop])
                x.sub_(y)
            total += float(torch.dot(x, x))
        return total


class _Tensors:
    """Tensors of one checkpoint by name, files opened once."""

    def __init__(self, ckpt: Path, stack: ExitStack):
        self.files = tensor_files(ckpt)
        self._stack, self._handles = stack, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[path].get_tensor(name)


@dataclass(frozen=True)
class Reference:
    """A reference checkpoint with its norms, computed once for many comparisons."""

    path: Path
    sq_ref: float
    sq_ref_delta: float

    @classmethod
    def of(cls, path: Path, base: Path) -> "Reference":
        squares = _ChunkedSquares()
        sq_ref = sq_ref_delta = 0.0
        with ExitStack() as stack:
            ref, base_t = _Tensors(path, stack), _Tensors(base, stack)
            for name in sorted(ref.files):
                r = ref[name]
                sq_ref += squares.sq_diff(r, None)
                sq_ref_delta += squares.sq_diff(r, base_t[name])
        return cls(Path(path), sq_ref, sq_ref_delta)


def compare(candidate: Path, references: Sequence[Reference]) -> list[Comparison]:
    """Compare ``candidate`` with each reference in one streaming pass."""
    squares = _ChunkedSquares()
    with ExitStack() as stack:
        cand = _Tensors(candidate, stack)
        refs = [_Tensors(r.path, stack) for r in references]
        for ref, reference in zip(refs, references):
            if set(ref.files) != set(cand.files):
                diff = sorted(set(ref.files) ^ set(cand.files))[:5]
                raise ValueError(f"{candidate} and {reference.path} hold different tensors, "
                                 f"e.g. {diff}")
        sq_diff = [0.0 for _ in refs]
        identical = [True for _ in refs]
        for name in sorted(cand.files):
            a = cand[name]
            for i, ref in enumerate(refs):
                b = ref[name]
                same_dtype = a.dtype == b.dtype
                part = squares.sq_diff(a, b)
                sq_diff[i] += part
                identical[i] = identical[i] and same_dtype and part == 0.0 and torch.equal(a, b)
    return [Comparison(d, r.sq_ref, r.sq_ref_delta, same)
            for d, r, same in zip(sq_diff, references, identical)]


def remove_tree(path: Path) -> None:
    """Remove a directory tree, including files published read-only."""
    path = Path(path)
    if not path.exists():
        return
    # Read-only files can be unlinked from a writable directory; make every
    # directory writable first, then remove.
    os.chmod(path, stat.S_IRWXU)
    for root, dirs, _files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), stat.S_IRWXU)
    shutil.rmtree(path)
