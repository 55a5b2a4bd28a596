"""Merge LoRA adapters into their base with the peft library, as a Python user would.

Usage: ``python -m benchmarks.peft_merge --base B --adapters A1 A2 ... --out DIR --operator task_arithmetic``

task_arithmetic: every adapter is loaded, ``add_weighted_adapter(...,
combination_type="cat")`` with weight 1 each (Σ ΔWi exactly: the factors
are concatenated), then ``merge_and_unload()``. ties: ``combination_type=
"ties_svd"`` with ``density`` (TIES on each full ΔW, then an SVD back to a
LoRA of the summed rank, which is peft's way to TIES-merge LoRAs), then
``merge_and_unload()``. The base is loaded in its own dtype (bf16), the
result saved with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--adapters", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--operator", choices=("task_arithmetic", "ties"), default="task_arithmetic")
    parser.add_argument("--density", type=float, default=0.5)
    args = parser.parse_args(argv)

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16)
    names = [f"a{i}" for i in range(len(args.adapters))]
    peft_model = PeftModel.from_pretrained(model, args.adapters[0], adapter_name=names[0])
    for name, path in zip(names[1:], args.adapters[1:]):
        peft_model.load_adapter(path, adapter_name=name)
    weights = [1.0] * len(names)
    if args.operator == "task_arithmetic":
        peft_model.add_weighted_adapter(names, weights, "merged", combination_type="cat")
    else:
        peft_model.add_weighted_adapter(names, weights, "merged", combination_type="ties_svd", density=args.density)
    peft_model.set_adapter("merged")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(args.out)


if __name__ == "__main__":
    main()
