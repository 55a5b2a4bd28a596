"""PEFT LoRA adapters as experts, end to end: register → analyze → plan → merge.

References are independent of MergePipe: peft itself (``merge_and_unload``,
``add_weighted_adapter(..., combination_type="cat")``) and plain-torch TIES /
DARE written here on the materialised ΔW = s·B·A (computed from the saved
factors with torch). The tiny Llama base is F32 and so is the output.

Tolerances: task arithmetic of one adapter (weight 1) is bit for bit the base
plus ΔW as MergePipe defines it (``tests/fixtures/lora.py: lora_delta``, rank-1
terms summed in order; the same bits for any block split and CPU), and within
r roundings of peft's merge_and_unload, whose ΔW is a GEMM (its bits depend on
the BLAS kernel: MKL on AVX-512 gave a block of columns other bits than the
whole product). ``cat`` of
two adapters is one rank-(r1+r2) product in peft and a weighted sum of two
products here: 1e-5 of the largest |Δ|. TIES/DARE against plain torch on the
materialised ΔW: the same 1e-5. DARE is checked at density 1 (nothing
dropped) against torch, and at density 0.5 against the same DARE on peft's
materialised copy of the adapter under the same id (the same kept entries;
values within the fp32 rounding of that copy): its random mask cannot be
reproduced without MergePipe's generator.

Cost rule checked here (``analysis/lora_expert.py``): a block costs its rows
of B, and a tensor's A is read and counted once, so a 100% budget reads every
factor byte once.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.catalog.helpers import block_rows
from tests.fixtures.checkpoints import load_tensors, make_base, make_expert
from tests.fixtures.lora import (
    assert_merged_like_peft,
    lora_delta,
    make_gpt2_base,
    make_lora_adapter,
    peft_cat_merged,
    peft_merged,
)
from tests.planner.support import spy_reads

peft = pytest.importorskip("peft")
LoraConfig = peft.LoraConfig

BLOCK = 2048
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-experts")
    base = make_base(root / "base", dtype="f32", seed=4)
    adapters = {
        "la": make_lora_adapter(base, root / "la", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                   "up_proj"]), seed=1),
        "lb": make_lora_adapter(base, root / "lb", LoraConfig(r=2, lora_alpha=3, use_rslora=True,
                                                               target_modules=["q_proj", "down_proj"]), seed=2),
    }
    return root, base, adapters, make_expert(base, root / "x", seed=31)


def _catalog(path: Path, base: Path, adapters: dict[str, Path], full: Path | None = None) -> Catalog:
    catalog = Catalog.create(path, block_bytes=BLOCK)
    register_model(catalog, "base", base)
    for model_id, directory in adapters.items():
        register_model(catalog, model_id, directory, kind="lora", base="base")
    if full is not None:
        register_model(catalog, "x", full)
    analyze(catalog, [*adapters, *(["x"] if full else [])], base_id="base", progress=False)
    return catalog


def _factors(adapter: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per base tensor, its saved factors (A, B), read with safetensors' own loader."""
    tensors = load_file(str(adapter / WEIGHTS))
    out = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key[len(PREFIX): -len(".lora_A.weight")]
            out[f"{module}.weight"] = (a, tensors[f"{PREFIX}{module}.lora_B.weight"])
    return out


def _delta_w(adapter: Path, scale: float) -> dict[str, torch.Tensor]:
    """ΔW = s·B·A per base tensor, with torch from the saved factors (the plain reference)."""
    return {name: lora_delta(b, a, scale) for name, (a, b) in _factors(adapter).items()}


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    return bool(((got - ref).abs() <= rel * (ref.abs().max() + 1e-12)).all())


def test_one_adapter_task_arithmetic_equals_peft_merge_and_unload(family, tmp_path):
    root, base, adapters, _ = family
    catalog = _catalog(tmp_path / "c.db", base, {"la": adapters["la"]})
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["la"], operator="task_arithmetic", params={"lambda": 1.0}))
    _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    assert_merged_like_peft(load_tensors(tmp_path / "out"), base, adapters["la"])
    info = manifest.extra["lora"]["la"]
    assert manifest.extra["expert_kinds"] == {"la": "lora"}
    assert (info["rank"], info["scale"], info["targets"]) == (4, 2.0, 6)
    assert info["factor_bytes_read"] == manifest.cost.realized.expert_bytes_by_model["la"] > 0
    catalog.close()


