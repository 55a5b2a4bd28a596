"""Deterministic benchmark workloads: a base checkpoint and K experts at a real layout.

Usage: ``python -m benchmarks.workloads --layout qwen3-0.6b --experts 8``

The base is a random init with realistic scales (weights N(0, 0.02), RMSNorm
weights near 1). Each expert is the base plus a delta shaped like a
fine-tune's: a low-rank component plus sparse outliers, about 1e-3 of the
weights' scale, concentrated where that expert "learned" (a math expert on
upper-layer MLPs, a code expert on middle-layer attention, ...), and zero on
whole tensors it did not train (embeddings for most experts, norms often,
MLPs of attention-only adapters), which are then byte-identical to the base.

Everything is a pure function of (layout, seed, expert profile): each tensor
draws from its own generator keyed by those, so the same spec always gives
the same bytes. Generation is cached: a model directory is reused when its
``<model>.complete.json`` marker (written last) holds the same spec hash.
Deltas are rounded to bf16 like a real bf16 checkpoint, so the smallest
entries of a delta vanish where the weight's bf16 spacing exceeds them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open

from benchmarks.checkpoints import SINGLE_NAME, StreamingSafetensorsWriter, remove_tree

DEFAULT_ROOT = Path(__file__).resolve().parent / "workloads"
# Bump when the generation algorithm changes: it invalidates every cached model.
GENERATOR_VERSION = 1
DTYPE = torch.bfloat16
BASE_STD = 0.02  # initializer_range of Qwen3 configs
NORM_JITTER = 0.05  # RMSNorm weights: 1 + N(0, 0.05), so norms are not all exactly 1
CHUNK_ELEMENTS = 4 << 20  # rows are generated in ~16 MiB fp32 chunks: cache-friendly, low memory
LOW_RANK = 8  # rank of the structured part of each delta
LOW_RANK_SHARE = 0.8  # share of delta energy in the low-rank part; the rest is sparse
SPARSE_DENSITY = 0.002  # fraction of entries carrying a sparse outlier
BACKGROUND_REL = 3e-4  # delta rms / BASE_STD away from an expert's focus
PEAK_REL = 5e-3  # additional delta rms / BASE_STD at the centre of its focus
OFF_FOCUS = 0.2  # the other module group (attn vs mlp) gets this share of the peak
# Absolute delta rms on norm weights (~1, bf16 spacing 2**-8..2**-7): about a fifth
# of the entries of a touched norm move by one bf16 step, the rest round away.
NORM_DELTA = 2e-3
EMBED_REL = 2e-3  # delta rms / BASE_STD on the embedding rows an expert touches
EMBED_RANGES = 4  # touched embedding rows come in this many contiguous ranges
DISK_MARGIN_BYTES = 2 << 30  # never fill the disk: keep this much free after generating
# Everything above that decides the bytes; part of every model's spec hash.
GENERATION_CONSTANTS = {
    "version": GENERATOR_VERSION, "dtype": str(DTYPE), "base_std": BASE_STD,
    "norm_jitter": NORM_JITTER, "chunk_elements": CHUNK_ELEMENTS, "low_rank": LOW_RANK,
    "low_rank_share": LOW_RANK_SHARE, "sparse_density": SPARSE_DENSITY,
    "background_rel": BACKGROUND_REL, "peak_rel": PEAK_REL, "off_focus": OFF_FOCUS,
    "norm_delta": NORM_DELTA, "embed_rel": EMBED_REL, "embed_ranges": EMBED_RANGES,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    group: str  # "embed", "attn", "mlp" or "norm"
    layer: int | None  # None for embeddings and the final norm


@dataclass(frozen=True)
class Layout:
    """A Qwen3 decoder layout; tensor names and shapes as in HF checkpoints."""

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    max_position: int = 40960
    rope_theta: float = 1_000_000.0
    bos_token_id: int = 151643
    eos_token_id: int = 151645

    def tensors(self) -> list[TensorSpec]:
        """All tensors, sorted by name as the safetensors library stores them."""
        h, q, kv = self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        specs = [
            TensorSpec("model.embed_tokens.weight", (self.vocab, h), "embed", None),
            TensorSpec("model.norm.weight", (h,), "norm", None),
        ]
        per_layer = {
            "input_layernorm.weight": ((h,), "norm"),
            "post_attention_layernorm.weight": ((h,), "norm"),
            "self_attn.q_proj.weight": ((q, h), "attn"),
            "self_attn.k_proj.weight": ((kv, h), "attn"),
            "self_attn.v_proj.weight": ((kv, h), "attn"),
            "self_attn.o_proj.weight": ((h, q), "attn"),
            "self_attn.q_norm.weight": ((self.head_dim,), "norm"),
            "self_attn.k_norm.weight": ((self.head_dim,), "norm"),
            "mlp.gate_proj.weight": ((self.intermediate, h), "mlp"),
            "mlp.up_proj.weight": ((self.intermediate, h), "mlp"),
            "mlp.down_proj.weight": ((h, self.intermediate), "mlp"),
        }
        for i in range(self.num_layers):
            for suffix, (shape, group) in per_layer.items():
                specs.append(TensorSpec(f"model.layers.{i}.{suffix}", shape, group, i))
        return sorted(specs, key=lambda s: s.name)

    def param_count(self) -> int:
        return sum(math.prod(s.shape) for s in self.tensors())

    def nbytes(self) -> int:
        return self.param_count() * torch.empty(0, dtype=DTYPE).element_size()

    def config(self) -> dict:
        """config.json as Qwen publishes it (tied embeddings: no lm_head)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": BASE_STD,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": self.max_position,
            "max_window_layers": self.num_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab,
        }


