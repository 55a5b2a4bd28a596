"""`mergepipe-yaml CONFIG OUT [options]`: mergekit-yaml's command line, run by MergePipe. Every option
mergekit-yaml 0.1.5 takes does what it does there, is accepted with a note saying why it does not apply, or
is refused by name in one line; MergePipe's own options are as `mergepipe merge` has them."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mergepipe.app.merging import Execution, merge_config
from mergepipe.cli.common import CATALOG, NO_PROGRESS_OPTION, ConsoleReporter, echo, run_command_line
from mergepipe.cli.merge_cmds import hub_target, print_merged, push_options
from mergepipe.errors import ConfigError
from mergepipe.spec.request import POLICIES, parse_shard_bytes

#: mergekit's own size form (``parse_kmb``): a byte count, optionally with k, m or b (thousands, millions, billions).
_KMB = re.compile(r"^(?P<number>[0-9]+)(?P<unit>[kKmMbB]?)$")
_KMB_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}

#: mergekit-yaml options accepted that change nothing here: the value's type (None: a --NAME/--no-NAME flag),
#: and why it does not apply.
IGNORED: dict[str, tuple[type | None, str]] = {
    "lazy_unpickle": (None, "MergePipe reads safetensors only (never pickles), each block as needed"),
    "low_cpu_memory": (None, "MergePipe streams blocks under --max-memory; nothing is held whole"),
    "read_to_gpu": (None, "MergePipe reads into host buffers and computes on --device"),
    "multi_gpu": (
        None,
        "MergePipe computes on one device; `mergepipe merge --executor ray` spreads a merge over machines",
    ),
    "async_write": (None, "MergePipe writes each tensor at its fixed offset as soon as it is merged"),
    "write_threads": (int, "MergePipe's workers write their own tensors"),
    "clone_tensors": (None, "MergePipe writes every tensor from its own buffer"),
    "trust_remote_code": (None, "MergePipe never loads a model's code"),
    "transformers_cache": (
        str,
        "MergePipe reads Hub models through huggingface_hub's own "
        "cache (set HF_HUB_CACHE or HF_HOME to choose it), and only what a merge needs",
    ),
    "lora_merge_cache": (str, "MergePipe applies an adapter block by block, never as a merged copy of its model"),
    "allow_crimes": (
        None,
        "it lets mergekit merge models of other architectures than the base's; where "
        "they match it changes nothing, and a model whose tensor names or shapes differ from the base's "
        "is still refused, by name",
    ),
}
#: mergekit-yaml options (the value that asks for it) that ask for what MergePipe does not do, and why.
REFUSED = {
    "unsafe_truncate_embeddings": (
        True,
        "--unsafe-truncate-embeddings would cut embedding rows down to the "
        "smallest vocabulary; MergePipe does not: every expert must have the base's "
        "shapes; drop the flag",
    ),
    "write_model_card": (
        False,
        "--no-write-model-card: MergePipe's model card (README.md) and mergepipe_config.yml "
        "are part of the snapshot, which `mergepipe verify` checks; drop the flag",
    ),
    "safe_serialization": (
        False,
        "--no-safe-serialization would write pickled weights; MergePipe writes safetensors only; drop the flag",
    ),
}


def shard_bytes(value: str | None) -> int | None:
    """``--out-shard-size`` as mergekit reads it (``5B``: five billion bytes, ``500M``, ``1000000``), or as
    a size with a byte unit (``5GB``, ``2GiB``)."""
    if value is None:
        return None
    match = _KMB.match(value.strip())
    if match is None:
        return parse_shard_bytes(value)
    size = int(match["number"]) * _KMB_UNITS[match["unit"].lower()]
    if size < 1:
        raise ConfigError(
            f"--out-shard-size {value!r} is 0 bytes; give the largest shard, e.g. 5B (five billion "
            "bytes, as mergekit reads it) or 5GB"
        )
    return size


def _device(device: str | None, cuda: bool) -> str:
    """mergekit's device choice: ``--device`` (``auto``: cuda when there is one), else cuda with ``--cuda``."""
    if device is None:
        return "cuda" if cuda else "cpu"
    if device == "auto":
        import torch  # only asked for here: mergekit's "auto" means a look at the machine

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _bool(name: str, help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A mergekit ``--NAME/--no-NAME`` flag, None when not given."""
    flag = name.replace("_", "-")
    return click.option(f"--{flag}/--no-{flag}", name, default=None, help=help_text)


def mergekit_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of mergekit-yaml 0.1.5 (``mergekit/options.py``), under its own name."""
    options: list[Callable[..., Any]] = [
        _bool("cuda", "Compute on the GPU (= --device cuda)."),
        click.option(
            "--device",
            default=None,
            help="Device to compute on: cpu, cuda, cuda:N, or auto (cuda if there is one) [default: cpu].",
        ),
        _bool("copy_tokenizer", "Copy the base's tokenizer files to the output [default: copy]."),
        click.option(
            "--random-seed",
            "random_seed",
            type=int,
            default=None,
            help="Seed of random methods (DARE, DELLA): MergePipe's --seed.",
        ),
        click.option(
            "--out-shard-size",
            "out_shard_size",
            default=None,
            help="Largest output shard: mergekit's form (5B = five billion bytes, 500M) or a size (5GB) "
            "[default: the base's sharding].",
        ),
        _bool("quiet", "No progress bars and no tables (as `mergepipe merge --quiet`)."),
        click.option(
            "--num-threads",
            "-j",
            "num_threads",
            type=click.IntRange(min=1),
            default=None,
            help="Work units merged at once (MergePipe's --workers).",
        ),
        click.option("-v", "verbosity", count=True, help="Accepted; MergePipe says what it does anyway."),
        click.option("--gpu-rich", "gpu_rich", is_flag=True, default=False, help="Compute on the GPU (= --cuda)."),
        _bool("unsafe_truncate_embeddings", "Refused: every expert must have the base's shapes."),
        _bool("write_model_card", "Accepted; --no-write-model-card is refused (the card is part of the snapshot)."),
        _bool("safe_serialization", "Accepted; --no-safe-serialization is refused (safetensors only)."),
        click.option(
            "--lora-merge-dtype",
            "lora_merge_dtype",
            default=None,
            help="Refused: MergePipe applies adapters in float32.",
        ),
    ]
    for name, (kind, why) in IGNORED.items():
        options.append(
            _bool(name, f"Ignored: {why}.")
            if kind is None
            else click.option(f"--{name.replace('_', '-')}", name, type=kind, default=None, help=f"Ignored: {why}.")
        )
    for option in reversed(options):
        func = option(func)
    return func


#: ``--db`` as the other commands have it, but the default catalog is found (and named) only once the options are
#: checked: a refused option or device leaves nothing behind, not even the default catalog's folder.
_DB_OPTION = click.option(
    "--db",
    "db_path",
    default=None,
    type=CATALOG,
    help="Catalog file (SQLite; created if missing) or postgresql:// URL [default: $MERGEPIPE_DB, else catalog.db "
    "in mergepipe/ of your data directory, as `mergepipe merge --help` says].",
)


@click.command("mergepipe-yaml", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config_path", metavar="CONFIG", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out", metavar="OUT", type=click.Path(path_type=Path))
@_DB_OPTION
@click.option(
    "--budget",
    default=None,
    help="Expert-I/O budget: bytes, a size (906MB), a fraction (25%), a time (20s) or none "
    "[default: the config's `mergepipe: budget`, else 100%].",
)
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default=None,
    help="How to spend the budget (see `mergepipe merge --help`) [default: entries when every "
    "expert has a delta store, else energy].",
)
@click.option(
    "--model-id",
    default=None,
    help="Id of the merged model in the catalog [default: the config's `mergepipe: model_id`, else OUT's "
    "folder name, with a hash of OUT's path if another folder published that name].",
)
@NO_PROGRESS_OPTION
@push_options
@mergekit_options
def mergepipe_yaml(
    config_path: Path,
    out: Path,
    db_path: Path | None,
    budget: str | None,
    policy: str | None,
    model_id: str | None,
    no_progress: bool,
    **mergekit: Any,
) -> None:
    """Merge a mergekit config into OUT, as `mergekit-yaml CONFIG OUT` does.

    The config runs as it is (see docs/MERGEKIT.md); mergekit-yaml's options are taken by name: those
    that do not apply are ignored with a note, those that ask for what MergePipe does not do are
    refused. The catalog is --db, else $MERGEPIPE_DB, else your per-user one; OUT's folder name is the
    model id unless --model-id (or the config) says otherwise, with a hash of OUT's path added when a
    model of that name was published from another folder (two projects' ./out stay two models).

    OUT may exist, as for mergekit-yaml: an empty folder is used; run again into the OUT it published,
    the same config does nothing and another one replaces it, atomically, as the model's next version
    (the catalog keeps the old snapshot: `mergepipe execute --plan` re-materialises it); a folder
    holding files MergePipe did not write is refused, naming them. The same config into another OUT
    publishes the same snapshot under that id too.
    """
    hub = hub_target(mergekit)
    for name, (asks, why) in REFUSED.items():
        if mergekit[name] is asks:
            raise ConfigError(why)
    if mergekit["lora_merge_dtype"] is not None:
        raise ConfigError(
            "--lora-merge-dtype: MergePipe applies LoRA adapters in float32 (ΔW = s·B·A added to "
            "the base's block), not in another dtype; drop the flag"
        )
    notes = [
        f"--{n.replace('_', '-')} ignored: {why}" for n, (_, why) in IGNORED.items() if mergekit[n] not in (None, False)
    ]
    if mergekit["gpu_rich"]:
        notes.append(
            "--gpu-rich: runs on cuda (one device; the rest of what it turns on does not apply to "
            "MergePipe's streaming reads)"
        )
    quiet, shard = bool(mergekit["quiet"]), shard_bytes(mergekit["out_shard_size"])
    device = _device(mergekit["device"], bool(mergekit["cuda"]) or mergekit["gpu_rich"])
    for note in notes:
        echo(f"note: {note}", err=True)
    merged = merge_config(
        config_path,
        out,
        db=db_path,
        budget=budget,
        policy=policy,
        model_id=model_id,
        seed=mergekit["random_seed"],
        copy_tokenizer=mergekit["copy_tokenizer"] is not False,
        out_shard_bytes=shard,
        execution=Execution(device=device, workers=mergekit["num_threads"], progress=not (no_progress or quiet)),
        push_to_hub=hub,
        reporter=ConsoleReporter(quiet=quiet),
    )
    print_merged(merged, quiet)


def main(argv: list[str] | None = None) -> None:
    """Console entry point of `mergepipe-yaml`: expected failures are one line, without a traceback."""
    run_command_line(mergepipe_yaml, argv, prog_name="mergepipe-yaml")
