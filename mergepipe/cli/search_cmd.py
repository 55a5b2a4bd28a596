"""`mergepipe search SEARCH.yml`: the merge parameters that score best (``app/searching.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mergepipe.app.searching import search
from mergepipe.cli.common import DB_OPTION, JSON_OPTION, NO_PROGRESS_OPTION, ConsoleReporter, echo
from mergepipe.planner.evaluations import params_text


@click.command("search")
@DB_OPTION
@click.argument("search_file", metavar="SEARCH.yml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--trials", type=int, default=None, help="Trials in the study [default: the file's trials].")
@click.option("--resume", is_flag=True, help="Continue the file's study where it stopped, up to --trials "
              "complete or pruned trials: the trials an interruption left unfinished are marked failed and run "
              "again, so with the same --workers the study runs the trials of the search run in one go.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Publish the best trial here, planned again at the file's final_budget (must not exist).")
@click.option("--model-id", default=None, help="Id of the published best [default: the --out folder's name, with a "
              "hash of its path if another folder published that name].")
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the search as one self-contained HTML page here.")
@click.option("--force", is_flag=True, help="Overwrite an existing --html file.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where trials run: in this process, or on Ray workers (`pip install 'mergepipe[ray]'`; the "
              "checkpoints on a filesystem every worker sees). The trials are the same either way.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Trials proposed together and, with Ray, run at once (the same --workers gives the same "
              "trials on either executor) [default: 1; with Ray, the cluster's cores over --threads].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Compute threads of each trial [default: as merge and eval use; with Ray, 1 per worker].")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="With --executor ray: auto, ray://HOST:PORT, HOST:PORT or local [default: $RAY_ADDRESS, "
              "else local].")
@click.option("--tokenizer", default=None, metavar="PATH_OR_HUB_ID",
              help="The tokenizer to evaluate with, as `eval --tokenizer` [default: the file's tokenizer, else the "
              "base's files].")
@JSON_OPTION
@NO_PROGRESS_OPTION
def search_cmd(db_path: Path, search_file: Path, trials: int | None, resume: bool, out: Path | None,  # noqa: PLR0913
               model_id: str | None, html: Path | None, force: bool, executor: str, workers: int | None,
               threads: int | None, ray_address: str | None, tokenizer: str | None, as_json: bool,
               no_progress: bool) -> None:
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
    result = search(db_path, search_file, trials=trials, resume=resume, out=out, model_id=model_id, html=html,
                    force=force, executor=executor, workers=workers, threads=threads, ray_address=ray_address,
                    tokenizer=tokenizer, progress=not no_progress, reporter=ConsoleReporter())
    if as_json:
        click.echo(json.dumps(result.summary(), indent=2, sort_keys=True, default=str))
        return
    best = result.best
    assert best is not None
    echo(f"study {result.study}: {len(result.trials)} trials; best trial {best.number}: objective "
         f"{best.objective:.4f} ({params_text(best.params, digits=4)})")
    if result.finalists:
        echo("at the final budget: " + ", ".join(f"trial {n} {v:.4f}" for n, v in result.finalists.items())
             + f" (trial {best.number} is published)")
    if result.published is not None:
        echo(f"published snapshot {result.published.snapshot_id} as '{result.published.model_id}' at "
             f"{result.published.out}")


COMMANDS = [search_cmd]
