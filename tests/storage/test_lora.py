"""PEFT LoRA adapters read by ``storage/lora.py``, checked against peft itself.

Every adapter is made by peft (``get_peft_model``, random factors,
``save_pretrained``), and the reference is peft's ``merge_and_unload()`` of
that directory loaded on a fresh base. Our expert tensor is
``(saved tensor or base) + ΔW`` computed in fp32 and cast to the base dtype.

Tolerances: in fp32 ΔW is bit for bit ``tests/fixtures/lora.py: lora_delta``
(MergePipe's definition: rank-1 terms summed in order, so that no block split
or CPU changes a bit) taken from peft's own layers, and peft's
merge_and_unload (a GEMM, whose bits depend on the BLAS kernel) is within r
roundings of it. In bf16 peft adds ΔW to an embedding after casting ΔW to
bf16 (two roundings) while we round once, so bf16 results may differ by one
bf16 step of the larger of the result and ΔW. ΔW read by row blocks is the
whole-tensor ΔW bit for bit. Factors are loaded with the safetensors library.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.lora import delta_rows, open_lora_adapter
from tests.fixtures.checkpoints import load_tensors, make_base
from tests.fixtures.lora import (
    load_model,
    load_peft,
    make_gpt2_base,
    make_lora_adapter,
    peft_cat_merged,
    peft_deltas,
    peft_merged,
)
from tests.storage.helpers import raw_header

peft = pytest.importorskip("peft")
LoraConfig = peft.LoraConfig

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"

# id -> (arch, dtype, LoraConfig kwargs, autocast_adapter_dtype)
CASES = {
    "list-f32": ("llama", "f32", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), True),
    "regex-rslora": ("llama", "f32", dict(r=4, lora_alpha=6, use_rslora=True,
                                          target_modules=r".*\.(k_proj|up_proj)"), True),
    "patterns": ("llama", "f32", dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"],
        # Both rank keys match layer 1's down_proj: the first in the file wins. peft writes the config with
        # sorted keys and its loader uses the file's order, so the keys are given here in sorted order.
        rank_pattern={"down_proj": 6, r"layers\.1\.mlp\.down_proj": 2, "layers.1.self_attn.q_proj": 2},
        alpha_pattern={"o_proj": 3, r"layers\.0\..*gate_proj": 5},
    ), True),
    "modules-to-save": ("llama", "f32", dict(r=2, lora_alpha=4, target_modules=["v_proj"],
                                             modules_to_save=["lm_head"]), True),
    "layers": ("llama", "f32", dict(r=4, lora_alpha=4, target_modules=["q_proj", "up_proj"],
                                    layers_to_transform=[1], layers_pattern="layers"), True),
    "embedding": ("llama", "f32", dict(r=3, lora_alpha=5, target_modules=["embed_tokens", "q_proj"]), True),
    "bf16": ("llama", "bf16", dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "embed_tokens"],
                                   modules_to_save=["lm_head"], alpha_pattern={"down_proj": 2}), True),
    "bf16-factors": ("llama", "bf16", dict(r=4, lora_alpha=8, use_rslora=True,
                                           target_modules=["k_proj", "gate_proj"]), False),
    "gpt2-fan-in-fan-out": ("gpt2", "f32", dict(r=4, lora_alpha=8, fan_in_fan_out=True,
                                                target_modules=["c_attn", "c_proj", "c_fc"]), True),
    # peft turns fan_in_fan_out on itself for Conv1D layers, and saves it so.
    "gpt2-bf16-fan-in-fan-out-set-by-peft": ("gpt2", "bf16", dict(r=2, lora_alpha=4, target_modules=["c_proj"]), True),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """``get(arch, dtype) -> base dir``, each built once."""
    root = tmp_path_factory.mktemp("lora-bases")
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, dtype: str) -> Path:
        if (arch, dtype) not in cache:
            out = root / f"{arch}-{dtype}"
            cache[(arch, dtype)] = make_gpt2_base(out, dtype) if arch == "gpt2" else make_base(out, dtype=dtype)
        return cache[(arch, dtype)]

    return get


@pytest.fixture(scope="module")
def adapters(bases, tmp_path_factory):
    """``get(case) -> (base dir, adapter dir, dtype)``, each adapter saved once."""
    root = tmp_path_factory.mktemp("lora-adapters")
    cache: dict[str, tuple[Path, Path, str]] = {}

    def get(case: str) -> tuple[Path, Path, str]:
        if case not in cache:
            arch, dtype, kwargs, autocast = CASES[case]
            base = bases(arch, dtype)
            adapter = make_lora_adapter(base, root / case, LoraConfig(**kwargs), dtype,
                                        autocast_adapter_dtype=autocast)
            cache[case] = (base, adapter, dtype)
        return cache[case]

    return get


def base_tensors(base: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The base's tensor names -> (dtype, shape), from headers parsed by the test helper."""
    out = {}
    for path in sorted(base.glob("*.safetensors")):
        _, header = raw_header(path)
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"})
    return out


