"""`mergepipe eval` (a model's loss on held-out data, or its lm-eval scores, stored in the catalog), `bisect`
(the change and tensors behind a regression) and `search` (the merge parameters that score best)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mergepipe.app.bisecting import Bisection, bisect
from mergepipe.app.evaluating import Evaluation, evaluate, evaluate_tasks
from mergepipe.app.reports import params_text
from mergepipe.app.searching import search
from mergepipe.cli.common import DB_OPTION, FORCE_HTML_OPTION, JSON_OPTION, NO_PROGRESS_OPTION, ConsoleReporter
from mergepipe.cli.common import echo, echo_json, plain_console, table
from mergepipe.errors import ConfigError
from mergepipe.app.evaluating import EvalSettings


def data_option(required: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--data",
        "data",
        multiple=True,
        required=required,
        type=click.Path(path_type=Path),
        metavar="FILE",
        help='Held-out data: plain text (each paragraph an example) or JSONL ("text", or "prompt" and '
        '"completion": only the completion scored); repeat for several files.',
    )


def settings_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """What changes a loss besides the model and the data (``EvalSettings``), and the device."""
    for option in (
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
        click.option(
            "--tokenizer",
            default=None,
            metavar="PATH_OR_HUB_ID",
            help="The tokenizer to tokenise the data with: a folder holding tokenizer files, or a "
            "Hub model id [default: the model's own files, else its base's].",
        ),
        click.option(
            "--batch", type=int, default=EvalSettings.batch, show_default=True, help="Sequences per forward pass."
        ),
        click.option(
            "--max-tokens",
            type=int,
            default=EvalSettings.max_tokens,
            show_default=True,
            help="Tokens per sequence: longer texts are cut into windows of this many; a "
            "prompt/completion keeps its last ones.",
        ),
    ):
        func = option(func)
    return func


def _settings(o: dict[str, Any]) -> EvalSettings:
    return EvalSettings(o["max_tokens"], o["batch"], o["tokenizer"])


@click.command("eval")
@DB_OPTION
@click.argument("target")
@data_option(required=False)
@click.option(
    "--tasks",
    default=None,
    metavar="NAME[,NAME]",
    help="lm-evaluation-harness tasks to run on the same model (pip install 'mergepipe[eval]').",
)
@click.option(
    "--include",
    multiple=True,
    type=click.Path(file_okay=False, path_type=Path),
    metavar="DIR",
    help="With --tasks: a folder of task YAML files (tasks over local data need no network).",
)
@click.option("--limit", type=int, default=None, help="With --tasks: at most this many documents per task.")
@settings_options
@click.option("--again", is_flag=True, help="Evaluate even when the catalog holds this result (it is replaced).")
@JSON_OPTION
@NO_PROGRESS_OPTION
def eval_cmd(db_path: Path, target: str, data: tuple[Path, ...], tasks: str | None, as_json: bool, **o: Any) -> None:
    """Mean token loss and perplexity of a model on held-out data (--data), or its lm-eval task scores
    (--tasks), kept in the catalog.

    TARGET is a snapshot id (or prefix), a merged model id (name@N), a snapshot's folder, a registered
    model, or a plan id never executed: that plan is merged in memory and evaluated without writing a
    snapshot. Data are tokenised with the model's tokenizer (else its base's), or --tokenizer. Results are
    stored under the merge's plan digest (or the model's content) and the data's digest, shown by
    explain, diff and lineage, and returned as they are the next time unless --again.
    """
    if not data and not tasks:
        raise ConfigError("give --data FILE (a loss on held-out text) or --tasks NAME (lm-eval tasks), or both")
    if not tasks and (o["include"] or o["limit"] is not None):
        raise ConfigError(f"{'--include' if o['include'] else '--limit'} needs --tasks")
    summary: dict[str, object] = {}
    common = {"device": o["device"], "again": o["again"], "progress": not o["no_progress"]}
    if data:
        result = evaluate(db_path, target, list(data), settings=_settings(o), **common, reporter=ConsoleReporter())
        summary = result.summary()
        if not as_json:
            echo(_line(result))
    if tasks:
        scored = evaluate_tasks(
            db_path,
            target,
            [t.strip() for t in tasks.split(",") if t.strip()],
            include=list(o["include"]),
            limit=o["limit"],
            batch=o["batch"],
            tokenizer=o["tokenizer"],
            **common,
            reporter=ConsoleReporter(),
        )
        summary = {**summary, "tasks": scored.summary()} if data else scored.summary()
        if not as_json:
            how = "stored result (--again to recompute)" if scored.stored else f"{scored.seconds:.1f} s"
            scores = ", ".join(f"{metric} {value:.4f}" for metric, value in scored.scores.items())
            echo(f"{scored.subject.name}: {scores} ({scored.name}; {how})")
    if as_json:
        echo_json(summary)


def _line(result: Evaluation) -> str:
    how = (
        "stored result (--again to recompute)"
        if result.stored
        else f"{'merged in memory, ' if result.in_memory else ''}{result.seconds:.1f} s"
    )
    return (
        f"{result.subject.name}: loss {result.loss:.4f}, perplexity {result.perplexity:.3f} on "
        f"{result.data.name} ({result.tokens} tokens; {how})"
    )


@click.command("bisect")
@DB_OPTION
@click.argument("good")
@click.argument("bad")
@data_option(required=True)
@click.option(
    "--tolerance",
    type=float,
    default=None,
    help="A probe regresses when its loss exceeds GOOD's by more than this [default: half the gap from GOOD to BAD].",
)
@click.option("--no-tensors", is_flag=True, help="Stop at the culprit changes; do not narrow them to tensors.")
@settings_options
@click.option(
    "--html",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the result as one self-contained HTML page here.",
)
@FORCE_HTML_OPTION
@JSON_OPTION
@NO_PROGRESS_OPTION
def bisect_cmd(db_path: Path, good: str, bad: str, data: tuple[Path, ...], as_json: bool, **o: Any) -> None:
    """Find the changes, then the tensors, that make merge BAD worse than merge GOOD.

    GOOD and BAD are two merges of one base (snapshot ids, merged model ids such as name@1 and
    name@2, or plan ids). The changes between their plans (an expert's version, an expert added or
    removed, a parameter or setting) are searched with hybrid merges, each planned, merged in memory
    and evaluated on --data; then the culprit's tensors, by layer and by kind (attention, MLP, norms).
    Every probe is stored as an evaluation, so running it again computes nothing.
    """
    result = bisect(
        db_path,
        good,
        bad,
        list(data),
        settings=_settings(o),
        tolerance=o["tolerance"],
        tensors=not o["no_tensors"],
        device=o["device"],
        html=o["html"],
        force=o["force"],
        progress=not o["no_progress"],
        reporter=ConsoleReporter(),
    )
    if as_json:
        echo_json(result.summary())
        return
    _print_bisection(result)


def _print_bisection(result: Bisection) -> None:
    console = plain_console()
    good = result.good
    console.print(
        f"GOOD {good.subject.name}: loss {good.loss:.4f}   BAD {result.bad.subject.name}: loss "
        f"{result.bad.loss:.4f}   regression: loss > {good.loss + result.tolerance:.4f}"
    )
    rows = [
        (p.stage, p.what, f"{p.loss:.4f}", f"{p.loss - good.loss:+.4f}", "yes" if p.regresses else "no")
        + ("computed" if p.computed else "stored",)
        for p in result.probes
    ]
    columns = ("stage", "taken from BAD", "loss", "vs GOOD", "regresses", "result")
    console.print(table(f"probes on {good.data.name}", columns, rows, right=("loss", "vs GOOD")))
    for group in result.culprits:
        console.print("culprit: " + " + ".join(c.description for c in group))
    for name, tensors in result.tensor_culprits:
        console.print(f"  through {name}: {len(tensors)} tensor(s): {', '.join(tensors)}")
    console.print(f"{len(result.probes)} probe(s), {result.computed} evaluation(s) computed")


@click.command("search")
@DB_OPTION
@click.argument("search_file", metavar="SEARCH.yml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--trials", type=int, default=None, help="Trials in the study [default: the file's trials].")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the file's study where it stopped, up to --trials complete or pruned trials: the "
    "trials an interruption left unfinished are marked failed, and the sampler proposes the rest from "
    "the trials that ran.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Publish the best trial here, planned again at the file's final_budget (must not exist).",
)
@click.option(
    "--model-id",
    default=None,
    help="Id of the published best [default: the --out folder's name, with a "
    "hash of its path if another folder published that name].",
)
@click.option(
    "--html",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the search as one self-contained HTML page here.",
)
@FORCE_HTML_OPTION
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where trials run: in this process, or on Ray workers (`pip install 'mergepipe[ray]'`; the "
    "checkpoints on a filesystem every worker sees). The trials are the same either way.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Trials proposed together and, with Ray, run at once (the same --workers gives the same "
    "trials on either executor) [default: 1; with Ray, the cluster's cores over --threads].",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Compute threads of each trial [default: as merge and eval use; with Ray, 1 per worker].",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="ADDRESS",
    help="With --executor ray: auto, ray://HOST:PORT, HOST:PORT or local [default: $RAY_ADDRESS, else local].",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="PATH_OR_HUB_ID",
    help="The tokenizer to evaluate with, as `eval --tokenizer` [default: the file's tokenizer, else the "
    "base's files].",
)
@JSON_OPTION
@NO_PROGRESS_OPTION
def search_cmd(db_path: Path, search_file: Path, as_json: bool, no_progress: bool, **options: Any) -> None:
    """Search merge parameters (operator, weights, density, lambda) for the best held-out score.

    Each trial is a merge at the file's search budget, planned, merged in memory and evaluated (as
    `mergepipe eval`: held-out losses, lm-eval scores); Optuna (TPE or CMA-ES, seeded) proposes the
    next, and a trial whose running loss is worse than the median of earlier ones is pruned (it has
    no objective; --json gives its partial_loss). With --executor ray, --workers trials run at once on
    Ray workers. The study is kept in the catalog's database, so --resume continues it after an
    interruption. With --out, the best trial is published as a snapshot (the same one a plain merge
    with its parameters gives); explain and lineage name the study and trial. The file's keys, in a
    complete example: docs/CONCEPTS.md, "The search file". Needs Optuna: pip install
    'mergepipe[search]'.
    """
    result = search(db_path, search_file, **options, progress=not no_progress, reporter=ConsoleReporter())
    best = result.best
    if as_json or best is None:  # a search always has a best: no trial completed is an error
        echo_json(result.summary())
        return
    echo(
        f"study {result.study}: {len(result.trials)} trials; best trial {best.number}: objective "
        f"{best.objective:.4f} ({params_text(best.params, digits=4)})"
    )
    if result.finalists:
        echo(
            "at the final budget: "
            + ", ".join(f"trial {n} {v:.4f}" for n, v in result.finalists.items())
            + f" (trial {best.number} is published)"
        )
    if result.published is not None:
        echo(
            f"published snapshot {result.published.snapshot_id} as '{result.published.model_id}' at "
            f"{result.published.out}"
        )


COMMANDS = [eval_cmd, bisect_cmd, search_cmd]