def test_two_adapters_equal_peft_cat_then_merge(family, tmp_path):
    root, base, adapters, _ = family
    catalog = _catalog(tmp_path / "c.db", base, adapters)
    weights = [0.7, 0.4]
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["la", "lb"], operator="task_arithmetic", weights=weights, params={"lambda": 1.0}))
    Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    got = load_tensors(tmp_path / "out")
    ref = peft_cat_merged(base, [adapters["la"], adapters["lb"]], weights, "f32")
    for name, value in got.items():
        assert _close(value - load_tensors(base)[name], ref[name] - load_tensors(base)[name], 1e-5), name
    catalog.close()


def _ties_reference(deltas: list[torch.Tensor], weights: list[float], density: float) -> torch.Tensor:
    """TIES: trim each Δ to its top-k magnitudes, elect the sign of the weighted sum, average the agreeing."""
    trimmed = []
    for d in deltas:
        k = max(1, int(density * d.numel()))  # kept count per the operator's definition
        flat = d.reshape(-1)
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep[torch.topk(flat.abs(), k).indices] = True
        trimmed.append(torch.where(keep, flat, torch.zeros_like(flat)).reshape(d.shape))
    weighted = torch.stack([w * t for w, t in zip(weights, trimmed)])
    sign = torch.sign(weighted.sum(0))
    agree = (torch.sign(weighted) == sign) & (weighted != 0)
    total = (weighted * agree).sum(0)
    count = (torch.stack([torch.full_like(t, w) for w, t in zip(weights, trimmed)]) * agree).sum(0)
    return torch.where(count > 0, total / count.clamp_min(1e-30), torch.zeros_like(total))


@pytest.mark.parametrize("density", [1.0, 0.5, 0.37])  # 0.37: off the grid, merged whole
def test_ties_on_adapters_equals_a_torch_reference_on_materialised_deltas(family, tmp_path, density):
    root, base, adapters, _ = family
    catalog = _catalog(tmp_path / "c.db", base, adapters)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["la", "lb"], operator="ties", weights=[1.0, 0.6], params={"density": density}))
    Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    got, b = load_tensors(tmp_path / "out"), load_tensors(base)
    da, db = _delta_w(adapters["la"], 2.0), _delta_w(adapters["lb"], 3.0 / math.sqrt(2))
    for name, value in got.items():
        deltas = [d.get(name, torch.zeros_like(b[name])) for d in (da, db)]
        ref = b[name] + _ties_reference(deltas, [1.0, 0.6], density)
        assert _close(value - b[name], ref - b[name], 1e-5), name
    catalog.close()


def test_dare_with_density_one_is_the_weighted_sum(family, tmp_path):
    """DARE with density 1 drops nothing and rescales by 1: the weighted sum of the ΔW (dare_linear)."""
    root, base, adapters, _ = family
    catalog = _catalog(tmp_path / "c.db", base, adapters)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["la", "lb"], operator="dare_linear", weights=[0.5, 0.5], params={"density": 1.0}, seed=3))
    Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    got, b = load_tensors(tmp_path / "out"), load_tensors(base)
    da, db = _delta_w(adapters["la"], 2.0), _delta_w(adapters["lb"], 3.0 / math.sqrt(2))
    for name, value in got.items():
        ref = 0.5 * da.get(name, torch.zeros_like(b[name])) + 0.5 * db.get(name, torch.zeros_like(b[name]))
        assert _close(value - b[name], ref, 1e-5), name
    catalog.close()


def test_a_merge_can_mix_a_full_expert_and_an_adapter(family, tmp_path):
    root, base, adapters, full = family
    catalog = _catalog(tmp_path / "c.db", base, {"la": adapters["la"]}, full)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["x", "la"], operator="task_arithmetic", weights=[0.5, 1.0], params={"lambda": 1.0}))
    _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    got, b, x = load_tensors(tmp_path / "out"), load_tensors(base), load_tensors(full)
    da = _delta_w(adapters["la"], 2.0)
    for name, value in got.items():
        ref = 0.5 * (x[name] - b[name]) + da.get(name, torch.zeros_like(b[name]))
        assert _close(value - b[name], ref, 1e-5), name
    assert manifest.extra["expert_kinds"] == {"la": "lora"}
    assert set(manifest.extra["lora"]) == {"la"}
    catalog.close()


def _factor_bytes(adapter: Path) -> dict[str, tuple[int, int]]:
    """Per base tensor (bytes of one row of B, bytes of A): from safetensors' own loader."""
    return {name: (b.shape[1] * b.element_size(), a.numel() * a.element_size())
            for name, (a, b) in _factors(adapter).items()}