def delta_of(target, factors: dict[str, torch.Tensor]) -> torch.Tensor:
    """ΔW of ``target`` from the factors as the safetensors library loads them."""
    return delta_rows(factors[target.b.name], factors[target.a.name], target.scale, target.transposed)


def our_expert(base: Path, adapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every base tensor as the adapter makes it, in fp32: ((saved or base) + ΔW, ΔW)."""
    factors = load_file(str(adapter.weights))
    out = {}
    for name, value in load_tensors(base).items():
        expert, delta = value.float(), torch.zeros(value.shape)
        if name in adapter.saved:
            expert = factors[adapter.saved[name].entry.name].float()
        if name in adapter.targets:
            delta = delta_of(adapter.targets[name], factors)
            expert = expert + delta
        out[name] = (expert, delta)
    return out


def assert_within_one_bf16_step(ours: torch.Tensor, ref: torch.Tensor, delta: torch.Tensor, name: str) -> None:
    """|ours − ref| ≤ one bf16 step of max(|result|, |ΔW|): peft's extra rounding of ΔW is at most half a
    step of ΔW, which can exceed a step of the result where ΔW cancels most of the base."""
    scale = torch.maximum(torch.maximum(ours.float().abs(), ref.float().abs()), delta.abs())
    assert torch.all((ours.float() - ref.float()).abs() <= scale * 2.0**-7), name


@pytest.mark.parametrize("case", list(CASES))
def test_expert_equals_peft_merge_and_unload(adapters, case):
    base, adapter_dir, dtype = adapters(case)
    adapter = open_lora_adapter(adapter_dir, base_tensors(base))
    reference = peft_merged(base, adapter_dir, dtype)
    ours = our_expert(base, adapter)
    assert adapter.targets, "the adapter targets nothing"
    defined = peft_deltas(base, adapter_dir, dtype)
    assert set(defined) == set(adapter.targets)
    for name, (value, delta) in ours.items():
        cast = value.to(reference[name].dtype)
        if dtype != "f32":
            assert_within_one_bf16_step(cast, reference[name], delta, name)
        elif name in defined:
            exact, slack = defined[name]
            assert torch.equal(delta, exact), name
            assert bool(((cast - reference[name]).abs() <= slack + reference[name].abs() * 2.0**-23).all()), name
        else:
            assert torch.equal(cast, reference[name]), name


@pytest.mark.parametrize("case", list(CASES))
def test_targets_rank_and_scale_are_peft_s(adapters, case):
    """The modules peft puts LoRA on, and its rank and scaling for each, are ours."""
    base, adapter_dir, dtype = adapters(case)
    adapter = open_lora_adapter(adapter_dir, base_tensors(base))
    assert adapter.config.sha256 == hashlib.sha256((adapter_dir / CONFIG).read_bytes()).hexdigest()
    model = load_peft(base, adapter_dir, dtype).base_model.model
    peft_layers = {name: module for name, module in model.named_modules()
                   if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert {t.module for t in adapter.targets.values()} == set(peft_layers)
    for target in adapter.targets.values():
        layer = peft_layers[target.module]
        assert target.rank == layer.r["default"]
        assert target.scale == layer.scaling["default"]


@pytest.mark.parametrize("case", ["list-f32", "patterns", "embedding", "bf16-factors", "gpt2-fan-in-fan-out"])
@pytest.mark.parametrize("block_rows", [1, 5, 16, 10_000])
def test_row_blocks_give_the_whole_delta_bit_for_bit(adapters, case, block_rows):
    """ΔW by row blocks (B's rows and all of A; transposed, all of B and A's columns) is the whole ΔW."""
    base, adapter_dir, _ = adapters(case)
    adapter = open_lora_adapter(adapter_dir, base_tensors(base))
    factors = load_file(str(adapter_dir / WEIGHTS))
    for target in adapter.targets.values():
        a, b, rows = factors[target.a.name], factors[target.b.name], target.shape[0]
        parts = [
            delta_rows(b, a[:, s : s + block_rows], target.scale, True)
            if target.transposed
            else delta_rows(b[s : s + block_rows], a, target.scale, False)
            for s in range(0, rows, block_rows)
        ]
        assert torch.equal(torch.cat(parts), delta_of(target, factors))


def test_saved_tensors_are_replacements(adapters):
    base, adapter_dir, _ = adapters("embedding")
    adapter = open_lora_adapter(adapter_dir, base_tensors(base))
    assert {n: s.origin for n, s in adapter.saved.items()} == {"model.embed_tokens.weight": "base_layer"}
    base, adapter_dir, _ = adapters("modules-to-save")
    adapter = open_lora_adapter(adapter_dir, base_tensors(base))
    assert {n: s.origin for n, s in adapter.saved.items()} == {"lm_head.weight": "modules_to_save"}
    assert adapter.saved["lm_head.weight"].entry.name == "base_model.model.lm_head.weight"


def test_cat_of_two_adapters_is_the_weighted_sum_of_their_deltas(bases, tmp_path):
    """peft's "cat" scales each adapter's A by weight·scale and concatenates: ΔW = Σ wᵢ·ΔWᵢ, weights on the product."""
    base = bases("llama", "f32")
    one = make_lora_adapter(base, tmp_path / "one", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    two_config = LoraConfig(r=2, lora_alpha=3, target_modules=["v_proj", "down_proj"])
    two = make_lora_adapter(base, tmp_path / "two", two_config, seed=2)
    weights = [0.7, -1.3]
    reference = peft_cat_merged(base, [one, two], weights, "f32", save_to=tmp_path / "saved")
    names = base_tensors(base)
    first, second = open_lora_adapter(one, names), open_lora_adapter(two, names)
    combo = open_lora_adapter(tmp_path / "saved" / "combo", names)
    factors = [load_file(str(a.weights)) for a in (first, second, combo)]
    for name, value in load_tensors(base).items():
        delta = torch.zeros(value.shape)
        for weight, adapter, loaded in zip(weights, (first, second), factors):
            if name in adapter.targets:
                delta += weight * delta_of(adapter.targets[name], loaded)
        ours = value.float() + delta
        assert torch.allclose(ours, reference[name], rtol=0, atol=1e-6 * max(1.0, ours.abs().max().item())), name
        if name in combo.targets:
            assert torch.allclose(delta_of(combo.targets[name], factors[2]), delta, rtol=0, atol=1e-6), name
    assert set(combo.targets) == set(first.targets) | set(second.targets)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names file descriptors through /proc")
def test_opening_reads_headers_only(adapters, monkeypatch):
    """Opening reads the 8-byte length and the header of the weights file, never tensor data."""
    base, adapter_dir, _ = adapters("bf16")
    weights = (adapter_dir / WEIGHTS).resolve()
    header_len, _ = raw_header(weights)
    read_bytes: list[int] = []
    real_pread, real_preadv, real_open = os.pread, os.preadv, open

    def is_weights(fd: int) -> bool:
        return Path(os.readlink(f"/proc/self/fd/{fd}")) == weights

    def pread(fd, length, offset):
        data = real_pread(fd, length, offset)
        if is_weights(fd):
            read_bytes.append(len(data))
        return data

    def preadv(fd, buffers, offset):
        assert not is_weights(fd), "tensor data read while opening"
        return real_preadv(fd, buffers, offset)

    def guarded_open(file, *args, **kwargs):
        assert Path(file).resolve() != weights, "weights file opened as a Python file"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr("builtins.open", guarded_open)
    monkeypatch.setattr("io.open", guarded_open)
    adapter = open_lora_adapter(adapter_dir, base_tensors(base))
    monkeypatch.undo()
    assert adapter.targets and sum(read_bytes) == 8 + header_len


# ---- refusals -------------------------------------------------------------------------------------------------


def copy_adapter(adapters, tmp_path: Path, case: str = "list-f32") -> tuple[Path, Path]:
    base, adapter_dir, _ = adapters(case)
    out = tmp_path / "adapter"
    shutil.copytree(adapter_dir, out)
    return base, out


def edit_config(adapter_dir: Path, **changes) -> None:
    doc = json.loads((adapter_dir / CONFIG).read_text())
    doc.update(changes)
    (adapter_dir / CONFIG).write_text(json.dumps(doc))


def rewrite_weights(adapter_dir: Path, change) -> None:
    """Rewrite the weights file with ``change(tensors)`` applied (safetensors library, not our code)."""
    tensors = load_file(str(adapter_dir / WEIGHTS))
    change(tensors)
    save_file(tensors, str(adapter_dir / WEIGHTS), metadata={"format": "pt"})


def refusal(adapter_dir: Path, names, error=CheckpointError) -> str:
    with pytest.raises(error) as info:
        open_lora_adapter(adapter_dir, names)
    message = str(info.value)
    assert "\n" not in message
    return message


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def test_dora_is_refused(bases, tmp_path):
    base = bases("llama", "f32")
    dora = make_lora_adapter(base, tmp_path / "dora", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "DoRA (use_dora)" in refusal(dora, base_tensors(base))
    edit_config(dora, use_dora=False)  # the magnitude vectors alone still say DoRA
    assert "DoRA magnitude vector" in refusal(dora, base_tensors(base))


def test_bin_adapter_is_refused_by_name(bases, tmp_path):
    base = bases("llama", "f32")
    pickled = make_lora_adapter(base, tmp_path / "bin", LoraConfig(r=2, target_modules=["q_proj"]),
                                safe_serialization=False)
    assert (pickled / "adapter_model.bin").is_file()
    assert "convert it to safetensors" in refusal(pickled, base_tensors(base))


def test_other_peft_type_is_refused(bases, tmp_path):
    base = bases("llama", "f32")
    ia3 = tmp_path / "ia3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[])
        peft.get_peft_model(load_model(base, "f32"), config).save_pretrained(str(ia3))
    assert "peft_type is 'IA3'" in refusal(ia3, base_tensors(base))


def test_shape_that_does_not_fit_is_refused(adapters, tmp_path):
    base, adapter_dir = copy_adapter(adapters, tmp_path)
    names = base_tensors(base)
    names["model.layers.0.self_attn.q_proj.weight"] = ("F32", (64, 32))
    assert "is [64, 64] but base tensor 'model.layers.0.self_attn.q_proj.weight' is [64, 32]" in refusal(
        adapter_dir, names)
    edit_config(adapter_dir, r=3)
    assert "rank 3" in refusal(adapter_dir, base_tensors(base))


def test_fan_in_fan_out_mismatch_is_refused(adapters, tmp_path):
    base, adapter_dir = copy_adapter(adapters, tmp_path, "gpt2-fan-in-fan-out")
    edit_config(adapter_dir, fan_in_fan_out=False)
    assert "fan_in_fan_out=False" in refusal(adapter_dir, base_tensors(base))


def test_key_without_base_tensor_is_refused(adapters, tmp_path):
    base, adapter_dir = copy_adapter(adapters, tmp_path)
    names = base_tensors(base)
    del names["model.layers.0.self_attn.q_proj.weight"]
    assert "no base tensor 'model.layers.0.self_attn.q_proj.weight'" in refusal(adapter_dir, names)
    rewrite_weights(adapter_dir, lambda t: t.update({"base_model.model.model.extra.weight": torch.zeros(2, 2)}))
    assert "maps to no base tensor 'model.extra.weight'" in refusal(adapter_dir, base_tensors(base))


def test_quantized_factor_is_refused(adapters, tmp_path):
    base, adapter_dir = copy_adapter(adapters, tmp_path)
    rewrite_weights(adapter_dir, lambda t: t.update({f"{Q0}.lora_A.weight": t[f"{Q0}.lora_A.weight"].to(torch.int8)}))
    assert "is I8; quantized" in refusal(adapter_dir, base_tensors(base))


@pytest.mark.parametrize("case, changes", [
    ("list-f32", {"target_modules": ["v_proj"]}),
    ("list-f32", {"target_modules": r".*\.v_proj"}),
    ("list-f32", {"exclude_modules": ["layers.0.self_attn.q_proj"]}),
    ("layers", {"layers_to_transform": [0]}),
    ("layers", {"layers_pattern": "h"}),
])
def test_module_outside_target_modules_is_refused(adapters, tmp_path, case, changes):
    base, adapter_dir = copy_adapter(adapters, tmp_path, case)
    edit_config(adapter_dir, **changes)
    assert "does not select it, so peft would ignore them" in refusal(adapter_dir, base_tensors(base))


@pytest.mark.parametrize("change, expected", [
    (lambda t: t.pop(f"{Q0}.lora_B.weight"), "has a lora_A factor but no lora_B"),
    (lambda t: t.update({f"{Q0}.lora_A.default.weight": t.pop(f"{Q0}.lora_A.weight")}), "not a LoRA factor"),
    (lambda t: t.update({f"{Q0}.lora_B.bias": torch.zeros(64)}), "LoRA biases"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(64)}), "does not start with 'base_model.model.'"),
    (lambda t: t.update({f"{Q0}.weight": torch.zeros(64, 64)}), "saved outside its base_layer"),
    (lambda t: t.update({"base_model.model.model.norm.base_layer.weight": torch.zeros(64)}),
     "the base_layer of a module without LoRA factors"),
    (lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(251, 64)}), "a resized vocabulary"),
])
def test_bad_keys_are_refused(adapters, tmp_path, change, expected):
    base, adapter_dir = copy_adapter(adapters, tmp_path)
    rewrite_weights(adapter_dir, change)
    assert expected in refusal(adapter_dir, base_tensors(base))


@pytest.mark.parametrize("changes, expected", [
    ({"lora_bias": True}, "a LoRA bias (lora_bias)"),
    ({"bias": "all"}, "trained biases (bias='all')"),
    ({"init_lora_weights": "pissa_niter_4"}, "relative to a modified base"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ({"alora_invocation_tokens": [5]}, "cannot be merged"),
    ({"peft_type": "LOHA"}, "peft_type is 'LOHA'"),
])
def test_unsupported_configs_are_refused(adapters, tmp_path, changes, expected):
    base, adapter_dir = copy_adapter(adapters, tmp_path)
    edit_config(adapter_dir, **changes)
    assert expected in refusal(adapter_dir, base_tensors(base))


@pytest.mark.parametrize("changes", [{"r": 0}, {"lora_alpha": "8"}, {"use_rslora": "yes"},
                                     {"rank_pattern": {"q_proj": 2.5}}, {"layers_to_transform": "1"}])
def test_malformed_configs_are_corrupt(adapters, tmp_path, changes):
    base, adapter_dir = copy_adapter(adapters, tmp_path)
    edit_config(adapter_dir, **changes)
    refusal(adapter_dir, base_tensors(base), CorruptCheckpointError)


def test_missing_files_are_refused(adapters, tmp_path):
    base, adapter_dir = copy_adapter(adapters, tmp_path)
    assert "no such adapter directory" in refusal(tmp_path / "nowhere", base_tensors(base))
    (adapter_dir / WEIGHTS).unlink()
    assert f"has no {WEIGHTS}" in refusal(adapter_dir, base_tensors(base))
    (adapter_dir / CONFIG).unlink()
    assert f"has no {CONFIG}" in refusal(adapter_dir, base_tensors(base))
