"""MergePipe's operators against mergekit 0.1.5 on tiny real checkpoints.

mergekit runs as a user would run it (``mergekit-yaml`` on bf16 checkpoints,
computing in fp32, writing bf16); MergePipe's operators run here on whole
tensors with the same parameters. Deterministic operators must agree to bf16
rounding, except where mergekit's non-stable argsort picks other entries
among those tied at a trim threshold; DARE and DELLA draw different random
masks, so they are compared statistically. Measured fractions are printed
(``pytest -s``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.mergekit

mergekit = pytest.importorskip("mergekit", reason="mergekit 0.1.5 is not installed (pip install mergekit==0.1.5)")
from mergekit.sparsify import magnitude, magnitude_outliers

from mergepipe.analysis.stats import trim_thresholds
from mergepipe.spec.operators import BlockContext
from mergepipe.spec.operators.kernels import merge
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import get_operator
from mergepipe.spec.settings import count_layers
from tests.fixtures.checkpoints import load_tensors, make_base, make_expert
from tests.fixtures.mergekit import run_mergekit

MERGEKIT_YAML = Path(sys.executable).parent / "mergekit-yaml"
SEED = 0

# name -> (mergekit method, models as (expert, mergekit params), global params, include base in models)
CONFIGS = {
    "linear": ("linear", [("e1", {"weight": 1.0}), ("e2", {"weight": 0.5})], {"normalize": True}),
    "task_arithmetic": ("task_arithmetic", [("e1", {"weight": 1.0}), ("e2", {"weight": 0.5})], {"lambda": 0.8}),
    "ties": ("ties", [("e1", {"weight": 1.0, "density": 0.4}), ("e2", {"weight": 0.5, "density": 0.4})], {"normalize": True}),
    "breadcrumbs_ties": (
        "breadcrumbs_ties",
        [("e1", {"weight": 1.0, "density": 0.4, "gamma": 0.05}), ("e2", {"weight": 0.5, "density": 0.4, "gamma": 0.05})],
        {"normalize": True},
    ),
    "slerp": ("slerp", [("e1", {})], {"t": [0.1, 0.9]}),
    "model_stock": ("model_stock", [("e1", {}), ("e2", {}), ("e3", {})], {}),
    "dare_linear": ("dare_linear", [("e1", {"weight": 1.0, "density": 0.5})], {"rescale": True}),
    "dare_ties": ("dare_ties", [("e1", {"weight": 1.0, "density": 0.5}), ("e2", {"weight": 0.5, "density": 0.5})], {"rescale": True}),
    "della": (
        "della",
        [("e1", {"weight": 1.0, "density": 0.5, "epsilon": 0.1}), ("e2", {"weight": 0.5, "density": 0.5, "epsilon": 0.1})],
        {"rescale": True},
    ),
    "della_linear": ("della_linear", [("e1", {"weight": 1.0, "density": 0.5, "epsilon": 0.1})], {"rescale": True}),
    "nuslerp": ("nuslerp", [("e1", {"weight": 0.4}), ("e2", {"weight": 0.6})], {"nuslerp_flatten": False}),
    "multislerp": ("multislerp", [("e1", {"weight": 1.0}), ("e2", {"weight": 0.5}), ("e3", {"weight": 0.8})], {}),
    "karcher": ("karcher", [("e1", {}), ("e2", {})], {}),
}
#: The deterministic operators: equal to mergekit's to bf16 rounding.
DETERMINISTIC = ["linear", "task_arithmetic", "slerp", "model_stock", "nuslerp", "multislerp", "karcher"]


def _yaml(method: str, models, params, paths) -> str:
    import yaml

    cfg = {
        "merge_method": method,
        "dtype": "float32",
        "out_dtype": "bfloat16",
        "models": [{"model": str(paths[e]), **({"parameters": p} if p else {})} for e, p in models],
    }
    if method == "slerp":
        cfg["models"].insert(0, {"model": str(paths["base"])})
    if method != "linear":
        cfg["base_model"] = str(paths["base"])
    if params:
        cfg["parameters"] = params
    return yaml.safe_dump(cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every mergekit config, run by mergekit: (input tensors, name -> merged tensors, the folder with
    the configs ``NAME.yml``)."""
    if not MERGEKIT_YAML.exists():
        pytest.skip(f"mergekit-yaml not found beside {sys.executable}")
    root = tmp_path_factory.mktemp("mergekit")
    base = make_base(root / "base", arch="llama", dtype="bf16")
    paths = {
        "base": base,
        "e1": make_expert(base, root / "e1", seed=1),
        "e2": make_expert(base, root / "e2", seed=2, scale=0.03),
        "e3": make_expert(base, root / "e3", seed=3, touch=lambda n: "embed" not in n),
    }
    jobs = {}
    for name, (method, models, params) in CONFIGS.items():
        cfg = root / f"{name}.yml"
        cfg.write_text(_yaml(method, models, params, paths))
        jobs[f"out-{name}"] = cfg
    merged = run_mergekit(jobs, root, SEED)
    results = {name: merged[f"out-{name}"] for name in CONFIGS}
    tensors = {k: load_tensors(v) for k, v in paths.items()}
    return tensors, results, root


