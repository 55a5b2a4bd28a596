"""`make demo` (`python -m examples.demo`): the whole loop on tiny generated checkpoints.

Each step is a real `mergepipe` command, printed before it runs, so the demo doubles as a
tutorial: copy any line and run it yourself.
"""

from __future__ import annotations

import shlex
from importlib.util import find_spec
from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

from examples.demo_models import (
    HELD_OUT,
    make_demo_adapter,
    make_demo_models,
    prepare_workdir,
    relative_error,
    retrain,
    same_weights,
)
from mergepipe.cli import cli
from mergepipe.cli.common import plain_console


def _run(console: Console, args: list[str]) -> None:
    """Print a command line, then run it as `mergepipe` would."""
    console.print(Text(f"\n$ mergepipe {shlex.join(args)}", style="bold cyan"))
    cli.main(args=args, prog_name="mergepipe", standalone_mode=False)


@click.command("demo")
@click.option(
    "--workdir",
    default="demo-out",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to write the demo's checkpoints, catalog and snapshots (replaced on each run).",
)
def main(workdir: Path) -> None:
    """Generate tiny checkpoints and run register, analyze, plan, merge (blocks and delta stores), verify,
    explain, lineage, then a second iteration (a retrained expert merged incrementally), a mergekit config
    as it is, experts given as a delta checkpoint and a LoRA adapter, and an evaluation of the merges."""
    console = plain_console()
    prepare_workdir(workdir)
    console.rule("1. tiny checkpoints: a Qwen3-layout base and three experts (math, code, chat)")
    paths = make_demo_models(workdir / "models")
    for name, path in paths.items():
        console.print(f"  {name:5s} {path}")
    db = str(workdir / "catalog.db")
    console.rule("2. catalog: register and analyze once")
    _run(console, ["init-db", "--db", db, "--block-bytes", "64KiB"])
    for name, path in paths.items():
        _run(console, ["register", "--db", db, "--model-id", name, "--uri", str(path)])
    _run(console, ["analyze", "--db", db, "--base", "base", "math", "code", "chat"])
    _run(console, ["models", "--db", db])
    experts = ["--experts", "math", "code", "chat"]
    ties = ["--operator", "ties", "--density", "0.5"]
    console.rule("3. plan under a 25% expert-I/O budget (reads nothing yet)")
    _run(console, ["plan", "--db", db, "--base", "base", *experts, *ties, "--budget", "25%", "--save"])
    console.rule("4. merge: budgeted (25%) and full (100%)")
    budgeted, full = workdir / "merged-25", workdir / "merged-full"
    _merge(console, db, budgeted, "merged-25", *experts, *ties, "--budget", "25%")
    _merge(console, db, full, "merged-full", *experts, *ties, "--budget", "100%")
    console.rule("5. delta stores: a 10% budget spent on sketches of every delta (policy entries)")
    entries = workdir / "merged-10-entries"
    _run(
        console,
        [
            "analyze",
            "--db",
            db,
            "--base",
            "base",
            "--store-deltas",
            str(workdir / "stores"),
            "--no-progress",
            "math",
            "code",
            "chat",
        ],
    )
    _merge(console, db, entries, "merged-10-entries", *experts, *ties, "--budget", "10%", "--policy", "entries")
    console.rule("6. verify, explain (also as an HTML report), lineage")
    _run(console, ["verify", str(budgeted)])
    _run(console, ["snapshots", "--db", db])
    _run(console, ["explain", "--db", db, "merged-25", "--tensor", "layers.3"])
    _run(console, ["lineage", "--db", db, "merged-25"])
    _run(console, ["explain", "--db", db, "merged-25", "--html", str(workdir / "explain-merged-25.html")])
    _run(console, ["explain", "--db", db, "merged-10-entries", "--tensor", "layers.3"])
    console.rule("7. how close are the budgeted merges?")
    console.print(
        f"  relative Frobenius error vs the full merge: 25% energy (blocks) "
        f"{relative_error(budgeted, full):.3e}, "
        f"10% entries (delta stores) {relative_error(entries, full):.3e}"
    )
    _load_in_transformers(console, budgeted)
    _next_iteration(console, db, paths["math"], workdir, [*experts, *ties])
    _mergekit_config(console, db, paths, workdir)
    _deltas_and_adapters(console, db, paths["base"], workdir)
    _evaluate(console, db, workdir)


def _merge(console: Console, db: str, out: Path, model_id: str, *args: str) -> None:
    """``mergepipe merge`` of the demo's base with ``args`` into ``out`` as ``model_id``."""
    _run(
        console,
        ["merge", "--db", db, "--base", "base", *args, "--out", str(out), "--model-id", model_id, "--no-progress"],
    )


