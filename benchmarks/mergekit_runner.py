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

The other methods (``METHODS``: issue 42's every-method groups) are written
as a user writes them, each with its own parameters and number of models,
computed in float32 (``dtype: float32``) and written in the base's bf16
(``out_dtype: bfloat16``); MergePipe runs the same file (``mergepipe merge
--config``), so both sides compute in fp32 from one configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml

OPERATORS = {"ties": "ties", "task_arithmetic": "task_arithmetic"}


@dataclass(frozen=True)
class Method:
    """A mergekit method as the every-method groups write it: how many experts it merges, each one's
    ``weight`` (none for the weightless methods) and the global ``parameters``, mergekit's names."""

    experts: int
    weights: tuple[float, ...] = ()
    parameters: tuple[tuple[str, float | bool | int], ...] = ()
    budgetable: bool = True  # whether a budget under 100% means something (passthrough: none)


#: Each method at the K mergekit allows it (nuslerp: two task vectors; nearswap and arcee_fusion: one
#: expert against the base; passthrough: the base's lower half of the layers under the expert's upper half).
METHODS = {
    "nuslerp": Method(2, (0.6, 0.4), (("nuslerp_flatten", True), ("nuslerp_row_wise", False))),
    "multislerp": Method(4, (1.0, 1.0, 1.0, 1.0), (("normalize_weights", True), ("eps", 1e-8))),
    "karcher": Method(4, (), (("max_iter", 10), ("tol", 1e-5))),
    "sce": Method(4, (), (("select_topk", 0.5),)),
    "nearswap": Method(1, (), (("t", 1e-4),)),
    "arcee_fusion": Method(1),
    "ram": Method(4, (), (("epsilon", 1e-5),)),
    "ramplus_tl": Method(4, (), (("r", 0.1), ("alpha", 0.2), ("epsilon", 1e-5))),
    "passthrough": Method(1, budgetable=False),
}

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
    if operator in METHODS:
        return method_config(base, experts, operator)
    if operator not in OPERATORS:
        raise SystemExit(f"mergekit has no {operator!r} here; choose one of {sorted([*OPERATORS, *METHODS])}")
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


def method_config(base: Path, experts: Sequence[Path], operator: str) -> dict:
    """The configuration of one of ``METHODS``: float32 compute, bf16 output (the base's dtype)."""
    method = METHODS[operator]
    if len(experts) != method.experts:
        raise SystemExit(f"{operator} merges {method.experts} expert(s) here, got {len(experts)}")
    base_path, paths = str(Path(base).resolve()), [str(Path(e).resolve()) for e in experts]
    cfg: dict = {"merge_method": operator}
    if operator == "passthrough":  # a frankenmerge: layers [0, n/2) of the base, then [n/2, n) of the expert
        layers = json.loads((Path(base) / "config.json").read_text())["num_hidden_layers"]
        half = layers // 2
        cfg["slices"] = [{"sources": [{"model": base_path, "layer_range": [0, half]}]},
                         {"sources": [{"model": paths[0], "layer_range": [half, layers]}]}]
    else:
        cfg["base_model"] = base_path
        cfg["models"] = [{"model": path, **({"parameters": {"weight": w}} if method.weights else {})}
                         for path, w in zip(paths, method.weights or [1.0] * len(paths))]
        if method.parameters:
            cfg["parameters"] = dict(method.parameters)
    return {**cfg, "dtype": "float32", "out_dtype": "bfloat16"}


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
    parser.add_argument("--operator", choices=sorted([*OPERATORS, *METHODS]), default="ties")
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
