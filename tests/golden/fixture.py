"""A tiny, machine-independent family of checkpoints for the golden tests.

Golden values (plan digests, snapshot ids, manifest hashes, output bytes) must
be the same on every machine, so nothing here draws from torch's or numpy's
distribution samplers, whose bits may differ between CPUs or library
versions. Values come from numpy's ``Philox`` raw stream (guaranteed stable),
turned into numbers with plain float64 arithmetic, then rounded once to bf16.
No MergePipe code is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from numpy.random import Philox
from safetensors.torch import save_file

HIDDEN, VOCAB, KV, MLP = 32, 64, 16, 48
#: Small blocks so that every tensor spans several: 8 rows of a 32-wide bf16 row.
BLOCK_BYTES = 512


def layout() -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (shard file, shape); a 2-layer Llama-like model in two shards."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("model-00001-of-00002.safetensors", (VOCAB, HIDDEN)),
    }
    for layer in range(2):
        shard = f"model-0000{layer + 1}-of-00002.safetensors"
        p = f"model.layers.{layer}."
        out.update({
            p + "input_layernorm.weight": (shard, (HIDDEN,)),
            p + "self_attn.q_proj.weight": (shard, (HIDDEN, HIDDEN)),
            p + "self_attn.k_proj.weight": (shard, (KV, HIDDEN)),
            p + "self_attn.v_proj.weight": (shard, (KV, HIDDEN)),
            p + "self_attn.o_proj.weight": (shard, (HIDDEN, HIDDEN)),
            p + "post_attention_layernorm.weight": (shard, (HIDDEN,)),
            p + "mlp.gate_proj.weight": (shard, (MLP, HIDDEN)),
            p + "mlp.up_proj.weight": (shard, (MLP, HIDDEN)),
            p + "mlp.down_proj.weight": (shard, (HIDDEN, MLP)),
        })
    out["model.norm.weight"] = ("model-00002-of-00002.safetensors", (HIDDEN,))
    out["lm_head.weight"] = ("model-00002-of-00002.safetensors", (VOCAB, HIDDEN))
    return out


def _uniform(key: int, name: str, n: int) -> np.ndarray:
    """n float64 values in [-1, 1) from the raw Philox stream of (key, name)."""
    name_key = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") ^ (len(name) << 56)
    words = Philox(key=[key, name_key]).random_raw(n)
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53 * 2.0 - 1.0


def _tensor(values: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.float32).reshape(shape)).to(torch.bfloat16)


def _write(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, (shard, _) in layout().items():
        shards.setdefault(shard, {})[name] = tensors[name]
    shards["model-00002-of-00002.safetensors"]["model.position_ids"] = tensors["model.position_ids"]
    weight_map = {}
    total = 0
    for shard, content in shards.items():
        save_file(content, str(root / shard), metadata={"format": "pt"})
        for name, t in content.items():
            weight_map[name] = shard
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": MLP, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (root / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    return root


def _base_tensors() -> dict[str, torch.Tensor]:
    tensors = {}
    for name, (_, shape) in layout().items():
        n = int(np.prod(shape))
        values = _uniform(1, name, n)
        values = 1.0 + 0.05 * values if len(shape) == 1 else 0.04 * values
        tensors[name] = _tensor(values, shape)
    tensors["model.position_ids"] = torch.arange(16, dtype=torch.int64).view(1, 16)
    return tensors


#: expert -> (seed, relative scale, which tensors it changes, fraction of leading rows changed)
EXPERTS = {
    "e1": (11, 0.02, lambda n: True, 1.0),
    "e2": (12, 0.05, lambda n: ".mlp." in n, 1.0),
    "e3": (13, 0.03, lambda n: "self_attn" in n or "embed" in n or "layers.1.input" in n, 0.5),
}


def make_family(root: Path) -> dict[str, Path]:
    """Write the base and the three experts under ``root``; their directories."""
    base = _base_tensors()
    paths = {"base": _write(root / "base", base)}
    for expert, (seed, scale, touches, row_fraction) in EXPERTS.items():
        tensors = dict(base)
        for name, (_, shape) in layout().items():
            if not touches(name):
                continue
            n = int(np.prod(shape))
            delta = scale * 0.04 * _uniform(seed, name, n).reshape(shape)
            if len(shape) == 2 and row_fraction < 1.0:
                delta[int(shape[0] * row_fraction):] = 0.0  # later rows stay identical to the base
            merged = base[name].to(torch.float64).numpy() + delta
            tensors[name] = _tensor(merged.reshape(-1), shape)
        paths[expert] = _write(root / expert, tensors)
    return paths
