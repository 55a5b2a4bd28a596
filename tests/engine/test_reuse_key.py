"""The reuse key covers every input that decides an output block's bytes, not only the block hashes.

Differential: a first merge, then one input changed alone in a new version of an expert (or in the
merge's parameters), then ``--from`` the first merge must equal a merge from scratch byte for byte.
Inputs outside the block bytes: a LoRA adapter's ``adapter_config.json`` (α, rsLoRA, rank and alpha
patterns, ``fan_in_fan_out``: the factors, and so the block hashes, stay the same), a delta
checkpoint's dtype (the same bytes read as another dtype), and every operator's resolved parameters.
Where the change moves the output, the test also checks the output moved, so a key that ignored the
input could not pass.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, wide_runner
from tests.fixtures.delta_checkpoints import write_delta
from tests.spec.operators.table import TABLE

peft = pytest.importorskip("peft")

BLOCK_BYTES = 2048
#: operator -> global parameters of the first merge, and that merge with one resolved parameter changed:
#: each method's row of the test table (densities on the threshold grid: block streaming)
FIRST = {name: row.merge[2] for name, row in TABLE.items()}
CHANGED = {name: row.changed for name, row in TABLE.items() if row.changed is not None}
#: Operators without a parameter to change.
PARAMETERLESS = {name for name, row in TABLE.items() if row.changed is None}
#: adapter_config.json edits: name -> (edit, whether ΔW changes). The factors are r = 4 on q_proj and o_proj.
ADAPTER_EDITS = {
    "lora_alpha": (lambda c: c.update(lora_alpha=32), True),
    "use_rslora": (lambda c: c.update(use_rslora=True), True),
    "alpha_pattern": (lambda c: c.update(alpha_pattern={"q_proj": 24}), True),
    "rank_pattern": (lambda c: c.update(r=2, rank_pattern={"q_proj": 4, "o_proj": 4}, lora_alpha=4), True),
    "fan_in_fan_out": (lambda c: c.update(fan_in_fan_out=True), True),  # square q/o: (B·A)ᵀ instead of B·A
}


def experts_of(operator: str, changed: str) -> list[str]:
    return [changed] if OPERATORS[operator].max_experts == 1 else ["e1", changed]


def merge(catalog: Catalog, out: Path, model_id: str, operator: str, experts: list[str], previous: str | None = None,
          params: dict | None = None, expert_params: dict | None = None) -> bytes:
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator=operator, params=params if params is not None else FIRST[operator], expert_params=expert_params, seed=3, previous=previous))
    Engine(catalog, progress=False).execute(plan, out=out, model_id=model_id)
    return (out / "model.safetensors").read_bytes()


def check_from_equals_scratch(catalog: Catalog, tmp_path: Path, operator: str, experts: list[str], **second) -> None:
    v1 = merge(catalog, tmp_path / "v1", "merged", operator, experts)
    v2 = merge(catalog, tmp_path / "v2", "merged", operator, experts, previous="merged", **second)
    scratch = merge(catalog, tmp_path / "scratch", "scratch", operator, experts, **second)
    assert v2 == scratch != v1


@pytest.fixture(scope="module")
def inputs(tiny_family, tmp_path_factory) -> dict[str, Path]:
    from peft import LoraConfig

    from tests.fixtures.lora import make_lora_adapter

    root = tmp_path_factory.mktemp("reuse-key")
    base = tiny_family["base"]
    adapter = make_lora_adapter(base, root / "ad", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]),
                                "bf16")
    out = {"base": base, "e1": tiny_family["e1"], "e2": tiny_family["e2"], "ad": adapter}
    for name, (edit, _) in ADAPTER_EDITS.items():
        copy = root / f"ad-{name}"
        shutil.copytree(adapter, copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        edit(config)
        (copy / "adapter_config.json").write_text(json.dumps(config))
        out[f"ad-{name}"] = copy
    out["expert"] = make_expert(base, root / "expert", seed=9, scale=0.02)
    return out


@pytest.fixture
def catalog(inputs, tmp_path):
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for name in ("base", "e1", "e2"):
            register(catalog, name, inputs[name])
        yield catalog


@pytest.mark.parametrize("operator", ["task_arithmetic", "ties", "dare_ties", "linear", "slerp"])
@pytest.mark.parametrize("edit", sorted(ADAPTER_EDITS))
def test_an_adapter_whose_config_alone_changed_is_merged_again(catalog, inputs, tmp_path, operator, edit):
    register(catalog, "ad", inputs["ad"], base="base")
    analyze(catalog, ["e1", "ad"], base_id="base", progress=False)
    experts = experts_of(operator, "ad")
    merge(catalog, tmp_path / "v1", "merged", operator, experts)
    register(catalog, "ad", inputs[f"ad-{edit}"], base="base", new_version=True)
    analyze(catalog, ["ad"], base_id="base", progress=False)
    v2 = merge(catalog, tmp_path / "v2", "merged", operator, experts, previous="merged")
    scratch = merge(catalog, tmp_path / "scratch", "scratch", operator, experts)
    assert v2 == scratch
    assert v2 != (tmp_path / "v1" / "model.safetensors").read_bytes()


def _relabel(delta_dir: Path, out: Path, old: str, new: str) -> Path:
    """A copy of a delta checkpoint whose tensors hold the same bytes under another dtype."""
    shutil.copytree(delta_dir, out)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] == old:
            entry["dtype"] = new
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    info = json.loads((out / "mergepipe_delta.json").read_text())
    info["dtype"] = new
    (out / "mergepipe_delta.json").write_text(json.dumps(info))
    return out


@pytest.mark.parametrize("operator", ["task_arithmetic", "ties", "slerp"])
def test_a_delta_checkpoint_whose_dtype_alone_changed_is_merged_again(catalog, inputs, tmp_path, operator):
    analyze(catalog, ["base"], progress=False)
    fingerprint = catalog.blocks.content_fingerprint("base")
    f16 = write_delta(inputs["base"], inputs["expert"], tmp_path / "d-f16", fingerprint, BLOCK_BYTES, dtype="f16")
    bf16 = _relabel(f16, tmp_path / "d-bf16", "F16", "BF16")
    register(catalog, "d", f16, kind="delta", base="base")
    analyze(catalog, ["e1", "d"], base_id="base", progress=False)
    experts = experts_of(operator, "d")
    merge(catalog, tmp_path / "v1", "merged", operator, experts)
    register(catalog, "d", bf16, kind="delta", base="base", new_version=True)
    analyze(catalog, ["d"], base_id="base", progress=False)
    v2 = merge(catalog, tmp_path / "v2", "merged", operator, experts, previous="merged")
    scratch = merge(catalog, tmp_path / "scratch", "scratch", operator, experts)
    assert v2 == scratch
    assert v2 != (tmp_path / "v1" / "model.safetensors").read_bytes()


def test_every_operator_with_parameters_is_covered():
    assert set(CHANGED) | PARAMETERLESS == set(OPERATORS)


@pytest.mark.parametrize("operator", sorted(CHANGED))
def test_a_changed_parameter_is_merged_again(catalog, tmp_path, operator):
    analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
    experts = experts_of(operator, "e2")
    where, value = CHANGED[operator]
    second = {"params": value} if where == "params" else {"expert_params": value}
    check_from_equals_scratch(catalog, tmp_path, operator, experts, **second)


def test_merge_from_after_an_adapter_config_change_through_the_cli(inputs, tmp_path, monkeypatch):
    """The reported case: `lora_alpha` 8 -> 32 in a new version, `merge --from` equals from scratch."""
    runner = wide_runner(monkeypatch)
    db = tmp_path / "c.db"
    invoke(runner, ["init-db", "--db", db, "--block-bytes", "2KiB"])
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", inputs["base"]])
    invoke(runner, ["register", "--db", db, "--model-id", "ad", "--uri", inputs["ad"], "--base", "base"])
    args = ["--db", db, "--base", "base", "--experts", "ad", "--operator", "task_arithmetic", "--no-progress"]
    invoke(runner, ["merge", *args, "--out", tmp_path / "v1", "--model-id", "merged"])
    invoke(runner, ["register", "--db", db, "--model-id", "ad", "--uri", inputs["ad-lora_alpha"], "--base", "base",
                    "--new-version"])
    invoke(runner, ["merge", *args, "--from", "merged", "--out", tmp_path / "v2", "--model-id", "merged"])
    invoke(runner, ["merge", *args, "--out", tmp_path / "scratch", "--model-id", "scratch"])
    v1, v2, scratch = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("v1", "v2", "scratch"))
    assert v2 == scratch != v1
