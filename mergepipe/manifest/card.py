"""The model card (``README.md``) of a snapshot: what was merged, how, what it cost, how to redo it.

The card is a pure function of the manifest, so it can name the snapshot id
and the manifest hash, which the hashed file list cannot contain. It is
therefore kept out of that list, and ``verify`` checks it by writing it
again from the manifest: an edited card is reported like an edited file.
Only this release's text can be written again, so the manifest records
which text its card and config file have (``extra.card_format``,
``CARD_FORMAT``); a snapshot with another (an earlier MergePipe's, or none
recorded) has its card and config file checked for naming the snapshot,
and ``verify`` says that it could not check more.
The base's own card is never copied: it describes another model.

Its front matter is the Hub's model-card metadata for a merge, from which
the Hub draws the model tree: ``base_model`` lists the models merged, the
base first, as people know them (the manifest's ``extra.base_name`` and
``extra.expert_names``: a Hub id or the folder's name; the catalog's id means
nothing outside the catalog, and names an expert only where it is its
folder's name too), with ``base_model_relation: merge``. Each expert's weight
is shown as the merge stated it, a gradient or filter rules included, not as
the one number a manifest's ``experts`` entry holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mergepipe.manifest.manifest import Manifest
from mergepipe.spec.mergekit import rescale_to_mergekit
from mergepipe.spec.operators import get_operator
from mergepipe.spec.settings import VERSIONED
from mergepipe.storage.checkpoint import CARD_FILENAME, MERGE_CONFIG_FILENAME

#: The file's name in a snapshot directory.
CONFIG_FILENAME = MERGE_CONFIG_FILENAME
#: Output dtypes as config files (this one, mergekit's, transformers' config.json) spell them.
DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
#: The dtype every merge computes in, as ``dtype:`` says it.
COMPUTE_DTYPE = DTYPE_NAMES["F32"]


def merge_config_yaml(manifest: Manifest) -> str:
    """The config file of the snapshot ``manifest`` describes."""
    m = manifest
    method, params = _method_and_params(m)
    experts = m.operator.params.get("experts", {})
    models = [
        {"model": pinned(e.id), **({"parameters": dict(experts[e.id])} if experts.get(e.id) else {})} for e in m.experts
    ]
    if method == "slerp":
        models.insert(0, {"model": pinned(m.base.id)})  # mergekit lists both ends of the interpolation
    if method == "linear":  # mergekit averages its base_model: listed with its weight, else out (base_weight 0)
        if "base_weight" in params:
            models.insert(0, {"model": pinned(m.base.id), "parameters": {"weight": params.pop("base_weight")}})
        else:
            params["base_weight"] = 0
    # nuslerp and multislerp of the models themselves: mergekit's form has no base_model, the base is the first model
    baseless = method in ("nuslerp", "multislerp") and params.get("task_vectors", True) is False
    if baseless:
        params.pop("task_vectors")
        weight = params.pop("base_weight", None)
        models.insert(
            0, {"model": pinned(m.base.id), **({"parameters": {"weight": weight}} if weight is not None else {})}
        )
    config: dict[str, Any] = {
        "merge_method": method,
        **({} if baseless else {"base_model": pinned(m.base.id)}),
        "models": models,
    }
    if "passthrough" in m.extra:  # a frankenmerge states its slices, one model each, and no parameters
        config = {"merge_method": method, "base_model": pinned(m.base.id), "slices": _slices(m)}
    if params:
        config["parameters"] = params
    config["dtype"] = COMPUTE_DTYPE
    if m.extra.get("out_dtype"):
        config["out_dtype"] = DTYPE_NAMES[m.extra["out_dtype"]]
    if m.extra.get("chat_template"):
        config["chat_template"] = m.extra["chat_template"]
    config["mergepipe"] = _mergepipe_section(m)
    header = [
        f"# Snapshot {m.snapshot_id} of '{m.model_id}' (manifest {m.manifest_hash[:16]}) as a mergekit-style",
        "# config. `model:` entries are MergePipe catalog ids of the exact versions merged (mergekit needs",
        "# paths there). Rerun: mergepipe merge --db CATALOG --config mergepipe_config.yml --out DIR",
        f"# dtype: {COMPUTE_DTYPE} is what MergePipe computed in, so that mergekit computes the same.",
    ]
    if not m.extra.get("out_dtype"):
        header.append(
            "# mergepipe.out_dtype: base kept each tensor's dtype (mergekit writes float32 without out_dtype)."
        )
    if m.operator.name == "avg":
        header.append("# MergePipe's avg is written as mergekit's linear with equal weights: the same mean.")
    if method == "linear" and params.get("base_weight") == 0:
        header.append("# base_weight: 0 (MergePipe's) keeps base_model out of the average; mergekit would add it.")
    return "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


def pinned(model_id: str) -> str:
    """A reference to exactly this version: a stored id without ``@N`` is version 1 of its name, and
    the bare name would mean the latest version by the time someone reruns the merge."""
    return model_id if VERSIONED.match(model_id) else f"{model_id}@1"


def _slices(m: Manifest) -> list[dict[str, Any]]:
    """A passthrough's slices as mergekit writes them (``extra.passthrough``: ``spec/copy_map.py``)."""
    return [
        {"sources": [{"model": pinned(s["model"]), "layer_range": list(s["layer_range"])}]}
        for s in m.extra["passthrough"]["slices"]
    ]


