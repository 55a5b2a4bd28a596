"""The end-to-end demo: tiny real checkpoints, then the whole MergePipe loop.

``make demo`` (``examples/demo.py``) writes a small Qwen3-layout base model and three experts
(bf16 safetensors and a tiny character tokenizer that ``transformers``
loads), then runs, as real CLI commands printed before each step: init-db,
register, analyze, models, plan under a 25% budget, a budgeted merge and a
full merge, verify, explain, lineage, compares the two merges, and ends with
an evaluation of the merges when transformers is installed.

Experts are made the way fine-tunes look: small deltas concentrated on some
layers (a "math" expert on upper MLPs, a "code" expert on attention), and
untouched tensors left byte-identical to the base.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe.errors import OutputExistsError
from mergepipe.txn.publish import remove_tree

#: The marker that lets the demo delete its own previous output, and nothing else.
DEMO_MARKER = ".mergepipe-demo"


@dataclass(frozen=True)
class TinyQwen3:
    """A scaled-down Qwen3 layout (tied embeddings, q/k norms)."""

    layers: int = 4
    hidden: int = 256
    intermediate: int = 704
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    vocab: int = 4096

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (self.head_dim,),
                    p + "self_attn.k_norm.weight": (self.head_dim,),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (self.intermediate, h),
                    p + "mlp.up_proj.weight": (self.intermediate, h),
                    p + "mlp.down_proj.weight": (h, self.intermediate),
                }
            )
        out["model.norm.weight"] = (h,)
        return out

    def config(self) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "tie_word_embeddings": True,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }


#: The demo's evaluation data (``held-out.txt``): three paragraphs, three examples.
HELD_OUT = "A merge keeps what each expert learned.\n\nTwo plus two is four.\n\ndef add(a, b):\n    return a + b\n"

#: expert name -> (which tensors it changes, relative delta scale by layer position)
EXPERTS = {
    "math": ("mlp", lambda pos: 0.2 + 2.0 * pos),  # upper MLPs
    "code": ("self_attn", lambda pos: 1.5 * math.exp(-((pos - 0.5) ** 2) / 0.05)),  # middle attention
    "chat": ("", lambda pos: 0.4),  # a little everywhere, embeddings too
}


def write_model(root: Path, tensors: dict[str, torch.Tensor], layout: TinyQwen3) -> Path:
    root.mkdir(parents=True)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(layout.config(), indent=2))
    return write_tokenizer(root)


def write_tokenizer(folder: Path) -> Path:
    """A real, tiny tokenizer (what ``AutoTokenizer`` loads): one token per character (printable ASCII and
    newline) after ``<unk>``, ``<s>`` and ``</s>`` (ids 0, 1, 2), ``<s>`` prepended. Without the
    ``tokenizers`` package (a core install, which cannot evaluate either) there is none."""
    try:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    except ImportError:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", "\n"] + [chr(c) for c in range(32, 127)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
            }
        )
    )
    return folder


def make_demo_models(workdir: Path, layout: TinyQwen3 = TinyQwen3(), seed: int = 0) -> dict[str, Path]:
    """Write the base and the experts under ``workdir``; returns their paths."""
    gen = torch.Generator().manual_seed(seed)
    base = {}
    for name, shape in layout.shapes().items():
        if len(shape) == 1:
            base[name] = (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        else:
            base[name] = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    paths = {"base": write_model(workdir / "base", base, layout)}
    for k, (expert, (module, scale_at)) in enumerate(EXPERTS.items()):
        gen = torch.Generator().manual_seed(seed + 100 + k)
        tensors = {}
        for name, value in base.items():
            layer = _layer(name)
            touched = (module in name and layer is not None) or (expert == "chat" and value.dim() == 2)
            if not touched or value.dim() == 1:
                tensors[name] = value.clone()  # byte-identical to the base
                continue
            pos = 0.5 if layer is None else layer / max(1, layout.layers - 1)
            rank = 4
            low_rank = torch.randn(value.shape[0], rank, generator=gen) @ torch.randn(
                rank, value.shape[1], generator=gen
            )
            delta = 2e-3 * scale_at(pos) * low_rank / math.sqrt(rank)
            tensors[name] = (value.float() + delta).to(torch.bfloat16)
        paths[expert] = write_model(workdir / expert, tensors, layout)
    return paths


def retrain(expert_dir: Path, out_dir: Path, layer: int, seed: int = 7) -> Path:
    """A "retrained" version of an expert: its tensors, with a new delta in the 2-D weights of one layer."""
    gen = torch.Generator().manual_seed(seed)
    with safe_open(str(expert_dir / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name, value in tensors.items():
        if _layer(name) == layer and value.dim() == 2:
            tensors[name] = (value.float() + 1e-3 * torch.randn(value.shape, generator=gen)).to(torch.bfloat16)
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for extra in expert_dir.glob("*.json"):  # config and tokenizer
        (out_dir / extra.name).write_bytes(extra.read_bytes())
    return out_dir


def same_weights(a_dir: Path, b_dir: Path) -> bool:
    """Whether two single-file checkpoints hold byte-identical weights."""
    return (a_dir / "model.safetensors").read_bytes() == (b_dir / "model.safetensors").read_bytes()


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def prepare_workdir(workdir: Path) -> None:
    """Start from an empty directory; only a previous demo's output is removed."""
    if workdir.exists():
        if not (workdir / DEMO_MARKER).exists() and any(workdir.iterdir()):
            raise OutputExistsError(f"{workdir} exists and was not made by `make demo`; choose another --workdir")
        remove_tree(workdir)
    workdir.mkdir(parents=True)
    (workdir / DEMO_MARKER).write_text("made by make demo; safe to delete\n")


def relative_error(a_dir: Path, b_dir: Path) -> float:
    """‖a − b‖_F / ‖b‖_F over all tensors of two single-file checkpoints (fp64)."""
    num = den = 0.0
    with (
        safe_open(str(a_dir / "model.safetensors"), "pt") as fa,
        safe_open(str(b_dir / "model.safetensors"), "pt") as fb,
    ):
        for name in fb.keys():
            a, b = fa.get_tensor(name).double(), fb.get_tensor(name).double()
            num += float(((a - b) ** 2).sum())
            den += float((b**2).sum())
    return math.sqrt(num / den) if den else 0.0


def make_demo_adapter(base_dir: Path, out_dir: Path, rank: int = 4, seed: int = 11) -> Path:
    """A PEFT LoRA adapter for the demo base, as ``save_pretrained`` writes one: rank ``rank`` on every
    layer's q_proj and v_proj, f32 factors (B drawn non-zero, as training leaves it)."""
    gen = torch.Generator().manual_seed(seed)
    factors = {}
    with safe_open(str(base_dir / "model.safetensors"), "pt") as handle:
        for name in handle.keys():
            if _layer(name) is None or not name.endswith(("q_proj.weight", "v_proj.weight")):
                continue
            rows, cols = handle.get_slice(name).get_shape()
            module = f"base_model.model.{name.removesuffix('.weight')}"
            factors[f"{module}.lora_A.weight"] = torch.randn(rank, cols, generator=gen) / math.sqrt(cols)
            factors[f"{module}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 5e-4
    out_dir.mkdir(parents=True)
    save_file(factors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"],
        "fan_in_fan_out": False,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "lora_dropout": 0.0,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
