"""The straightforward full-read merge people write today; also the reference output.

Usage: ``python -m benchmarks.naive_merge --base DIR --experts DIR... --out DIR
--operator ties --density 0.5 --lambda 1.0``

Every tensor of the base and of every expert is loaded in full with the
safetensors library, merged in fp32 with plain torch, and saved in the base's
dtype with ``save_file``, one output file per base shard.

Operators (the published definitions, with mergekit's parameter conventions):

- task arithmetic: ``base + lambda * sum_i w_i * delta_i``;
- TIES: trim each delta to its top-k magnitudes, k = max(1, int(density * n)),
  ties at the threshold broken by position (a stable sort); elect the sign of
  ``sum_i w_i * trimmed_i`` (>= 0 counts as +); average the trimmed deltas that
  agree with it, weighted by w_i (the disjoint mean); ``base + lambda * mean``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.checkpoints import INDEX_NAME, sidecar_files, tensor_files, weight_files

OPERATORS = ("task_arithmetic", "ties")
MERGEABLE = (torch.float32, torch.float16, torch.bfloat16)


def trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k largest |delta| (k = max(1, int(density * n))), ties by position."""
    flat = delta.reshape(-1)
    n = flat.numel()
    k = max(1, int(density * n))
    if k >= n:
        return delta.clone()
    magnitude = flat.abs()
    tau = torch.kthvalue(magnitude, n - k + 1).values  # the k-th largest
    keep = magnitude > tau
    if tau > 0:  # (entries tied at tau = 0 are zeros: keeping them changes nothing)
        at_tau = (magnitude == tau).nonzero().squeeze(1)
        keep[at_tau[: k - int(keep.sum())]] = True  # the first entries tied at tau, row-major
    return (flat * keep).reshape(delta.shape)


def task_arithmetic(
    base: torch.Tensor, deltas: Iterable[torch.Tensor], weights: Sequence[float], lam: float
) -> torch.Tensor:
    merged = torch.zeros_like(base)
    for delta, w in zip(deltas, weights):
        merged += w * delta
    return base + lam * merged


def ties(
    base: torch.Tensor,
    deltas: Iterable[torch.Tensor],
    weights: Sequence[float],
    density: float,
    lam: float,
) -> torch.Tensor:
    # Every trimmed delta is kept until the sign election: K full tensors in fp32.
    trimmed = [w * trim(d, density) for d, w in zip(deltas, weights)]
    elected = torch.where(sum(trimmed) >= 0, 1.0, -1.0)
    numerator = torch.zeros_like(base)
    denominator = torch.zeros_like(base)
    for t, w in zip(trimmed, weights):
        agree = torch.sign(t) == elected  # trimmed-away entries (sign 0) never agree
        numerator += torch.where(agree, t, 0.0)
        denominator += torch.where(agree, w, 0.0)
    denominator[denominator == 0] = 1.0
    return base + lam * (numerator / denominator)


def merge_tensor(
    base: torch.Tensor,
    experts: Iterable[torch.Tensor],
    operator: str,
    weights: Sequence[float],
    density: float,
    lam: float,
) -> torch.Tensor:
    """Merge one tensor in fp32 and return it in the base's dtype.

    ``experts`` may be a generator: each expert tensor is loaded when its delta
    is needed and dropped after.
    """
    if base.dtype not in MERGEABLE:
        return base  # integer buffers and the like are carried through
    b = base.float()
    deltas = (e.float() - b for e in experts)
    if operator == "task_arithmetic":
        out = task_arithmetic(b, deltas, weights, lam)
    elif operator == "ties":
        out = ties(b, deltas, weights, density, lam)
    else:
        raise ValueError(f"unknown operator {operator!r}; choose one of {OPERATORS}")
    return out.to(base.dtype)


def merge(
    base: Path,
    experts: Sequence[Path],
    out: Path,
    operator: str,
    density: float = 0.5,
    lam: float = 1.0,
    weights: Sequence[float] | None = None,
) -> None:
    weights = list(weights) if weights is not None else [1.0] * len(experts)
    if len(weights) != len(experts):
        raise SystemExit(f"got {len(weights)} weights for {len(experts)} experts")
    out.mkdir(parents=True)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def handle(path: Path):
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path]

        expert_files = [tensor_files(e) for e in experts]
        for shard in weight_files(base):
            merged: dict[str, torch.Tensor] = {}
            fb = handle(shard)
            for name in fb.keys():
                tensors = (handle(files[name]).get_tensor(name) for files in expert_files)
                merged[name] = merge_tensor(fb.get_tensor(name), tensors, operator, weights,
                                            density, lam)
            save_file(merged, out / shard.name, metadata={"format": "pt"})
            del merged
    if (base / INDEX_NAME).exists():
        shutil.copyfile(base / INDEX_NAME, out / INDEX_NAME)
    for sidecar in sidecar_files(base):
        shutil.copyfile(sidecar, out / sidecar.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--experts", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--operator", choices=OPERATORS, default="ties")
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--lambda", dest="lam", type=float, default=1.0)
    parser.add_argument("--weights", type=float, nargs="+", default=None)
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it or choose another --out")
    started = time.perf_counter()
    merge(args.base, args.experts, args.out, args.operator, args.density, args.lam, args.weights)
    print(json.dumps({"seconds": time.perf_counter() - started, "out": str(args.out)}))


if __name__ == "__main__":
    main()
