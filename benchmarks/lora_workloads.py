"""PEFT LoRA adapters for a benchmark base: K adapters of rank R on every attention and MLP projection.

Usage: ``python -m benchmarks.lora_workloads --layout qwen3-0.6b --adapters 8 --rank 16``

Each adapter is what ``peft``'s ``save_pretrained`` writes for a LoRA on the
base's ``q/k/v/o_proj`` and ``gate/up/down_proj``: ``adapter_config.json``
and ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight`` (r × in) and ``…lora_B.weight``
(out × r), in float32 (PEFT's default adapter dtype). A ~ N(0, 1/in) as
PEFT's Kaiming init gives it; B, which training moves away from zero, is
drawn so that ΔW = (α/r)·B·A has an rms of about ``DELTA_REL`` of the
weights' scale, the size of the full-model experts' deltas in
``workloads.py``. Each (adapter, tensor) has its own seeded generator: the
same arguments always give the same bytes, and a finished adapter (its
``.complete.json`` marker holds the spec hash) is reused.

The base is ``workloads.py``'s base for the layout (generated if missing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.checkpoints import remove_tree
from benchmarks.workloads import BASE_STD, DEFAULT_ROOT, EXPERTS, LAYOUTS, Layout, ensure_workload

GENERATOR_VERSION = 1
#: The modules a typical LoRA fine-tune targets (all linear projections of a Qwen3 block).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DELTA_REL = 2e-3  # rms of ΔW / BASE_STD
ALPHA_PER_RANK = 2  # lora_alpha = 2 r, the common choice (scale 2)


@dataclass(frozen=True)
class LoraWorkload:
    root: Path
    base: Path
    adapters: tuple[Path, ...]
    rank: int


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.sha256(json.dumps([str(k) for k in key]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def adapter_tensors(layout: Layout, name: str, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """The factors of adapter ``name``: PEFT's key names, float32."""
    tensors: dict[str, torch.Tensor] = {}
    scale = ALPHA_PER_RANK
    for spec in layout.tensors():
        module = spec.name.removesuffix(".weight")
        if spec.layer is None or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        out_features, in_features = spec.shape
        gen = _generator(GENERATOR_VERSION, layout.name, seed, name, rank, spec.name)
        a = torch.randn((rank, in_features), generator=gen) / math.sqrt(in_features)
        # var(ΔW) = scale² · r · var(B) · var(A) = (DELTA_REL · BASE_STD)²
        b_std = DELTA_REL * BASE_STD / (scale * math.sqrt(rank / in_features))
        b = torch.randn((out_features, rank), generator=gen) * b_std
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    return tensors


def adapter_config(rank: int, base: Path) -> dict:
    """adapter_config.json as peft writes it for this LoRA (the fields MergePipe and peft read)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": ALPHA_PER_RANK * rank, "lora_dropout": 0.0, "target_modules": sorted(TARGETS),
        "fan_in_fan_out": False, "bias": "none", "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True,
        "inference_mode": True,
    }


def ensure_lora_workload(layout: Layout | str, num_adapters: int = 8, rank: int = 16, seed: int = 0,
                         root: Path = DEFAULT_ROOT) -> LoraWorkload:
    """Generate (or reuse) the base and ``num_adapters`` adapters of rank ``rank``."""
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    if not 1 <= num_adapters <= len(EXPERTS):
        raise ValueError(f"num_adapters must be in 1..{len(EXPERTS)}, got {num_adapters}")
    base = ensure_workload(layout, 1, seed, root).base
    out_root = Path(root) / f"{layout.name}-s{seed}" / f"lora-r{rank}"
    out_root.mkdir(parents=True, exist_ok=True)
    adapters = []
    for profile in EXPERTS[:num_adapters]:
        out = out_root / profile.name
        spec = {"version": GENERATOR_VERSION, "layout": layout.name, "seed": seed, "rank": rank,
                "name": profile.name, "delta_rel": DELTA_REL, "targets": TARGETS}
        spec_hash = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
        marker = out_root / f"{profile.name}.complete.json"
        if not (marker.exists() and json.loads(marker.read_text()).get("spec") == spec_hash):
            remove_tree(out)
            out.mkdir(parents=True)
            save_file(adapter_tensors(layout, profile.name, rank, seed), str(out / "adapter_model.safetensors"))
            (out / "adapter_config.json").write_text(json.dumps(adapter_config(rank, base), indent=2) + "\n")
            marker.write_text(json.dumps({"spec": spec_hash}))
        adapters.append(out)
    return LoraWorkload(out_root, base, tuple(adapters), rank)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3-tiny")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    wl = ensure_lora_workload(args.layout, args.adapters, args.rank, args.seed, args.root)
    size = sum((a / "adapter_model.safetensors").stat().st_size for a in wl.adapters)
    print(f"{wl.root}: {len(wl.adapters)} rank-{wl.rank} adapters on {wl.base}, {size / 1e6:.1f} MB in all, "
          f"ready in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
