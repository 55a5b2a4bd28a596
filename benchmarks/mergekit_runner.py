"""Run mergekit 0.1.5 on the same merge as the other systems.

Usage: ``python -m benchmarks.mergekit_runner --base DIR --experts DIR... --out DIR
--operator ties --density 0.5 --lambda 1.0``

Writes the mergekit YAML (absolute paths, bf16, one ``weight`` and ``density``
per expert, ``lambda``, ``normalize`` true for TIES (its disjoint weighted
mean) and false for task arithmetic (a plain weighted sum)), then runs
``mergekit-yaml`` offline on the CPU without copying a tokenizer or writing a
model card. The suite times ``command(...)`` itself, not this wrapper.

Known differences from the naive fp32 reference: mergekit does its arithmetic
in the load dtype (bf16 here) and breaks magnitude ties with an unstable
argsort, so its output differs from the reference by rounding.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import yaml

OPERATORS = {"ties": "ties", "task_arithmetic": "task_arithmetic"}
# --lazy-unpickle exists in 0.1.5; it only matters for pickled (.bin) inputs,
# kept so the configuration is mergekit's documented low-memory one.
FLAGS = ("--no-copy-tokenizer", "--no-write-model-card", "--lazy-unpickle", "--quiet")


def executable() -> str:
    """mergekit-yaml beside this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / "mergekit-yaml"
    if beside.exists():
        return str(beside)
    found = shutil.which("mergekit-yaml")
    if found is None:
        raise SystemExit("mergekit-yaml not found; run `make install` (installs mergekit==0.1.5)")
    return found


def config(
    base: Path,
    experts: Sequence[Path],
    operator: str,
    density: float = 0.5,
    lam: float = 1.0,
    weights: Sequence[float] | None = None,
) -> dict:
    """The mergekit configuration for one merge, as a plain dict."""
    if operator not in OPERATORS:
        raise SystemExit(f"mergekit has no {operator!r} here; choose one of {sorted(OPERATORS)}")
    weights = list(weights) if weights is not None else [1.0] * len(experts)
    models = []
    for expert, weight in zip(experts, weights):
        params: dict[str, float] = {"weight": float(weight)}
        if operator == "ties":
            params["density"] = float(density)
        models.append({"model": str(Path(expert).resolve()), "parameters": params})
    return {
        "merge_method": OPERATORS[operator],
        "base_model": str(Path(base).resolve()),
        "models": models,
        "parameters": {"normalize": operator == "ties", "lambda": float(lam)},
        "dtype": "bfloat16",
    }


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def command(config_path: Path, out: Path) -> list[str]:
    return [executable(), str(config_path), str(out), *FLAGS]


def environment() -> dict[str, str]:
    """Offline and on the CPU: nothing may be downloaded during a measured run."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--experts", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--operator", choices=sorted(OPERATORS), default="ties")
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--lambda", dest="lam", type=float, default=1.0)
    parser.add_argument("--weights", type=float, nargs="+", default=None)
    parser.add_argument("--config", type=Path, default=None,
                        help="where to write the YAML (default: beside --out)")
    args = parser.parse_args(argv)
    cfg_path = args.config or args.out.with_name(args.out.name + ".mergekit.yml")
    cfg = config(args.base, args.experts, args.operator, args.density, args.lam, args.weights)
    write_config(cfg_path, cfg)
    return subprocess.run(command(cfg_path, args.out), env=environment()).returncode


if __name__ == "__main__":
    sys.exit(main())
