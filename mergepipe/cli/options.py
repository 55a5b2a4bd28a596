"""The options that describe a merge (`plan`, `merge`) and how it runs (`merge`, `execute`, `integrate`), and
the one function that turns them into a ``MergeRequest``.

Parameter help comes from the parameter catalogue (``spec/params.py``);
this module loads neither the engine nor torch, so `plan` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mergepipe.app.planning import read_config
from mergepipe.cli.common import NO_PROGRESS_OPTION
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY, RAY_INSTALL_HINT
from mergepipe.errors import ConfigError
from mergepipe.spec.merge_config import merge_request
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.params import PARAMS
from mergepipe.spec.request import POLICIES, MergeRequest, parse_shard_bytes

#: Parameter flag (click's name) -> the parameter it sets for every expert (a config's global value).
PARAM_FLAGS = {"density": "density", "lambda_": "lambda", "gamma": "gamma", "epsilon": "epsilon", "t": "t",
               "rescale": "rescale", "normalize": "normalize"}
#: Flags that set a request field of the same meaning (click's name -> field).
FIELD_FLAGS = {"base": "base", "experts": "experts", "operator": "operator", "weights": "weights", "seed": "seed",
               "budget": "budget", "policy": "policy", "out_dtype": "out_dtype",
               "previous": "previous", "delta_update": "delta_update", "model_id": "model_id"}


def _apply(func: Callable[..., Any], options: list[Callable[..., Any]]) -> Callable[..., Any]:
    for option in reversed(options):
        func = option(func)
    return func


def merge_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """What to merge and how: the models, the operator and its parameters, the budget and the output."""
    return _apply(func, [
        click.option("--base", "base", help="Base model: a registered id or a checkpoint directory."),
        click.option("--experts", "experts", multiple=True,
                     help="Expert models (ids or directories): --experts A B C."),
        click.option("--operator", default=None,
                     help="Merge operator: " + ", ".join(OPERATORS) + " (dare = dare_linear) [default: ties]."),
        click.option("--weights", multiple=True, type=float, help="One weight per expert: --weights 0.5 0.3."),
        click.option("--density", type=float, help=PARAMS["density"].help()),
        click.option("--lambda", "lambda_", type=float, help=PARAMS["lambda"].help()),
        click.option("--gamma", type=float, help=PARAMS["gamma"].help()),
        click.option("--epsilon", type=float, help=PARAMS["epsilon"].help()),
        click.option("--t", "t", type=float, help=PARAMS["t"].help()),
        click.option("--rescale", type=click.Choice(list(PARAMS["rescale"].choices)), help=PARAMS["rescale"].help()),
        click.option("--normalize/--no-normalize", default=None, help=PARAMS["normalize"].help()),
        click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="A mergekit config as it is (merge_method, base_model, models, parameters, ..., and a "
                     "`mergepipe:` section with budget, policy, seed, block_bytes, model_id, out_shard_size), "
                     "instead of --base/--experts/--operator; or MergePipe's `params:` (global) and "
                     "`expert_params: {ID: {...}}`. Values may be gradients (lists) or "
                     "[{filter: SUBSTRING, value: X}] rules. Flags override the config."),
        click.option("--seed", default=None, type=int, help="Seed of random operators [default: 0]."),
        click.option("--budget", default=None,
                     help="Expert-I/O budget: bytes, a size (906MB, 8GiB), a fraction (25%) or none; or a time "
                     "(20s, 2min: converted into bytes through what this catalog's merges and analyses took on "
                     "this machine), alone or with a byte budget (20s,8GiB: the tighter wins) [default: 100%]."),
        click.option("--policy", type=click.Choice(POLICIES), default=None,
                     help="How to spend the budget: energy (blocks by weighted delta norm per byte), uniform "
                     "(the same share of every tensor), full, or entries (sketches and exact deltas from the "
                     "experts' delta stores, built by `analyze --store-deltas`; keeps the most quality per byte) "
                     "[default: entries when every expert has a delta store and the budget leaves something "
                     "unread, else energy]."),
        click.option("--out-dtype", default=None, help="Output dtype (bf16, f16, f32) [default: the base's]."),
        click.option("--out-shard-size", default=None,
                     help="Largest output shard, e.g. 5GB (model-0000i-of-0000N.safetensors plus an index, as "
                     "transformers writes) [default: the base's sharding]."),
        click.option("--from", "previous", default=None, metavar="SNAPSHOT",
                     help="Merge incrementally: copy the output blocks whose inputs are unchanged from this "
                     "snapshot (a snapshot id, or a merged model id: its latest version). Bit-identical to "
                     "merging from scratch; reads experts only for what changed."),
        click.option("--delta-update", is_flag=True, default=None,
                     help="With --from, for linear/avg/task_arithmetic: update blocks whose only change is a new "
                     "version of an expert from the previous output (reads that expert's old and new blocks "
                     "only). Not bit-identical; the plan's error bound includes the rounding."),
        NO_PROGRESS_OPTION,
        click.option("--strict", is_flag=True,
                     help="Refuse a plan whose output equals the base (a budget that reads nothing, or experts "
                     "identical to the base) instead of warning."),
    ])


def analyze_missing_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """`plan` and `merge` alike: experts not analysed against the base yet are analysed first."""
    return click.option(
        "--analyze-missing/--no-analyze-missing", default=True, show_default=True,
        help="Experts not yet analysed against the base: analyse them first (reads each such expert once, in "
        "full), or with --no-analyze-missing refuse instead.",
    )(func)


def _not_cuda(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        raise ConfigError("no such option --cuda: MergePipe's is --device cuda (`mergepipe-yaml CONFIG OUT --cuda` "
                          "takes mergekit-yaml's flag as it is)")


#: mergekit-yaml's ``--cuda`` given to `plan`, `merge` or `execute`: one line pointing to ``--device cuda``
#: (click would suggest the closest option it knows, ``--db``).
CUDA_TYPO_OPTION = click.option("--cuda", is_flag=True, hidden=True, expose_value=False, callback=_not_cuda,
                                help="mergekit-yaml's flag, refused here: use --device cuda.")


def execution_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Where and how the merge runs: device, memory bound, and the executor of its work units."""
    return _apply(func, [
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
        CUDA_TYPO_OPTION,
        click.option("--max-memory", default=DEFAULT_MAX_MEMORY, show_default=True,
                     help="Bound on the engine's buffers (streaming operators)."),
        click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help="Where work units run: threads of this process, or tasks on a Ray cluster "
                     f"(`{RAY_INSTALL_HINT}`; the checkpoints, the catalog's delta stores and --out must be on a "
                     "filesystem every worker sees, or the checkpoints in object storage). The output is the "
                     "same bytes and snapshot either way."),
        click.option("--ray-address", default=None, metavar="ADDRESS",
                     help="With --executor ray: auto (the cluster `ray start` joined this machine to), "
                     "ray://HOST:PORT (Ray client), HOST:PORT, or local (a Ray instance for this command only) "
                     "[default: $RAY_ADDRESS, else local]."),
        click.option("--workers", type=click.IntRange(min=1), default=None,
                     help="Work units run at once: threads (local), or Ray tasks of one core each "
                     "[default: 1 thread; with Ray, the cluster's cores]."),
    ])