LAYOUTS = {
    # Qwen/Qwen3-0.6B: 596,049,920 parameters, 1.19 GB in bf16, one model.safetensors.
    "qwen3-0.6b": Layout("qwen3-0.6b", 28, 1024, 3072, 16, 8, 128, 151936),
    # Qwen/Qwen3-1.7B's shapes: ~1.72B parameters (tied embeddings), 3.44 GB in bf16, one file here.
    "qwen3-1.7b": Layout("qwen3-1.7b", 28, 2048, 6144, 16, 8, 128, 151936),
    # Qwen3-0.6B's shapes with 8 of its 28 layers: ~281M parameters, ~562 MB, for
    # throughput checks that want "a few hundred MB" in one checkpoint.
    "qwen3-0.6b-8l": Layout("qwen3-0.6b-8l", 8, 1024, 3072, 16, 8, 128, 151936),
    # Same shape family scaled down for the quick suite: ~42M parameters, ~83 MB.
    "qwen3-tiny": Layout(
        "qwen3-tiny", 8, 512, 1536, 8, 4, 64, 32000, bos_token_id=31998, eos_token_id=31999
    ),
}


@dataclass(frozen=True)
class ExpertProfile:
    """Where and how strongly one expert's fine-tune changed the base."""

    name: str
    groups: tuple[str, ...]  # module groups it trained ("attn", "mlp")
    focus: str  # the group its change concentrates on
    centre: float  # depth (0 = first layer, 1 = last) where its change peaks
    width: float  # spread of the peak, as a fraction of depth
    first_layer_frac: float = 0.0  # layers below this fraction are untouched
    norms: bool = False  # whether it changed RMSNorm weights
    embed_rows: float = 0.0  # fraction of vocabulary rows it changed (0: untouched)
    strength: float = 1.0


# The first K profiles form the K-expert workload, so every prefix is varied.
EXPERTS = (
    ExpertProfile("math", ("attn", "mlp"), "mlp", centre=0.85, width=0.15),
    ExpertProfile("code", ("attn",), "attn", centre=0.5, width=0.15),  # attention-only adapter
    ExpertProfile("multilingual", ("attn", "mlp"), "mlp", 0.1, 0.15, norms=True, embed_rows=0.15),
    ExpertProfile("safety", ("attn", "mlp"), "attn", 0.95, 0.1, first_layer_frac=0.75, norms=True),
    ExpertProfile("chat", ("attn", "mlp"), "attn", centre=0.5, width=0.5, norms=True),
    ExpertProfile("medical", ("mlp",), "mlp", centre=0.65, width=0.2),  # MLP-only adapter
    ExpertProfile("legal", ("attn", "mlp"), "attn", centre=0.75, width=0.15),
    ExpertProfile("reasoning", ("attn", "mlp"), "mlp", 0.6, 0.3, strength=1.5),
)