def _method_and_params(m: Manifest) -> tuple[str, dict[str, Any]]:
    params = dict(m.operator.params.get("global", {}))
    if "passthrough" in m.extra:  # no operator: tensors copied as they are
        return m.operator.name, params
    if m.operator.name == "avg":
        return "linear", params
    names = get_operator(m.operator.name).global_params().to_dict()
    if "rescale" in names:
        params["rescale"] = rescale_to_mergekit(params.get("rescale", names["rescale"]))
    return m.operator.name, params


def _mergepipe_section(m: Manifest) -> dict[str, Any]:
    written = "none" if m.budget_bytes is None else f"{m.budget_bytes}B"  # a manifest without the text
    section: dict[str, Any] = {
        "budget": m.extra.get("budget") or written,
        "policy": m.extra.get("policy", "energy"),
        "seed": m.seed,
        "block_bytes": m.extra.get("block_bytes"),
        "model_id": m.model_id.split("@")[0],
    }
    if m.extra.get("out_shard_bytes"):
        section["out_shard_size"] = exact_size(m.extra["out_shard_bytes"])
    if not m.extra.get("out_dtype"):
        section["out_dtype"] = "base"
    return {k: v for k, v in section.items() if v is not None}


def exact_size(n: int) -> str:
    """``n`` bytes in the largest unit that states it exactly (``40KB``, ``5GiB``, else ``123B``)."""
    for unit, factor in (("GB", 10**9), ("GiB", 1 << 30), ("MB", 10**6), ("MiB", 1 << 20), ("KB", 1000), ("KiB", 1024)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


#: The text ``derived_files`` writes, recorded in each manifest's ``extra.card_format``: raised with any change
#: to the card's or config file's text, so that ``verify`` re-creates only the snapshots of this one (1: the
#: manifests before it was recorded, whose cards earlier releases wrote).
CARD_FORMAT = 2


def derived_files(manifest: Manifest) -> dict[str, str]:
    """``{file name: text}`` of the files a snapshot's manifest determines."""
    return {CARD_FILENAME: model_card(manifest), CONFIG_FILENAME: merge_config_yaml(manifest)}


def card_format(manifest: Manifest) -> int:
    """The format of the snapshot's card and config file (``CARD_FORMAT``: those ``derived_files`` writes)."""
    value = manifest.extra.get("card_format", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def as_written(manifest: Manifest, text: str | None, written: str) -> bool:
    """Whether ``text`` (a derived file's, None when unreadable) is what MergePipe wrote for the snapshot, whose
    ``derived_files`` text is ``written``: exactly that, for a card of ``CARD_FORMAT``; for an earlier one, a text
    naming the snapshot (this release cannot write that text again)."""
    if text is None:
        return False
    return text == written if card_format(manifest) == CARD_FORMAT else manifest.snapshot_id in text


def read_text(path: Path) -> str | None:
    """A derived file's text; None when it cannot be read as UTF-8 text."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def model_card(manifest: Manifest) -> str:
    """The card of the snapshot ``manifest`` describes."""
    m = manifest
    realized, estimated = m.cost.realized, m.cost.estimated
    budget = "none" if m.budget_bytes is None else f"{m.budget_bytes:,} bytes"
    if m.extra.get("budget") and m.budget_bytes is not None:
        budget = f"{m.extra['budget']} ({budget})"
    bound = "-" if m.error_bound.estimated is None else f"{m.error_bound.estimated:.6g} ({m.error_bound.kind})"
    front = {
        "base_model": merged_models(m),
        "base_model_relation": "merge",
        "library_name": "transformers",
        "tags": ["merge", "mergepipe"],
    }
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False, allow_unicode=True, default_flow_style=None, width=1 << 16).rstrip(),
        "---",
        f"# {m.model_id}",
        "",
        f"A merge of `{m.base.id}` with {len(m.experts)} expert(s) by **{m.operator.name}**, made by MergePipe "
        f"{m.software.mergepipe}. Check the files with `mergepipe verify DIR`.",
        "",
        "| | |",
        "|---|---|",
        f"| snapshot | `{m.snapshot_id}` |",
        f"| manifest hash | `{m.manifest_hash}` |",
        f"| plan digest | `{m.plan_digest}` |",
        f"| operator | {m.operator.name}, seed {m.seed} |",
        f"| expert-I/O budget | {budget} |",
        f"| expert bytes | {estimated.expert_bytes:,} planned, {realized.expert_bytes:,} read |",
        f"| error bound vs the full-read merge | {bound} |",
        f"| output dtype, policy | {m.extra.get('out_dtype') or 'as the base'}, {m.extra.get('policy', '-')} |",
        "",
        "## Inputs",
        "",
        "| role | model | weight | content fingerprint |",
        "|---|---|---|---|",
        f"| base | `{m.base.id}` | | `{m.base.fingerprint[:16]}` |",
        *(f"| expert | `{e.id}` | {_weight(m, e.id, e.weight)} | `{e.fingerprint[:16]}` |" for e in m.experts),
        "",
        "## Reproduce",
        "",
        f"`{CONFIG_FILENAME}` beside this card states the merge as a mergekit-style config (the `model:` "
        "entries are catalog ids of the exact versions merged):",
        "",
        "```yaml",
        _body(merge_config_yaml(m)).rstrip(),
        "```",
        "",
        "In a catalog with these inputs registered under these ids:",
        "",
        "```bash",
        f"mergepipe merge --db CATALOG --config {CONFIG_FILENAME} --out DIR",
        "```",
        "",
    ]
    return "\n".join(lines)


def merged_models(manifest: Manifest) -> list[str]:
    """The models merged, as people know them: the base, then each expert, each name once."""
    names: dict[str, str] = manifest.extra.get("expert_names", {})
    models = [manifest.extra.get("base_name") or manifest.base.id, *(names.get(e.id, e.id) for e in manifest.experts)]
    return list(dict.fromkeys(models))


def _body(config_text: str) -> str:
    """The config without its comment header (the card says the same in prose)."""
    return "\n".join(line for line in config_text.splitlines() if not line.startswith("#"))


def _weight(m: Manifest, expert_id: str, number: float) -> str:
    """The expert's ``weight`` as the merge stated it (its own, else the global one): a number, a gradient
    or filter rules in YAML's flow style; ``number`` (the manifest's) when the merge stated none."""
    params = m.operator.params
    own: dict[str, Any] = params.get("experts", {}).get(expert_id, {})
    value = own.get("weight", params.get("global", {}).get("weight"))
    if value is None:
        return f"{number:g}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text.removesuffix("...").strip().replace("|", "\\|")  # a bar would end the table's cell