@pytest.mark.parametrize("budget", ["35%", None])
def test_reads_of_adapter_files_stay_within_plan_and_budget(family, tmp_path, budget):
    root, base, adapters, _ = family
    catalog = _catalog(tmp_path / "c.db", base, {"la": adapters["la"]})
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["la"], operator="task_arithmetic", budget=budget))
    with spy_reads() as spy:
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    realized = manifest.cost.realized.expert_bytes_by_model["la"]
    assert spy.bytes_of(adapters["la"]) == realized <= plan.cost.expert_bytes_by_model["la"]
    assert manifest.cost.realized.expert_bytes <= plan.cost.expert_bytes <= plan.budget_bytes
    # the planned cost of the blocks read: their B rows, and A once per tensor read (from safetensors' own
    # loader)
    per = _factor_bytes(adapters["la"])
    base_shapes = {k: list(v.shape) for k, v in load_tensors(base).items()}
    expected = 0
    for name, experts in plan.reads.items():
        rows = block_rows(base_shapes[name], 4, BLOCK)
        read = experts.get("la", ())
        expected += sum((rows[i][1] - rows[i][0]) * per[name][0] for i in read) + (per[name][1] if read else 0)
    assert plan.cost.expert_bytes_by_model["la"] == expected
    if budget is None:  # every block of every targeted tensor is changed (random B): every factor byte once
        every_factor = sum(t.numel() * t.element_size() for t in load_file(str(adapters["la"] / WEIGHTS)).values())
        assert plan.cost.expert_bytes == every_factor == realized
        assert spy.bytes_of(adapters["la"]) == every_factor
    else:
        assert 0 < plan.cost.expert_bytes < plan.cost.full_expert_bytes
        # A is shared by a tensor's blocks: the planner takes an adapter's tensor whole or not at all
        for name, experts in plan.reads.items():
            assert len(experts.get("la", ())) in (0, len(block_rows(base_shapes[name], 4, BLOCK))), name
    catalog.close()


def test_a_rerun_that_reuses_every_block_reads_no_factor_byte(family, tmp_path):
    """An incremental merge that reuses every output block saves each tensor's A too: it plans and reads 0
    bytes of the adapter."""
    root, base, adapters, _ = family
    catalog = _catalog(tmp_path / "c.db", base, {"la": adapters["la"]})
    first = Planner(catalog).plan(MergeRequest(base="base", experts=["la"], operator="task_arithmetic"))
    Engine(catalog).execute(first, out=tmp_path / "m1", model_id="m1")
    again = Planner(catalog).plan(MergeRequest(base="base", experts=["la"], operator="task_arithmetic", previous="m1"))
    assert again.reuse is not None and again.reuse.saved["la"] == first.cost.expert_bytes_by_model["la"] > 0
    assert again.expert_bytes_to_read("la") == 0
    with spy_reads() as spy:
        _, manifest = Engine(catalog).execute(again, out=tmp_path / "m2", model_id="m2")
    assert spy.bytes_of(adapters["la"]) == manifest.cost.realized.expert_bytes_by_model["la"] == 0
    before = load_tensors(tmp_path / "m1")
    assert all(torch.equal(v, before[k]) for k, v in load_tensors(tmp_path / "m2").items())
    catalog.close()


def test_analysis_statistics_match_torch_and_zero_rows_of_b_are_unchanged(family, tmp_path):
    """Per-block ‖ΔW‖, max|ΔW| against torch on the materialised ΔW; a block whose rows of B are zeroed is
    recorded identical, costs nothing and is never read, and the merge still equals ΔW added in torch."""
    root, base, adapters, _ = family
    adapter = tmp_path / "zeroed"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_bytes((adapters["la"] / "adapter_config.json").read_bytes())
    tensors = load_file(str(adapters["la"] / WEIGHTS))
    key = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[key][:8] = 0  # the first block's rows (at most 2048 / (4·64) = 8 rows per block)
    save_file(tensors, str(adapter / WEIGHTS), metadata={"format": "pt"})
    catalog = _catalog(tmp_path / "c.db", base, {"z": adapter})
    stats = catalog.stats.block_deltas("z", "base")
    b = load_tensors(base)
    for name, delta in _delta_w(adapter, 2.0).items():
        rows = block_rows(list(b[name].shape), 4, BLOCK)
        for (r0, r1), got in zip(rows, stats[name]):
            d = delta[r0:r1]
            assert got.identical == bool((d == 0).all())
            assert math.isclose(got.l2, float(torch.linalg.vector_norm(d)), rel_tol=1e-5, abs_tol=1e-12)
            assert math.isclose(got.maxabs, float(d.abs().max()), rel_tol=1e-6, abs_tol=1e-12)
    zeroed = "model.layers.0.self_attn.q_proj.weight"
    assert stats[zeroed][0].identical and not any(s.identical for s in stats[zeroed][1:])
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["z"], operator="task_arithmetic", params={"lambda": 1.0}))
    assert 0 not in plan.reads[zeroed]["z"] and 1 in plan.reads[zeroed]["z"]
    Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    got, ref = load_tensors(tmp_path / "out"), _delta_w(adapter, 2.0)
    for name, value in got.items():
        assert _close(value - b[name], ref.get(name, torch.zeros_like(b[name])), 1e-5), name
    catalog.close()


