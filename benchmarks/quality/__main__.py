"""The quality benchmark: does a small budget keep the merged model good?

Usage: ``python -m benchmarks.quality [--quick] [--steps 32] [--policies energy,uniform,entries]``
(``make bench-quality`` / ``make bench-quality-quick``).

A real base (SmolLM2-135M-Instruct, bf16) and four experts fully fine-tuned
from it on four corpora (Python, English prose, arithmetic, C headers). For
TIES (density 0.5) and task arithmetic (mean of the deltas), merges at
100/50/25/10% of the expert bytes under each policy; every model is scored by
held-out loss per corpus (fixed windows of 128 tokens, fp32). Reported per
merge: the loss gap to the 100% merge of the same operator (%), the parameter
deviation ``||M - M100|| / ||M100 - base||``, the plan's error bound and the
expert bytes read (all of them, delta stores included). Base, corpora and
experts are built once under ``benchmarks/quality-cache/`` (git-ignored); the
catalog and merges are redone on every run. Results: a table, and
``benchmarks/results/quality-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.quality import corpora, models
from benchmarks.quality.merges import MergeRun, run_merges
from mergepipe.txn.publish import remove_tree

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "quality-cache"
RESULTS = ROOT / "results"


def prepare(cache: Path, steps: int, eval_windows: int, log) -> tuple[Path, dict[str, Path], dict, dict]:
    """Base, experts (one per corpus) and the held-out windows; training records."""
    from transformers import AutoTokenizer

    base = models.build_base(cache / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    experts, held, training = {}, {}, {}
    for i, name in enumerate(corpora.NAMES):
        texts = cache / "corpora"
        texts.mkdir(parents=True, exist_ok=True)
        if not (texts / f"{name}.held.txt").exists():
            train, held_text = corpora.build(name)
            (texts / f"{name}.train.txt").write_text(train)
            (texts / f"{name}.held.txt").write_text(held_text)
        held[name] = models.windows(models.token_stream(tokenizer, (texts / f"{name}.held.txt").read_text()),
                                    eval_windows)
        out = cache / f"expert-{name}-s{steps}"
        if not (out / "training.json").exists():
            log(f"fine-tuning the {name} expert ({steps} steps)")
            train_tokens = models.token_stream(tokenizer, (texts / f"{name}.train.txt").read_text())
        else:
            train_tokens = None
        training[name] = models.fine_tune(base, train_tokens, out, steps, seed=100 + i)
        experts[name] = out
    return base, experts, held, training


def table(rows: list[dict], names: tuple[str, ...]) -> str:
    head = (f"{'merge':28} {'expert MB':>9} " + " ".join(f"{n:>7}" for n in names)
            + f" {'dev':>6} {'bound':>9} {'estimate':>9} {'left out':>8} {'merge s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        gaps = " ".join(f"{r['gap_pct'][n]:+7.2f}" if r.get("gap_pct") else f"{r['loss'][n]:7.3f}" for n in names)
        dev = f"{r['deviation']:6.3f}" if r.get("deviation") is not None else "     -"
        bound = f"{r['error_bound']:9.3g}" if r.get("error_bound") is not None else "        -"
        estimate = f"{r['estimate']:9.3g}" if r.get("estimate") is not None else "        -"
        mb = f"{r['expert_bytes'] / 1e6:9.1f}" if r.get("expert_bytes") is not None else "        -"
        share = f"{100 * r['error_share']:7.1f}%" if r.get("error_share") is not None else "       -"
        seconds = f"{r['merge_seconds']:7.1f}" if r.get("merge_seconds") is not None else "      -"
        lines.append(f"{r['label']:28} {mb} {gaps} {dev} {bound} {estimate} {share} {seconds}")
    return "\n".join(lines)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks)."""
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def summary(rows: list[dict], analysis: dict) -> str:
    """Rank correlations of the bound and the estimate with the measured deviation (per operator, across
    policies and budgets), entries' merge wall against energy's and the 100% merge's (which computes every
    element too), and the stores' build against analysis."""
    lines = []
    budgeted = [r for r in rows if r.get("deviation") is not None]
    full = {r["operator"]: r["merge_seconds"] for r in rows if r.get("budget") == "100%"}
    for operator in sorted({r["operator"] for r in budgeted}):
        mine = [r for r in budgeted if r["operator"] == operator]
        dev = [r["deviation"] for r in mine]
        lines.append(f"{operator}: rank correlation with the measured deviation over {len(mine)} merges: "
                     f"bound {spearman([r['error_bound'] for r in mine], dev):+.2f}, "
                     f"estimate {spearman([r['estimate'] for r in mine], dev):+.2f}")
        for budget in sorted({r["budget"] for r in mine}, key=lambda b: -float(b.rstrip("%"))):
            wall = {r["policy"]: r["merge_seconds"] for r in mine if r["budget"] == budget}
            if "entries" in wall and "energy" in wall:
                against_full = (f"; the 100% merge {full[operator]:.1f} s ({wall['entries'] / full[operator]:.2f}x)"
                                if operator in full else "")
                lines.append(f"  {budget}: entries merge {wall['entries']:.1f} s vs energy {wall['energy']:.1f} s "
                             f"({wall['entries'] / wall['energy']:.2f}x){against_full}")
    if "store_seconds" in analysis:
        lines.append(f"delta stores built in {analysis['store_seconds']:.1f} s vs analyze {analysis['seconds']:.1f} s "
                     f"({analysis['store_seconds'] / analysis['seconds']:.2f}x)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer windows and budgets (minutes, once cached)")
    parser.add_argument("--steps", type=int, default=32, help="fine-tuning steps per expert")
    parser.add_argument("--policies", default="energy,uniform,entries")
    parser.add_argument("--cache", type=Path, default=CACHE)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)

    base, experts, held, training = prepare(args.cache, args.steps, 8 if args.quick else 32, log)
    budgets = ("25%", "10%") if args.quick else ("50%", "25%", "10%")
    work = args.cache / "work"
    remove_tree(work)
    work.mkdir(parents=True)
    plans = [MergeRun(op, budget, policy) for op in ("ties", "task_arithmetic")
             for budget, policy in [("100%", "energy")] + [(b, p) for b in budgets for p in args.policies.split(",")]]
    rows, analysis = run_merges(work, base, experts, held, plans, log)
    print(table(rows, corpora.NAMES))
    print(summary(rows, analysis))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"quality-{'quick-' if args.quick else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"rows": rows, "training": training, "analysis": analysis,
                               "seconds": time.perf_counter() - started}, indent=2))
    log(f"wrote {out}")
    remove_tree(work)


if __name__ == "__main__":
    main()