def ours(name, tensors, rescale=None):
    """MergePipe's operator on whole tensors, same parameters; bf16 result."""
    _, models, params = CONFIGS[name]
    params = dict(params)
    if "rescale" in params:
        params["rescale"] = rescale or "l1"
    spec = MergeSpec(name, tuple((e, p) for e, p in models), params, seed=SEED)
    definition = get_operator(name)
    names = list(tensors["base"])
    num_layers = count_layers(names)
    definition.validate(spec, names, num_layers)
    out = {}
    for t in names:
        base = tensors["base"][t].float()
        deltas = [tensors[e][t].float() - base for e, _ in models]
        params = definition.resolve(spec, t, num_layers)
        ctx = BlockContext(definition, t, base.shape, spec.expert_ids, params, seed=SEED)
        out[t] = merge(base, deltas, ctx).to(torch.bfloat16)
    return out


def operand_scale(tensors, t, experts) -> torch.Tensor:
    """Largest input magnitude per element: fp32 rounding errors scale with it."""
    scale = tensors["base"][t].float().abs()
    for e in experts:
        scale = torch.maximum(scale, tensors[e][t].float().abs())
    return scale


def beyond_rounding(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elements whose values differ by more than one bf16 step of the result
    plus 16 fp32 ulps of the inputs (the two sides order fp32 operations
    differently: B + Σ c(Ei - B) here, Σ wEi / Σw in mergekit, so a result
    that cancels to 0 there can be 1e-9 here)."""
    a, b = a.float(), b.float()
    tol = torch.maximum(a.abs(), b.abs()) * 2.0**-7 + scale * 2.0**-20
    return (a - b).abs() > tol


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_operators_equal_mergekit_to_bf16_rounding(runs, name):
    tensors, results, _ = runs
    mine, theirs = ours(name, tensors), results[name]
    assert set(mine) == set(theirs)
    experts = [e for e, _ in CONFIGS[name][1]]
    total = differ = beyond = 0
    for t in mine:
        total += mine[t].numel()
        differ += int((mine[t] != theirs[t]).sum())
        beyond += int(beyond_rounding(mine[t], theirs[t], operand_scale(tensors, t, experts)).sum())
    print(f"\n[mergekit] {name}: {differ / total:.6%} of {total} elements differ (all within rounding: {beyond == 0})")
    assert beyond == 0
    assert differ / total < 0.01


def _mask_mismatch(kind, delta, p):
    """(ours, mergekit's) keep masks for one expert tensor, and our cut-off values."""
    a = delta.abs().reshape(-1)
    n = a.numel()
    if kind == "ties":
        thr = trim_thresholds(a, [p["density"]])[0]
        mine = (a > thr.tau) | ((a == thr.tau) & (torch.arange(n) <= thr.last_index))
        theirs = magnitude(delta, p["density"]).reshape(-1) != 0
        cuts = {thr.tau}
    else:
        top, outer = min(p["gamma"], 1 - p["density"]), p["gamma"] + p["density"]
        t_top, t_out = trim_thresholds(a, [top, outer])
        idx = torch.arange(n)
        keep_out = (a > t_out.tau) | ((a == t_out.tau) & (idx <= t_out.last_index))
        drop = (a > t_top.tau) | ((a == t_top.tau) & (idx <= t_top.last_index))
        mine = keep_out & ~drop if int(top * n) >= 1 else keep_out
        theirs = magnitude_outliers(delta, p["density"], gamma=p["gamma"]).reshape(-1) != 0
        srt = torch.sort(a, descending=True).values
        n_top = int(p["gamma"] * n)
        edge = min(n - 1, n_top + int(p["density"] * n) - 1)
        cuts = {t_top.tau, t_out.tau, float(srt[max(0, n_top - 1)]), float(srt[n_top]), float(srt[edge]),
                float(srt[min(n - 1, edge + 1)])}
    return mine, theirs, cuts


@pytest.mark.parametrize("name", ["ties", "breadcrumbs_ties"])
def test_trimming_operators_differ_from_mergekit_only_at_tied_thresholds(runs, name):
    tensors, results, _ = runs
    models = CONFIGS[name][1]
    mine, theirs = ours(name, tensors), results[name]
    kind = "ties" if name == "ties" else "breadcrumbs"
    total = differ = beyond = unexplained = 0
    mask_total = mask_differ = 0
    for t in mine:
        base = tensors["base"][t].float()
        explained = torch.zeros(base.numel(), dtype=torch.bool)
        for e, p in models:
            delta = tensors[e][t].float() - base
            m_ours, m_theirs, cuts = _mask_mismatch(kind, delta, p)
            # mergekit's mask marks kept entries whose delta is 0 as dropped; compare where delta != 0
            nz = delta.reshape(-1) != 0
            diff = (m_ours != m_theirs) & nz
            mask_total += int(nz.sum())
            mask_differ += int(diff.sum())
            at_cut = torch.zeros_like(diff)
            for c in cuts:
                at_cut |= delta.abs().reshape(-1) == c
            unexplained += int((diff & ~at_cut).sum())
            explained |= diff
        over = beyond_rounding(mine[t], theirs[t], operand_scale(tensors, t, [e for e, _ in models])).reshape(-1)
        total += over.numel()
        differ += int((mine[t] != theirs[t]).sum())
        beyond += int(over.sum())
        # an output off by more than rounding must sit where a mask differs
        assert not (over & ~explained).any(), t
    print(
        f"\n[mergekit] {name}: kept-set mismatch {mask_differ / mask_total:.4%} of non-zero delta entries "
        f"(all at |delta| == a cut-off value: {unexplained == 0}); output differs at {differ / total:.4%} "
        f"of elements, {beyond / total:.4%} by more than rounding"
    )
    assert unexplained == 0


def _stats(merged, tensors):
    changed = total = 0
    l1 = l2 = 0.0
    for t, out in merged.items():
        d = out.float() - tensors["base"][t].float()
        changed += int((d != 0).sum())
        total += d.numel()
        l1 += float(d.abs().double().sum())
        l2 += float(d.double().pow(2).sum())
    return changed / total, l1, l2**0.5


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_random_operators_match_mergekit_statistically(runs, name):
    tensors, results, _ = runs
    mk = _stats(results[name], tensors)
    l1 = _stats(ours(name, tensors, rescale="l1"), tensors)
    inv = _stats(ours(name, tensors, rescale="inverse"), tensors)
    print(
        f"\n[mergekit] {name}: changed fraction mergekit {mk[0]:.4f} ours(l1) {l1[0]:.4f} ours(inverse) {inv[0]:.4f}; "
        f"L1 ratio ours/mergekit l1 {l1[1] / mk[1]:.4f} inverse {inv[1] / mk[1]:.4f}; "
        f"L2 ratio l1 {l1[2] / mk[2]:.4f} inverse {inv[2] / mk[2]:.4f}"
    )
    assert abs(l1[0] - mk[0]) < 0.01
    assert abs(l1[1] / mk[1] - 1) < 0.02
    assert abs(l1[2] / mk[2] - 1) < 0.03
    assert abs(inv[0] - mk[0]) < 0.01
    assert abs(inv[1] / mk[1] - 1) < 0.05


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_mergepipe_runs_the_same_mergekit_yaml_to_the_same_tensors(runs, name, tmp_path):
    """The YAML mergekit ran, given as it is to ``mergepipe merge --config``."""
    tensors, results, root = runs
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "merge", "--db", str(tmp_path / "c.db"), "--config",
                           str(root / f"{name}.yml"), "--seed", str(SEED), "--out", str(out), "--model-id", name,
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    mine, theirs = load_tensors(out), results[name]
    assert set(mine) == set(theirs)
    experts = [e for e, _ in CONFIGS[name][1]]
    total = differ = beyond = 0
    for t in mine:
        assert mine[t].dtype == theirs[t].dtype == torch.bfloat16
        total += mine[t].numel()
        differ += int((mine[t] != theirs[t]).sum())
        beyond += int(beyond_rounding(mine[t], theirs[t], operand_scale(tensors, t, experts)).sum())
    print(f"\n[mergekit yaml] {name}: {differ / total:.6%} of {total} elements differ (within rounding: {beyond == 0})")
    assert beyond == 0
    assert differ / total < 0.01
