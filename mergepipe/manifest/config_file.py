"""``mergepipe_config.yml``: a snapshot's merge as a mergekit-style config, to read or rerun.

Like the model card it is a pure function of the manifest, kept out of the
hashed file list and checked by ``verify`` by writing it again. It is
mergekit's layout (``merge_method``, ``base_model``, ``models`` with
``parameters``, global ``parameters``, ``dtype``, ``out_dtype``) plus the
``mergepipe:`` section, and ``mergepipe merge --config`` reads it back to the
same plan: in the catalog that made it, the same snapshot. ``model:``
entries are the catalog ids of the exact versions merged; mergekit itself
needs paths there.

Settings are written as the merge stated them, the budget as it was written
(``60%``: the plan's digest holds the text), with two exceptions:
MergePipe's default ``rescale`` (``inverse``) is not mergekit's (``true``,
meaning ``l1``), so operators that rescale always get it written out; and
``dtype`` is ``float32``, the dtype MergePipe computes in whatever the
inputs' (mergekit computes in ``dtype``, so a config saying ``bfloat16``
would make it compute something else). The output's dtype is ``out_dtype``;
a merge that kept each tensor's base dtype says ``out_dtype: base`` in the
``mergepipe:`` section instead, which mergekit cannot say (it writes
float32 there).
"""

from __future__ import annotations

from typing import Any

import yaml

from mergepipe.manifest.manifest import Manifest
from mergepipe.spec.mergekit import rescale_to_mergekit
from mergepipe.spec.operators import get_operator
from mergepipe.spec.refs import VERSIONED
from mergepipe.storage.checkpoint import MERGE_CONFIG_FILENAME

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
    models = [{"model": pinned(e.id), **({"parameters": dict(experts[e.id])} if experts.get(e.id) else {})}
              for e in m.experts]
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
        models.insert(0, {"model": pinned(m.base.id), **({"parameters": {"weight": weight}} if weight is not None
                                                           else {})})
    config: dict[str, Any] = {"merge_method": method, **({} if baseless else {"base_model": pinned(m.base.id)}),
                              "models": models}
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
        header.append("# mergepipe.out_dtype: base kept each tensor's dtype (mergekit writes float32 without "
                      "out_dtype).")
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
    return [{"sources": [{"model": pinned(s["model"]), "layer_range": list(s["layer_range"])}]}
            for s in m.extra["passthrough"]["slices"]]


def _method_and_params(m: Manifest) -> tuple[str, dict[str, Any]]:
    params = dict(m.operator.params.get("global", {}))
    if "passthrough" in m.extra:  # no operator: tensors copied as they are
        return m.operator.name, params
    if m.operator.name == "avg":
        return "linear", params
    names = {d.name: d.default for d in get_operator(m.operator.name).global_params.definitions()}
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
    for unit, factor in (("GB", 10**9), ("GiB", 1 << 30), ("MB", 10**6), ("MiB", 1 << 20), ("KB", 1000),
                         ("KiB", 1024)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"