def output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Where a merge publishes its snapshot, and its cost summary."""
    return _apply(func, [
        click.option("--out", required=True, type=click.Path(path_type=Path),
                     help="Output directory (must not exist)."),
        click.option("--model-id", default=None,
                     help="Id of the merged model in the catalog [merge: default the --out folder's name, with a "
                     "hash of its path if another folder published that name]. A plan "
                     "executed before gives the same snapshot, re-materialised at --out: as its own model, or "
                     "under another id as an alias of it (`lineage ID` says which)."),
        click.option("--json-summary", type=click.Path(dir_okay=False, path_type=Path),
                     help="Also write the cost summary as JSON here (bytes, seconds, and this command's CPU "
                     "seconds, peak RSS and disk I/O); an existing file is refused unless --force."),
        click.option("--force", is_flag=True, help="Overwrite an existing --json-summary file (never the catalog "
                     "nor a checkpoint: --out must not exist)."),
    ])


def request_from(kwargs: dict[str, Any]) -> MergeRequest:
    """The merge request the options ask for: flags over ``--config`` over the defaults."""
    config = None if kwargs.get("config_path") is None else read_config(kwargs["config_path"])
    flags = {field: kwargs.get(flag) for flag, field in FIELD_FLAGS.items()}
    flags["out_shard_bytes"] = parse_shard_bytes(kwargs.get("out_shard_size"))  # checked as text, as typed
    flags["params"] = {name: kwargs[flag] for flag, name in PARAM_FLAGS.items() if kwargs.get(flag) is not None}
    return merge_request(flags, config)