def test_modules_to_save_replace_the_base_tensor(family, tmp_path):
    """``modules_to_save`` (lm_head): Δ = saved − base, read as a full tensor's blocks. Task arithmetic with
    weight 1 gives peft's merge_and_unload: LoRA targets as ``assert_merged_like_peft`` says, untouched
    tensors bit-exact; on the replaced tensor base + (saved − base) in fp32 is saved within one rounding
    (2⁻²⁴ relative, with slack)."""
    root, base, _, _ = family
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], modules_to_save=["lm_head"])
    adapter = make_lora_adapter(base, tmp_path / "mts", config, seed=5)
    catalog = _catalog(tmp_path / "c.db", base, {"m": adapter})
    stats = catalog.stats.block_deltas("m", "base")
    b, saved = load_tensors(base), load_file(str(adapter / WEIGHTS))[f"{PREFIX}lm_head.weight"]
    for (r0, r1), got in zip(block_rows(list(b["lm_head.weight"].shape), 4, BLOCK), stats["lm_head.weight"]):
        d = saved[r0:r1] - b["lm_head.weight"][r0:r1]
        assert math.isclose(got.maxabs, float(d.abs().max()), rel_tol=1e-6)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["m"], operator="task_arithmetic", params={"lambda": 1.0}))
    assert plan.reads["lm_head.weight"]["m"]
    with spy_reads() as spy:
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="x")
    assert spy.bytes_of(adapter) == manifest.cost.realized.expert_bytes_by_model["m"] <= plan.cost.expert_bytes
    got, ref = load_tensors(tmp_path / "out"), peft_merged(base, adapter, "f32")
    value = got["lm_head.weight"]
    assert bool(((value - ref["lm_head.weight"]).abs() <= 2.0**-22 * ref["lm_head.weight"].abs() + 1e-30).all())
    assert not torch.equal(value, b["lm_head.weight"])
    assert_merged_like_peft(got, base, adapter, skip=("lm_head.weight",))
    catalog.close()


@pytest.mark.parametrize("operator, params", [("task_arithmetic", {"lambda": 1.0}), ("ties", {"density": 0.37})])
def test_fan_in_fan_out_adapters_merge_like_peft(tmp_path, operator, params):
    """GPT-2's Conv1D (weights (in, out)): ΔW = s·(B·A)ᵀ. Task arithmetic with weight 1 merges like peft's
    merge_and_unload (``assert_merged_like_peft``); TIES at an off-grid density (merged whole) equals the
    torch reference.
    A transposed target's blocks all need both factors: they are read once per target, so the full plan
    reads, and plans, every factor byte once."""
    base = make_gpt2_base(tmp_path / "gpt2", "f32")
    config = LoraConfig(r=3, lora_alpha=6, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    adapter = make_lora_adapter(base, tmp_path / "fifo", config, seed=7)
    catalog = _catalog(tmp_path / "c.db", base, {"g": adapter})
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["g"], operator=operator, params=params))
    with spy_reads() as spy:
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="x")
    tensors = load_file(str(adapter / WEIGHTS))
    every_factor = sum(t.numel() * t.element_size() for t in tensors.values())
    assert spy.bytes_of(adapter) == manifest.cost.realized.expert_bytes_by_model["g"] == every_factor
    assert plan.cost.expert_bytes == every_factor
    got, b = load_tensors(tmp_path / "out"), load_tensors(base)
    deltas = {name: lora_delta(b, a, 2.0, transposed=True) for name, (a, b) in _factors(adapter).items()}
    assert deltas and set(deltas) <= set(got)
    if operator == "task_arithmetic":
        assert_merged_like_peft(got, base, adapter)
    else:
        for name, value in got.items():
            d = deltas.get(name, torch.zeros_like(b[name]))
            assert _close(value - b[name], _ties_reference([d], [1.0], 0.37), 1e-5), name
    catalog.close()