def delta_scale(profile: ExpertProfile, spec: TensorSpec, num_layers: int) -> float:
    """Target delta rms for one tensor of one expert; 0 means byte-identical to the base."""
    if spec.group == "embed":
        return EMBED_REL * BASE_STD * profile.strength if profile.embed_rows > 0 else 0.0
    if spec.layer is None:  # the final norm
        return NORM_DELTA if profile.norms else 0.0
    depth = (spec.layer + 0.5) / num_layers
    if depth < profile.first_layer_frac:
        return 0.0
    if spec.group == "norm":
        return NORM_DELTA if profile.norms else 0.0
    if spec.group not in profile.groups:
        return 0.0
    bump = math.exp(-0.5 * ((depth - profile.centre) / profile.width) ** 2)
    focus = 1.0 if spec.group == profile.focus else OFF_FOCUS
    return (BACKGROUND_REL + PEAK_REL * bump * focus) * BASE_STD * profile.strength


@dataclass(frozen=True)
class Workload:
    root: Path
    layout: Layout
    base: Path
    experts: tuple[Path, ...]  # in EXPERTS order

    def expert_dirs(self, k: int) -> list[Path]:
        if k > len(self.experts):
            raise ValueError(f"workload has {len(self.experts)} experts, {k} requested")
        return list(self.experts[:k])


