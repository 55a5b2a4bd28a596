"""`mergepipe calibrate`: measure this machine's rates and keep them in the catalog."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mergepipe.catalog import Catalog
from mergepipe.cli import calibrate_probe
from mergepipe.cli.common import DB_OPTION, plain_console
from mergepipe.engine.calibrate import STEPS, calibrate
from mergepipe.machine import machine_key
from mergepipe.planner.seconds import describe_rates
from mergepipe.spec.seconds import STEAL


@click.command("calibrate")
@DB_OPTION
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="Device whose compute rates to measure (merges on it use them).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the scratch files the disk is timed on (removed after): a directory on the disk "
              "your checkpoints and outputs are on [default: the catalog's directory].")
@click.option("--no-progress", is_flag=True, help="Do not show the progress display.")
def calibrate_cmd(db_path: Path, device: str, directory: Path | None, no_progress: bool) -> None:
    """Measure this machine's rates (disk, start-up, compute per operator) for predicted seconds.

    Takes up to about 30 seconds. The rates are kept in this catalog for this machine and device
    (hostname, CPU count, device name); `plan` and `explain` then predict seconds per phase, `--budget 20s`
    becomes a byte budget, and every merge refines the rates it measured. The last step is two small merges of
    synthetic checkpoints, which measure the compute that reads and writes take from a merge (steal) and how far
    reading, merging and writing overlap (the lesser of the two merges' is kept, each).
    Calibrating again replaces the rates, except a steal that real merges have refined since: it is kept.
    """
    machine = machine_key(device)  # a missing GPU fails here, before anything is measured
    with Catalog.open(db_path) as catalog:
        block_bytes = catalog.block_bytes
    console = plain_console(stderr=True)
    display = Progress(TextColumn("[bold]calibrate[/] {task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=console, disable=no_progress or not console.is_terminal,
                       transient=True)
    with display:
        task = display.add_task("", total=len((*STEPS, calibrate_probe.STEP)))
        started: list[str] = []

        def on_step(step: str) -> None:
            display.update(task, completed=len(started), description=step)
            started.append(step)

        where = directory or db_path.resolve().parent
        rates = calibrate(where, device, block_bytes, on_step)
        on_step(calibrate_probe.STEP)
        probed = calibrate_probe.measure(where, rates, device, block_bytes)
        rates = replace(rates, steal=probed.steal, overlap=rates.overlap if probed.overlap is None else probed.overlap)
    with Catalog.open(db_path) as catalog:
        catalog.rates.calibrated(machine, rates, keep=(STEAL,))  # what this machine's merges taught stays
        rates = catalog.rates.get(machine) or rates
    table = Table(title=f"rates of {machine}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in describe_rates(rates):
        table.add_row(name, value)
    plain_console().print(table)
    click.echo(f"written to {db_path}: `mergepipe plan` now predicts seconds on this machine ({device})")


COMMANDS = [calibrate_cmd]
