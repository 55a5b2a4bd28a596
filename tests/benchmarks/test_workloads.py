"""The benchmark workload generator and the naive reference merge.

Everything runs on a micro layout (a few hundred KB per model), except the
layout checks, which build the real models on the meta device (no memory).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import naive_merge
from benchmarks.workloads import (
    BASE_STD,
    EXPERTS,
    LAYOUTS,
    Layout,
    delta_scale,
    ensure_workload,
)

MICRO = Layout("micro", num_layers=4, hidden=64, intermediate=128, num_heads=4,
               num_kv_heads=2, head_dim=16, vocab=512, bos_token_id=510, eos_token_id=511)


def _quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return ensure_workload(MICRO, num_experts=len(EXPERTS), seed=0,
                           root=tmp_path_factory.mktemp("wl"), log=_quiet)


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "model.safetensors")


def test_same_seed_gives_same_bytes_and_another_seed_does_not(micro, tmp_path):
    again = ensure_workload(MICRO, num_experts=2, seed=0, root=tmp_path / "a", log=_quiet)
    other = ensure_workload(MICRO, num_experts=2, seed=1, root=tmp_path / "b", log=_quiet)
    for name, path in [("base", micro.base), ("math", micro.experts[0]),
                       ("code", micro.experts[1])]:
        same = (again.root / name / "model.safetensors").read_bytes()
        assert same == (path / "model.safetensors").read_bytes(), name
        assert (other.root / name / "model.safetensors").read_bytes() != same, name


def test_cached_workload_is_reused_not_regenerated(micro):
    before = {p: p.stat().st_mtime_ns for p in micro.root.rglob("*.safetensors")}
    messages: list[str] = []
    ensure_workload(MICRO, num_experts=len(EXPERTS), seed=0, root=micro.root.parent,
                    log=messages.append)
    assert messages == []
    assert before == {p: p.stat().st_mtime_ns for p in micro.root.rglob("*.safetensors")}


def test_incomplete_model_is_regenerated(micro, tmp_path):
    wl = ensure_workload(MICRO, num_experts=1, seed=0, root=tmp_path, log=_quiet)
    (wl.root / "math.complete.json").unlink()  # as if interrupted before the marker
    (wl.experts[0] / "model.safetensors").write_bytes(b"truncated")
    messages: list[str] = []
    ensure_workload(MICRO, num_experts=1, seed=0, root=tmp_path, log=messages.append)
    assert [m.split(":")[0] for m in messages] == ["generated math"]
    assert (wl.experts[0] / "model.safetensors").read_bytes() == (
        micro.experts[0] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_layout_matches_transformers_qwen3(layout_name):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    layout = LAYOUTS[layout_name]
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**layout.config()))
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    expected.pop("lm_head.weight")  # tied to the embeddings: not stored
    assert {s.name: s.shape for s in layout.tensors()} == expected
    assert layout.param_count() == sum(math.prod(s) for s in expected.values())


def test_qwen3_06b_is_the_published_size():
    layout = LAYOUTS["qwen3-0.6b"]
    assert layout.param_count() == 596_049_920  # Qwen/Qwen3-0.6B, tied embeddings
    names = {s.name for s in layout.tensors()}
    assert "model.layers.27.self_attn.q_norm.weight" in names
    assert "model.layers.28.mlp.up_proj.weight" not in names
    assert [s.name for s in layout.tensors()] == sorted(names)  # safetensors' order


def test_micro_checkpoint_loads_in_transformers(micro):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(micro.experts[0], dtype=torch.bfloat16)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, MICRO.vocab) and torch.isfinite(logits).all()


def test_untouched_tensors_are_byte_identical_and_touched_ones_differ(micro):
    base = _weights(micro.base)
    specs = {s.name: s for s in MICRO.tensors()}
    for profile, path in zip(EXPERTS, micro.experts):
        expert = _weights(path)
        for name, spec in specs.items():
            same = torch.equal(expert[name].view(torch.int16), base[name].view(torch.int16))
            if delta_scale(profile, spec, MICRO.num_layers) == 0.0:
                assert same, f"{profile.name}: {name} should be untouched"
            elif spec.group in ("attn", "mlp", "embed"):
                assert not same, f"{profile.name}: {name} should differ"
    # embeddings: untouched by every expert except the multilingual one
    untouched = [p.name for p, d in zip(EXPERTS, micro.experts)
                 if torch.equal(_weights(d)["model.embed_tokens.weight"],
                                base["model.embed_tokens.weight"])]
    assert untouched == [p.name for p in EXPERTS if p.embed_rows == 0]


def test_delta_magnitudes_are_in_the_intended_range(micro):
    base = _weights(micro.base)
    for profile, path in zip(EXPERTS, micro.experts):
        expert = _weights(path)
        for spec in MICRO.tensors():
            if spec.group not in ("attn", "mlp"):
                continue
            scale = delta_scale(profile, spec, MICRO.num_layers)
            if scale == 0.0:
                continue
            b = base[spec.name].float()
            rel = float((expert[spec.name].float() - b).norm() / b.norm())
            # ~1e-3 of the weights' scale, between the background and the peak
            assert 5e-5 < rel < 2e-2, (profile.name, spec.name, rel)
    # the focus is where the energy is: math's upper MLPs vs its lower attention
    math_expert = _weights(micro.experts[0])

    def rel(name: str) -> float:
        d = math_expert[name].float() - base[name].float()
        return float(d.norm() / base[name].float().norm())

    top = MICRO.num_layers - 1
    assert rel(f"model.layers.{top}.mlp.up_proj.weight") > 5 * rel(
        "model.layers.0.self_attn.q_proj.weight")
    assert BASE_STD * 0.9 < float(base["model.layers.0.mlp.up_proj.weight"].float().std()) < BASE_STD * 1.1


def test_multilingual_changes_only_some_embedding_rows(micro):
    index = [p.name for p in EXPERTS].index("multilingual")
    profile = EXPERTS[index]
    b = _weights(micro.base)["model.embed_tokens.weight"]
    e = _weights(micro.experts[index])["model.embed_tokens.weight"]
    changed_rows = (e.view(torch.int16) != b.view(torch.int16)).any(dim=1).float().mean()
    assert 0.5 * profile.embed_rows < float(changed_rows) <= profile.embed_rows


# -- naive merge against a tiny independent computation ------------------------


def test_trim_keeps_top_k_and_breaks_ties_by_position():
    x = torch.tensor([1.0, -1.0, 1.0, 0.5, -1.0, 2.0])
    # density 0.5 -> k = 3: 2.0, then the first two entries tied at |1|
    assert naive_merge.trim(x, 0.5).tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 2.0]
    assert naive_merge.trim(x, 0.01).tolist() == [0, 0, 0, 0, 0, 2.0]  # k = max(1, 0)


def _reference(base: dict, experts: list[dict], operator: str, density: float, lam: float,
               weights: list[float]) -> dict[str, torch.Tensor]:
    """Whole-tensor merge written independently: stable argsort top-k, sign by sum."""
    out = {}
    for name, b16 in base.items():
        b = b16.float()
        deltas = [e[name].float() - b for e in experts]
        if operator == "task_arithmetic":
            total = torch.zeros_like(b)
            for w, d in zip(weights, deltas):
                total = total + w * d
            out[name] = (b + lam * total).to(b16.dtype)
            continue
        kept = []
        for w, d in zip(weights, deltas):
            flat = d.reshape(-1)
            k = max(1, int(density * flat.numel()))
            order = torch.argsort(flat.abs(), descending=True, stable=True)[:k]
            mask = torch.zeros_like(flat)
            mask[order] = 1.0
            kept.append(w * (flat * mask).reshape(d.shape))
        total = torch.zeros_like(b)
        for t in kept:
            total = total + t
        sign = torch.where(total >= 0, 1.0, -1.0)
        num, den = torch.zeros_like(b), torch.zeros_like(b)
        for w, t in zip(weights, kept):
            agree = (torch.sign(t) == sign).float()
            num = num + t * agree
            den = den + w * agree
        den = torch.where(den == 0, torch.ones_like(den), den)
        out[name] = (b + lam * num / den).to(b16.dtype)
    return out


@pytest.mark.parametrize("operator,lam,weights", [
    ("task_arithmetic", 1.0, [1.0, 1.0, 1.0]),
    ("task_arithmetic", 0.7, [0.5, 1.0, 0.25]),
    ("ties", 1.0, [1.0, 1.0, 1.0]),
    ("ties", 0.8, [0.5, 1.0, 0.25]),
])
def test_naive_merge_equals_independent_reference(micro, tmp_path, operator, lam, weights):
    experts = micro.expert_dirs(3)
    out = tmp_path / "out"
    naive_merge.merge(micro.base, experts, out, operator, density=0.5, lam=lam, weights=weights)
    got = _weights(out)
    want = _reference(_weights(micro.base), [_weights(e) for e in experts], operator, 0.5,
                      lam, weights)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