def _generator(seed: int, *key: str) -> torch.Generator:
    digest = hashlib.sha256("\x1f".join((str(seed),) + key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _row_chunks(rows: int, cols: int):
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _write_sidecars(layout: Layout, out: Path) -> None:
    (out / "config.json").write_text(json.dumps(layout.config(), indent=2) + "\n")
    tokenizer = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": layout.max_position,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2) + "\n")


def _write_base(layout: Layout, seed: int, out: Path) -> None:
    specs = layout.tensors()
    with StreamingSafetensorsWriter(out / SINGLE_NAME, [(s.name, DTYPE, s.shape) for s in specs]) as w:
        for spec in specs:
            gen = _generator(seed, "base", spec.name)
            rows, cols = spec.shape[0], math.prod(spec.shape[1:])
            for start, stop in _row_chunks(rows, cols):
                chunk = torch.randn((stop - start,) + spec.shape[1:], generator=gen)
                if spec.group == "norm":
                    chunk = chunk.mul_(NORM_JITTER).add_(1.0)
                else:
                    chunk = chunk.mul_(BASE_STD)
                w.write_rows(spec.name, chunk.to(DTYPE))


def _embed_row_mask(rows: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Contiguous ranges of touched rows (e.g. one script's tokens), one per segment."""
    mask = torch.zeros(rows, dtype=torch.bool)
    segment = rows // EMBED_RANGES
    length = max(1, int(rows * fraction) // EMBED_RANGES)
    for i in range(EMBED_RANGES):
        offset = int(torch.randint(0, max(1, segment - length), (1,), generator=gen))
        start = i * segment + offset
        mask[start : start + length] = True
    return mask


def _delta_rows(
    u: torch.Tensor, v: torch.Tensor, start: int, stop: int, rms: float, gen: torch.Generator
) -> torch.Tensor:
    """Low-rank part U[start:stop] @ V plus sparse outliers, with total rms ~ ``rms``."""
    delta = (u[start:stop] @ v).mul_(rms * math.sqrt(LOW_RANK_SHARE / LOW_RANK))
    flat = delta.view(-1)
    count = max(1, round(SPARSE_DENSITY * flat.numel()))
    where = torch.unique(torch.randint(0, flat.numel(), (count,), generator=gen))
    outliers = torch.randn(where.numel(), generator=gen)
    flat[where] += outliers.mul_(rms * math.sqrt((1 - LOW_RANK_SHARE) / SPARSE_DENSITY))
    return delta


@contextmanager
def derived_model(layout: Layout, base: Path, out: Path) -> Iterator[tuple[Any, StreamingSafetensorsWriter]]:
    """``(the base's tensors, a writer of a model of the same layout in out)``: for models made from the base."""
    specs = layout.tensors()
    with safe_open(base / SINGLE_NAME, framework="pt") as fb, StreamingSafetensorsWriter(
        out / SINGLE_NAME, [(s.name, DTYPE, s.shape) for s in specs]
    ) as w:
        yield fb, w


def _write_expert(layout: Layout, seed: int, profile: ExpertProfile, base: Path, out: Path) -> None:
    with derived_model(layout, base, out) as (fb, w):
        for spec in layout.tensors():
            base_t = fb.get_tensor(spec.name)
            rms = delta_scale(profile, spec, layout.num_layers)
            if rms == 0.0:
                w.write_rows(spec.name, base_t)  # untouched: the base's exact bytes
                continue
            gen = _generator(seed, profile.name, spec.name)
            if spec.group == "norm":
                delta = torch.randn(spec.shape, generator=gen).mul_(rms)
                w.write_rows(spec.name, (base_t.float() + delta).to(DTYPE))
                continue
            rows, cols = spec.shape
            u = torch.randn(rows, LOW_RANK, generator=gen)
            v = torch.randn(LOW_RANK, cols, generator=gen)
            row_mask = None
            if spec.group == "embed":
                row_mask = _embed_row_mask(rows, profile.embed_rows, gen).unsqueeze(1)
            for start, stop in _row_chunks(rows, cols):
                delta = _delta_rows(u, v, start, stop, rms, gen)
                if row_mask is not None:
                    delta.mul_(row_mask[start:stop])
                w.write_rows(spec.name, (base_t[start:stop].float() + delta).to(DTYPE))


def _ensure_model(
    out: Path, layout: Layout, spec: dict, write: Callable[[Path], None], log: Callable[[str], None]
) -> str:
    """Reuse ``out`` if its marker holds this spec's hash; otherwise (re)generate it."""
    digest = _spec_hash(spec)
    marker = out.parent / f"{out.name}.complete.json"
    if marker.exists() and out.exists():
        if json.loads(marker.read_text()).get("spec_hash") == digest:
            return digest
    marker.unlink(missing_ok=True)
    remove_tree(out)
    out.mkdir(parents=True)
    started = time.perf_counter()
    write(out)
    _write_sidecars(layout, out)
    seconds = time.perf_counter() - started
    size = (out / SINGLE_NAME).stat().st_size
    log(f"generated {out.name}: {size / 1e6:.0f} MB in {seconds:.1f} s ({size / 1e6 / seconds:.0f} MB/s)")
    marker.write_text(json.dumps({"spec_hash": digest, "spec": spec, "seconds": seconds}, indent=1))
    return digest


def _check_disk(root: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(root).free
    if free < needed_bytes + DISK_MARGIN_BYTES:
        raise SystemExit(
            f"not enough disk under {root}: need {needed_bytes / 1e9:.1f} GB plus "
            f"{DISK_MARGIN_BYTES / 1e9:.1f} GB margin, {free / 1e9:.1f} GB free; "
            "free space or choose a smaller layout"
        )


def ensure_workload(
    layout: Layout | str,
    num_experts: int = len(EXPERTS),
    seed: int = 0,
    root: Path = DEFAULT_ROOT,
    log: Callable[[str], None] = print,
) -> Workload:
    """Generate (or reuse) the base and the first ``num_experts`` experts."""
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    if not 1 <= num_experts <= len(EXPERTS):
        raise ValueError(f"num_experts must be in 1..{len(EXPERTS)}, got {num_experts}")
    wl_root = Path(root) / f"{layout.name}-s{seed}"
    wl_root.mkdir(parents=True, exist_ok=True)
    missing = [n for n in ["base", *(p.name for p in EXPERTS[:num_experts])]
               if not (wl_root / f"{n}.complete.json").exists()]
    _check_disk(wl_root, len(missing) * layout.nbytes())

    base_dir = wl_root / "base"
    base_spec = {"generator": GENERATION_CONSTANTS, "layout": asdict(layout), "seed": seed,
                 "role": "base"}
    base_hash = _ensure_model(base_dir, layout, base_spec, lambda o: _write_base(layout, seed, o), log)
    experts = []
    for profile in EXPERTS[:num_experts]:
        spec = dict(base_spec, role="expert", profile=asdict(profile), base=base_hash)
        out = wl_root / profile.name
        _ensure_model(out, layout, spec, lambda o, p=profile: _write_expert(layout, seed, p, base_dir, o), log)
        experts.append(out)
    return Workload(wl_root, layout, base_dir, tuple(experts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3-tiny")
    parser.add_argument("--experts", type=int, default=len(EXPERTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    wl = ensure_workload(args.layout, args.experts, args.seed, args.root)
    print(f"{wl.root}: base + {len(wl.experts)} experts, {wl.layout.param_count():,} parameters "
          f"each, ready in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