def test_rank_and_alpha_patterns_merge_like_peft(family, tmp_path):
    """Per-module rank and alpha (rank_pattern, alpha_pattern) with rsLoRA: task arithmetic with weight 1
    merges like peft's merge_and_unload (``assert_merged_like_peft``, with peft's own ranks and scales);
    the manifest lists the ranks and scales that differ from r's."""
    root, base, _, _ = family
    config = LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "down_proj", "o_proj"],
                        rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 3})
    adapter = make_lora_adapter(base, tmp_path / "patterns", config, seed=9)
    catalog = _catalog(tmp_path / "c.db", base, {"p": adapter})
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["p"], operator="task_arithmetic", params={"lambda": 1.0}))
    _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="x")
    assert_merged_like_peft(load_tensors(tmp_path / "out"), base, adapter)
    info = manifest.extra["lora"]["p"]
    assert info["ranks"] == [4, 6]
    assert info["scales"] == sorted({8 / math.sqrt(4), 8 / math.sqrt(6), 3 / math.sqrt(4)})
    catalog.close()


def test_dare_on_an_adapter_drops_what_dare_drops_on_its_materialised_expert(family, tmp_path):
    """DARE's mask is keyed by (seed, expert id, tensor, element), so the adapter and peft's
    merge_and_unload() of it, registered under the same id in two catalogs, keep the same entries;
    the kept values differ only by the fp32 rounding of B + ΔW in the materialised copy."""
    root, base, adapters, _ = family
    full = tmp_path / "la-full"
    full.mkdir()
    save_file({k: v.contiguous() for k, v in peft_merged(base, adapters["la"], "f32").items()
               if k in load_tensors(base)}, str(full / "model.safetensors"))
    for name in ("config.json", "tokenizer_config.json"):
        if (base / name).exists():
            (full / name).write_bytes((base / name).read_bytes())
    outputs = {}
    for kind, source in (("lora", adapters["la"]), ("full", full)):
        catalog = Catalog.create(tmp_path / f"{kind}.db", block_bytes=BLOCK)
        register_model(catalog, "base", base)
        if kind == "lora":
            register_model(catalog, "la", source, kind="lora", base="base")
        else:
            register_model(catalog, "la", source)
        analyze(catalog, ["la"], base_id="base", progress=False)
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["la"], operator="dare_linear", params={"density": 0.5}, seed=7, budget="100%"))
        Engine(catalog).execute(plan, out=tmp_path / f"out-{kind}", model_id="m")
        outputs[kind] = load_tensors(tmp_path / f"out-{kind}")
        catalog.close()
    b = load_tensors(base)
    changed = 0
    for name, value in outputs["lora"].items():
        kept_lora = value != b[name]
        kept_full = outputs["full"][name] != b[name]
        assert torch.equal(kept_lora, kept_full), name
        changed += int(kept_lora.sum())
        # E − B in the materialised copy is ΔW up to one fp32 rounding of E; the rescale (1/0.5) doubles it
        scale = max(value.abs().max().item(), outputs["full"][name].abs().max().item(), b[name].abs().max().item())
        assert (value - outputs["full"][name]).abs().max().item() <= 2**-19 * scale, name
    assert changed > 0


def test_lora_on_an_embedding_merges_like_peft_and_leaves_its_copy_unread(family, tmp_path):
    """LoRA on embed_tokens (ΔW = s·(B·A)ᵀ) beside q_proj, saved by peft with its copy of the embedding
    (save_embedding_layers): the copy equals the base's, so it adds nothing and is never read; task
    arithmetic with weight 1 merges like peft's merge_and_unload, reading every factor byte once."""
    root, base, _, _ = family
    config = LoraConfig(r=3, lora_alpha=5, target_modules=["embed_tokens", "q_proj"])
    adapter = make_lora_adapter(base, tmp_path / "emb", config, seed=9)
    tensors = load_file(str(adapter / WEIGHTS))
    assert f"{PREFIX}model.embed_tokens.base_layer.weight" in tensors  # peft saved its copy
    catalog = _catalog(tmp_path / "c.db", base, {"e": adapter})
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e"], operator="task_arithmetic", params={"lambda": 1.0}))
    assert "model.embed_tokens.weight" in plan.reads
    with spy_reads() as spy:
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    factors = sum(t.numel() * t.element_size() for k, t in tensors.items() if ".lora_" in k)
    assert spy.bytes_of(adapter) == manifest.cost.realized.expert_bytes_by_model["e"] == factors
    got = load_tensors(tmp_path / "out")
    assert not torch.equal(got["model.embed_tokens.weight"], load_tensors(base)["model.embed_tokens.weight"])
    assert_merged_like_peft(got, base, adapter)
    catalog.close()
