"""Merge every operator on the CPU and on the GPU from the same plan and compare.

Called by ``scripts/gpu-check.sh``. Builds the demo's tiny Qwen3-layout base
and experts, plans each operator at a full and a partial budget, executes
each plan twice (``--device cpu`` and ``--device cuda``, in two copies of
the catalog so the same plan may run twice), and prints one row per run:
streaming operators must give byte-identical files (hence the same snapshot
id); slerp and model_stock must agree to float32 rounding.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from examples.demo_models import make_demo_models
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.request import MergeRequest

EXPERTS = ["math", "code", "chat"]
#: operator -> (experts, MergeRequest fields)
CASES = {
    "avg": (EXPERTS, {}),
    "linear": (EXPERTS, {"weights": [0.5, 0.3, 0.2]}),
    "task_arithmetic": (EXPERTS, {"weights": [1.0, -0.5, 0.7], "params": {"lambda": 0.9}}),
    "ties": (EXPERTS, {"params": {"density": 0.5}}),
    "dare_linear": (EXPERTS, {"params": {"density": 0.6}, "seed": 7}),
    "dare_ties": (EXPERTS, {"params": {"density": 0.5}, "seed": 11}),
    "breadcrumbs": (EXPERTS, {"params": {"density": 0.5, "gamma": 0.1}}),
    "breadcrumbs_ties": (EXPERTS, {"params": {"density": 0.4, "gamma": 0.1}}),
    "della": (EXPERTS, {"params": {"density": 0.5, "epsilon": 0.1}, "seed": 3}),
    "della_linear": (EXPERTS, {"params": {"density": 0.6, "epsilon": 0.2}, "seed": 5}),
    "slerp": (["math"], {"params": {"t": 0.3}}),
    "model_stock": (EXPERTS, {}),
}
BUDGETS = ("100%", "30%")


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def compare(cpu_dir: Path, gpu_dir: Path, streaming: bool) -> str:
    a, b = tensors(cpu_dir), tensors(gpu_dir)
    if a.keys() != b.keys():
        return "FAIL: different tensors"
    if streaming:
        same = all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
        return "bit-identical" if same else "FAIL: bits differ"
    # the float64 reductions may move a coefficient in its last bits, which can
    # flip the rounding of an output element by one unit of its bf16 precision
    worst = max(
        float(((a[n].double() - b[n].double()).abs() / a[n].double().abs().clamp_min(1e-3)).max())
        for n in a if a[n].numel()
    )
    return f"max relative diff {worst:.2e}" + ("" if worst <= 2**-7 else " FAIL")


def main(workdir: Path, devices: tuple[str, str] = ("cpu", "cuda")) -> int:
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    paths = make_demo_models(workdir / "models")
    template = workdir / "template.db"
    with Catalog.create(template, 64 * 1024) as catalog:
        for name, path in paths.items():
            register_model(catalog, name, path)
        analyze(catalog, EXPERTS, base_id="base", progress=False)
    failures = 0
    print(f"{'operator':18} {'budget':6} {'cpu s':>6} {'cuda s':>6}  result")
    for operator, (experts, kwargs) in CASES.items():
        for budget in BUDGETS:
            runs = {}
            for side, device in enumerate(devices):
                db = workdir / f"{operator}-{budget[:-1]}-{side}.db"
                shutil.copy(template, db)
                out = workdir / f"{operator}-{budget[:-1]}-{side}"
                request = MergeRequest(base="base", experts=experts, operator=operator, budget=budget, **kwargs)
                with Catalog.open(db) as catalog:
                    plan = Planner(catalog).plan(request)
                    started = time.perf_counter()
                    snapshot_id, _ = Engine(catalog, device=device).execute(plan, out, model_id="m")
                    runs[side] = (snapshot_id, out, time.perf_counter() - started)
            streaming = OPERATORS[operator].streaming
            result = compare(runs[0][1], runs[1][1], streaming)
            if streaming and runs[0][0] != runs[1][0]:
                result += " (snapshot ids differ)"
            failures += "FAIL" in result or "differ" in result
            print(f"{operator:18} {budget:6} {runs[0][2]:6.2f} {runs[1][2]:6.2f}  {result}")
    print("gpu-check: " + ("all runs agree" if not failures else f"{failures} run(s) disagree"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out")))