def _next_iteration(console: Console, db: str, math_dir: Path, workdir: Path, merge_args: list[str]) -> None:
    """Iteration 2: math is retrained in one of its 4 layers; re-merge paying only for what changed."""
    console.rule("8. math retrained in layer 3: a new version, analysed and merged incrementally")
    math_v2 = retrain(math_dir, workdir / "models" / "math-v2", layer=3)
    _run(console, ["register", "--db", db, "--model-id", "math", "--uri", str(math_v2), "--new-version"])
    _run(console, ["analyze", "--db", db, "--base", "base", "--no-progress", "math"])
    incremental, scratch = workdir / "merged-full-v2", workdir / "merged-full-v2-scratch"
    _merge(console, db, incremental, "merged-full", *merge_args, "--from", "merged-full")
    _merge(console, db, scratch, "merged-full-scratch", *merge_args)
    _run(console, ["explain", "--db", db, "merged-full", "--tensor", "mlp.down_proj"])
    _run(console, ["lineage", "--db", db, "merged-full"])
    console.print(
        f"  the incremental merge is byte-identical to the from-scratch one: {same_weights(incremental, scratch)}"
    )


def _mergekit_config(console: Console, db: str, paths: dict[str, Path], workdir: Path) -> None:
    """A mergekit YAML as it is, with MergePipe's own section: paths resolve to the registered models."""
    console.rule("9. a mergekit config, as it is (docs/MERGEKIT.md)")
    config = workdir / "merge.yml"
    config.write_text(
        "merge_method: dare_ties\n"
        f"base_model: {paths['base']}\n"
        "models:\n"
        f"  - model: {paths['code']}\n"
        "    parameters: {weight: 0.6, density: [0.3, 0.7]}\n"
        f"  - model: {paths['chat']}\n"
        "    parameters: {weight: 0.4, density: 0.5}\n"
        "dtype: bfloat16\n"
        "mergepipe: {budget: 50%, seed: 7, model_id: code-chat}\n"
    )
    click.echo(config.read_text().rstrip())
    out = workdir / "merged-mergekit-yaml"
    _run(console, ["merge", "--db", db, "--config", str(config), "--out", str(out), "--no-progress"])
    _run(console, ["verify", str(out)])
    console.print(f"  {out.name}/mergepipe_config.yml states the merge again, with the exact versions merged:")
    click.echo((out / "mergepipe_config.yml").read_text().rstrip())


def _deltas_and_adapters(console: Console, db: str, base: Path, workdir: Path) -> None:
    """Experts that are not full checkpoints: an exported delta and a PEFT LoRA adapter, in one merge."""
    console.rule("10. experts as a delta checkpoint and as a LoRA adapter")
    delta, adapter = workdir / "code-delta", make_demo_adapter(base, workdir / "models" / "chat-lora")
    _run(console, ["export-delta", "--db", db, "--model", "code", "--out", str(delta), "--dtype", "bf16"])
    _run(
        console,
        ["register", "--db", db, "--model-id", "code-delta", "--uri", str(delta), "--kind", "delta", "--base", "base"],
    )
    _run(
        console,
        ["register", "--db", db, "--model-id", "chat-lora", "--uri", str(adapter), "--kind", "lora", "--base", "base"],
    )
    mixed = "--experts math code-delta chat-lora --operator ties --density 0.5".split()
    _merge(console, db, workdir / "merged-mixed", "merged-mixed", *mixed)
    _run(console, ["explain", "--db", db, "merged-mixed", "--tensor", "layers.3.self_attn.q_proj"])


def _evaluate(console: Console, db: str, workdir: Path) -> None:
    """The merges' mean token loss on a short text, with the demo models' tiny tokenizer, kept in the catalog."""
    console.rule('11. evaluate the merges on held-out text (docs/CONCEPTS.md, "Evaluation")')
    text = workdir / "held-out.txt"
    text.write_text(HELD_OUT)
    if find_spec("transformers") is None:
        console.print("  (transformers is not installed: pip install 'mergepipe[eval]' to evaluate)")
        return
    for target in ("merged-25", "merged-full"):
        _run(console, ["eval", "--db", db, target, "--data", str(text), "--no-progress"])
    console.print(
        "  random tiny models score near ln(4096) = 8.3; `mergepipe search` looks for better weights "
        '(docs/CONCEPTS.md, "The search file", runs in this folder)'
    )


def _load_in_transformers(console: Console, path: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        console.print("  (transformers is not installed: skipping the load check)")
        return
    model = AutoModelForCausalLM.from_pretrained(path)
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    console.print(
        f"  transformers loaded {path.name} as {type(model).__name__}; logits {tuple(logits.shape)}, "
        f"finite: {bool(torch.isfinite(logits).all())}"
    )


if __name__ == "__main__":
    main()
