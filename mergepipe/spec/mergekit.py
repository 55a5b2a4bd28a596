"""A config file as ``MergeRequest`` fields: mergekit 0.1.5's YAML as mergekit means it (docs/MERGEKIT.md),
or MergePipe's own form; and the one strict YAML reader of every config and recipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping

import yaml
from pydantic import Field

from mergepipe.errors import ConfigError
from mergepipe.spec.copy_map import ALL_LAYERS, PASSTHROUGH, LayerSlice
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.request import MergeRequest, StrictModel, parse_out_dtype, parse_shard_bytes
from mergepipe.spec.settings import rules

#: mergekit methods MergePipe runs (same names).
METHODS = (*(name for name, op in OPERATORS.items() if op.mergekit), PASSTHROUGH)
#: mergekit 0.1.5's other methods, refused as not supported yet (never as unknown): with ``METHODS``, every
#: name mergekit's registry has (tests/cli/test_mergekit_suite.py compares them when mergekit is installed).
OTHER_METHODS: tuple[str, ...] = ()
#: Methods that take no ``weight``: mergekit ignores one given to them (per model or globally), so it is dropped
#: with a note.
WEIGHTLESS = tuple(name for name, op in OPERATORS.items() if op.mergekit and "weight" not in op.expert_params.names())
#: Methods that run on the models themselves where mergekit has no ``base_model`` (nuslerp, multislerp) or
#: always (karcher): MergePipe's base is then one of the interpolated points (``_spherical_models``).
SPHERICAL = tuple(name for name, op in OPERATORS.items() if op.mergekit_points)
#: Methods whose ``rescale`` mergekit turns on by default.
RESCALED = tuple(name for name, op in OPERATORS.items() if "rescale" in op.global_params.names())
_TOP_KEYS = (
    "merge_method",
    "base_model",
    "models",
    "slices",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
    "tokenizer",
    "chat_template",
    "mergepipe",
)
#: What a slice may hold (mergekit's ``OutputSliceDefinition``) and a slice's source (``InputSliceDefinition``).
_SLICE_KEYS = ("sources", "parameters", "base_model", "residual_weight")
_SOURCE_KEYS = ("model", "layer_range", "parameters")
#: The one refusal of every slice layout that is not a merge of whole models.
FRANKENMERGE = "slices that stack or cut layers (a frankenmerge) are not supported yet"
#: A chat template MergePipe knows by name: ChatML, the one most fine-tunes use.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
_NAMED_TEMPLATES = {"chatml": CHATML}


class MergepipeSection(StrictModel):
    """The ``mergepipe:`` section: MergePipe's own choices, each as the flag of the same name sets it."""

    what: ClassVar[str] = "mergepipe"

    budget: str | int | None = None
    policy: str | None = None
    seed: int | None = Field(None, ge=0, strict=True)
    block_bytes: str | int | None = None
    model_id: str | None = None
    out_shard_size: str | int | None = None
    #: base: each tensor keeps the base's dtype, whatever the config's dtype and out_dtype.
    out_dtype: Literal["base"] | None = None


def mergepipe_section(value: Any, source: str) -> dict[str, Any]:
    """The request fields a ``mergepipe:`` section sets (``out_dtype: base``: None, the base's)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{source}: `mergepipe:` must be a mapping with keys {', '.join(MergepipeSection.model_fields)}"
        )
    try:
        out = MergepipeSection(**value).model_dump(exclude_none=True)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if "out_shard_size" in out:  # a bare number here is bytes in MergePipe and billions of them in mergekit
        out["out_shard_bytes"] = parse_shard_bytes(out.pop("out_shard_size"), "mergepipe.out_shard_size")
    if out.pop("out_dtype", None) == "base":
        out["out_dtype"] = None
    return out


def from_mergekit(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The ``MergeRequest`` fields a mergekit config states."""
    if "modules" in data:
        raise ConfigError(
            f"{source}: `modules` (per-module configs) are not supported; list the models under `models:`"
        )
    unknown = set(data) - set(_TOP_KEYS)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; a mergekit config "
            f"has {', '.join(_TOP_KEYS[:-1])} (and MergePipe's `mergepipe:` section)"
        )
    method = _method(data["merge_method"], source)
    base = data.get("base_model")
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{source}: `base_model` must be a path or a registered model id, got {base!r}")
    if "slices" in data and "models" in data:
        raise ConfigError(f"{source}: give either `models:` or `slices:`, not both (as mergekit requires)")
    notes: list[str] = []
    fields = (
        _passthrough(data, base, source, notes) if method == PASSTHROUGH else _merge(data, method, base, source, notes)
    )
    _check_tokenizer(data, source)
    section = mergepipe_section(data.get("mergepipe"), source)
    # a copy computes nothing: its ``dtype`` is only the output's (no note that MergePipe computes in fp32)
    dtype_notes = [] if method == PASSTHROUGH else notes
    return {
        **fields,
        "out_dtype": _out_dtype(data, "out_dtype" in section, source, dtype_notes),
        "chat_template": chat_template(data.get("chat_template"), source),
        **section,
        "notes": tuple(notes),
    }


def _merge(data: Mapping[str, Any], method: str, base: str | None, source: str, notes: list[str]) -> dict[str, Any]:
    params = data.get("parameters")
    slice_layers = None
    if "slices" in data:
        entries, base, params, slice_layers = _whole_slice(data["slices"], base, params, method, source)
        models = _models(entries, source, "the slice's `sources:`")
    else:
        models = _models(data.get("models"), source)
    params = _global_params(params, method, source, notes)
    models = _without_ignored_weights(method, models, params, notes)
    if method == "linear":  # mergekit adds a base_model not listed to `models:`, never to a slice's sources
        base, models, params = _linear_models(base, models, params, slice_layers is None, source, notes)
    else:
        base, models, params = _place_base(method, base, models, params, source, notes)
    return {
        "base": base,
        "experts": tuple(ref for ref, _ in models),
        "operator": method,
        "params": params,
        "expert_params": {ref: p for ref, p in models if p},
        "slice_layers": slice_layers,
    }


def _slices(value: Any, shape: str, source: str) -> list[dict[str, Any]]:
    """``slices:`` as a non-empty list of slices, each of sources ``{model, layer_range[, parameters]}``."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{source}: {shape}")
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("sources"), list) or not entry["sources"]:
            raise ConfigError(f"{source}: {shape}")
        _no_other_keys(entry, _SLICE_KEYS, "a slice", source)
        for item in entry["sources"]:
            if not isinstance(item, dict) or "model" not in item or "layer_range" not in item:
                raise ConfigError(f"{source}: {shape}, got {item!r}")
            _no_other_keys(item, _SOURCE_KEYS, "a slice's source", source)
    return value


def _passthrough(data: Mapping[str, Any], base: str | None, source: str, notes: list[str]) -> dict[str, Any]:
    """mergekit's ``passthrough``: ``slices:`` of one source each, stacked (``models:`` of one: a copy); its base
    is ``base_model``, else the first slice's model."""
    shape = "`slices:` must be a list of {sources: [{model: PATH_OR_ID, layer_range: [FIRST, END]}]}"
    if "slices" not in data and "models" in data:  # mergekit's plain copy of one model
        models = _models(data["models"], source)
        if len(models) != 1 or models[0][1]:
            raise ConfigError(
                f"{source}: passthrough with `models:` copies one model as it is: give one model "
                "without parameters (as mergekit requires), or `slices:` to stack layers"
            )
        data = {**data, "slices": [{"sources": [{"model": models[0][0], "layer_range": [0, ALL_LAYERS]}]}]}
    if "slices" not in data:
        raise ConfigError(f"{source}: passthrough stacks layers: give {shape}, or `models:` with one model to copy it")
    if data.get("parameters"):
        raise ConfigError(
            f"{source}: passthrough copies tensors as they are: `parameters:` (mergekit's scale) are not supported yet"
        )
    slices = []
    for number, entry in enumerate(_slices(data["slices"], shape, source), 1):
        if len(entry["sources"]) != 1:
            raise ConfigError(
                f"{source}: slice {number} has {len(entry['sources'])} sources; passthrough takes one "
                "per slice (as mergekit requires)"
            )
        (item,) = entry["sources"]
        extra = [k for k in ("parameters", "base_model", "residual_weight") if entry.get(k) or item.get(k)]
        if extra:
            raise ConfigError(
                f"{source}: slice {number}: {extra[0]} with passthrough (mergekit's scale) is not supported yet"
            )
        model = item["model"]
        if not isinstance(model, str) or not model or "+" in model:
            raise ConfigError(
                f"{source}: slice {number}: passthrough copies the layers of models: `model:` must be "
                f"a path or a registered model id (merge an adapter into its model first), got {model!r}"
            )
        slices.append(LayerSlice(model, *_layer_range(item["layer_range"], source)))
    if base is None:
        base = slices[0].model
        if len({s.model for s in slices}) > 1:  # several models: say whose files are kept
            notes.append(
                f"passthrough without base_model: config.json and the tokenizer are the first slice's "
                f"model's, '{base}' (mergekit takes them from one of the models)"
            )
    experts = tuple(dict.fromkeys(s.model for s in slices if s.model != base))
    return {"base": base, "experts": experts, "operator": PASSTHROUGH, "slices": tuple(slices)}


def _whole_slice(
    value: Any, base: str | None, params: Any, method: str, source: str
) -> tuple[list[dict[str, Any]], str | None, Any, int]:
    """One slice whose sources all cover ``[0, N]`` as ``(models: entries, base, parameters, N)``."""
    shape = "`slices:` must be a list of {sources: [{model: PATH_OR_ID, layer_range: [0, N]}, ...]}"
    if isinstance(value, list) and len(value) > 1:
        raise ConfigError(
            f"{source}: {len(value)} slices: {FRANKENMERGE}; one slice whose sources all cover every "
            "layer ([0, N]) merges whole models"
        )
    (entry,) = _slices(value, shape, source)
    if entry.get("residual_weight") is not None:
        raise ConfigError(f"{source}: a slice's residual_weight is not supported; leave it out")
    sources = entry["sources"]
    ranges = [_layer_range(item["layer_range"], source) for item in sources]
    if len(set(ranges)) > 1 or ranges[0][0] != 0:
        shown = ", ".join(f"[{a}, {b}]" for a, b in ranges)
        raise ConfigError(
            f"{source}: layer ranges {shown}: {FRANKENMERGE}; every source must cover every layer, [0, N]"
        )
    own = entry.get("base_model")  # a slice's own base_model (mergekit reads it first) must be the config's
    if own is not None and not isinstance(own, str):
        raise ConfigError(f"{source}: a slice's `base_model` must be a path or a registered model id, got {own!r}")
    if own is not None and base is not None and own != base:
        raise ConfigError(
            f"{source}: the slice's base_model '{own}' is not the config's base_model '{base}'; give one base"
        )
    base = base if own is None else own
    models = [ref for item in sources if isinstance(ref := item["model"], str)]
    if method != "linear" and base is not None and base not in models:
        raise ConfigError(
            f"{source}: base_model '{base}' is not among the slice's sources; mergekit needs it there "
            f"(add it with layer_range [0, {ranges[0][1]}])"
        )
    over = entry.get("parameters")
    if over is not None:
        if not isinstance(over, dict) or (params is not None and not isinstance(params, dict)):
            raise ConfigError(f"{source}: `parameters:` must be a mapping of parameter: value")
        params = {**(params or {}), **over}  # mergekit reads a slice's parameters before the global ones
    entries = [
        {"model": item["model"], **({"parameters": item["parameters"]} if "parameters" in item else {})}
        for item in sources
    ]
    return entries, base, params, ranges[0][1]


def _no_other_keys(entry: Mapping[str, Any], known: tuple[str, ...], what: str, source: str) -> None:
    unknown = set(entry) - set(known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) in {what}: {', '.join(sorted(map(str, unknown)))}; known: {', '.join(known)}"
        )


def _layer_range(value: Any, source: str) -> tuple[int, int]:
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] < value[1]
    )
    if not ok:
        raise ConfigError(f"{source}: layer_range must be [FIRST, END] with 0 <= FIRST < END, got {value!r}")
    return int(value[0]), int(value[1])


def _method(value: Any, source: str) -> str:
    method = str(value).strip().lower().replace("-", "_")
    if method in METHODS:
        return method
    if method in OTHER_METHODS:
        raise ConfigError(
            f"{source}: merge_method {value!r} (mergekit's) is not supported yet; MergePipe runs {', '.join(METHODS)}"
        )
    raise ConfigError(
        f"{source}: unknown merge_method {value!r}: neither mergekit 0.1.5 nor MergePipe has it; "
        f"MergePipe runs {', '.join(METHODS)}"
    )


def _models(value: Any, source: str, where: str = "`models:`") -> list[tuple[str, dict]]:
    """``[(reference, parameters)]`` in order (a model with an adapter as mergekit's ``X+ADAPTER``)."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{source}: `models:` must be a non-empty list of {{model: PATH_OR_ID, parameters: ...}}")
    models: list[tuple[str, dict]] = []
    for entry in value:
        if not isinstance(entry, dict) or "model" not in entry or set(entry) - {"model", "parameters"}:
            raise ConfigError(
                f"{source}: each entry of {where} must be {{model: PATH_OR_ID, parameters: {{...}}}}, got {entry!r}"
            )
        ref = _with_adapter(entry["model"], source) if isinstance(entry["model"], dict) else entry["model"]
        if not isinstance(ref, str) or not ref:
            raise ConfigError(f"{source}: `model:` must be a path or a registered model id, got {ref!r}")
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: parameters of {ref!r} must be a mapping of parameter: value")
        if ref in (r for r, _ in models):
            raise ConfigError(f"{source}: model {ref!r} is listed twice in {where}; list it once")
        models.append((ref, dict(params)))
    return models


def _with_adapter(value: Mapping[str, Any], source: str) -> str:
    """mergekit's ``{model: X, lora: ADAPTER}`` (each a path or ``{path: ...}``) as ``X+ADAPTER``."""
    parts = [value.get(key) for key in ("model", "lora")]
    parts = [p.get("path") if isinstance(p, dict) and set(p) == {"path"} else p for p in parts]
    if set(value) != {"model", "lora"} or not all(isinstance(p, str) and p and "+" not in p for p in parts):
        raise ConfigError(
            f"{source}: `model:` must be a path, a registered model id or {{model: PATH, lora: "
            f"ADAPTER_PATH}}, got {dict(value)!r}"
        )
    return f"{parts[0]}+{parts[1]}"


def _global_params(value: Any, method: str, source: str, notes: list[str]) -> dict[str, Any]:
    """Global parameters in MergePipe's terms (``rescale`` spelled out, ``int8_mask`` dropped)."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: `parameters:` must be a mapping of parameter: value")
    params = dict(value)
    if "int8_mask" in params:
        params.pop("int8_mask")
        notes.append("int8_mask ignored: MergePipe keeps masks as booleans (it only saves memory in mergekit)")
    if "rescale" in params:  # mergekit's booleans; other values pass on to validation
        given = params["rescale"]
        params["rescale"] = "l1" if given is True else "none" if given is False else given
    elif method in RESCALED:
        params["rescale"] = "l1"  # mergekit's default for this method
    return params


def _without_ignored_weights(
    method: str, models: list[tuple[str, dict]], params: dict[str, Any], notes: list[str]
) -> list[tuple[str, dict]]:
    """The models without the weights mergekit ignores for a ``WEIGHTLESS`` method (``params``: in place)."""
    if method not in WEIGHTLESS or not ("weight" in params or any("weight" in p for _, p in models)):
        return models
    params.pop("weight", None)
    notes.append(f"weight ignored: {method} takes no weight (mergekit ignores it too, so the result is the same)")
    return [(ref, {k: v for k, v in p.items() if k != "weight"}) for ref, p in models]


def rescale_to_mergekit(value: str) -> bool | str:
    """MergePipe's ``rescale`` as mergekit writes it (``inverse`` has no mergekit spelling)."""
    return {"l1": True, "none": False}.get(value, value)


def _place_base(
    method: str, base: str | None, models: list[tuple[str, dict]], params: dict[str, Any], source: str, notes: list[str]
) -> tuple[str, list[tuple[str, dict]], dict[str, Any]]:
    """``(base, experts, params)`` by mergekit's rules for a base also listed under ``models`` (not linear)."""
    listed = base is not None and base in (ref for ref, _ in models)
    if method in SPHERICAL:
        return _spherical_models(method, base, models, params, source, notes)
    if base is None:
        raise ConfigError(f"{source}: merge_method {method} needs a `base_model`")
    if listed:
        models = [(ref, p) for ref, p in models if ref != base]
        notes.append(f"base_model '{base}' is also listed among the models: skipped there, as mergekit does")
    if not models:
        raise ConfigError(f"{source}: no model to merge into base_model '{base}'; list the experts under `models:`")
    return base, models, params


def _linear_models(
    base: str | None,
    models: list[tuple[str, dict]],
    params: dict[str, Any],
    models_form: bool,
    source: str,
    notes: list[str],
) -> tuple[str, list[tuple[str, dict]], dict[str, Any]]:
    """``(base, experts, params)`` of mergekit's ``linear``, which averages its inputs, the base among them
    (weight as ``base_weight``) when listed or, under ``models:``, not listed; else the first model is the base."""
    named = base is not None
    if base is None:
        base = models[0][0]
    elif base not in (ref for ref, _ in models):
        if "base_weight" in params or not models_form:  # 0, the default, is left out: the spec MergePipe writes
            return (
                base,
                models,
                {k: v for k, v in params.items() if k != "base_weight" or type(v) not in (int, float) or v != 0},
            )
        notes.append(
            f"linear: base_model '{base}', not listed under `models:`, is averaged with them as mergekit "
            "does (it adds the base there), with the global weight (else 1)"
        )
        return base, models, {**params, "base_weight": _first_setting(params.get("weight"), 1.0)}
    own = dict(models)[base]
    which = f"base_model '{base}'" if named else f"the first model '{base}'"
    other = sorted(set(own) - {"weight"})
    if other:
        raise ConfigError(
            f"{source}: linear does not take parameter {other[0]!r} ({which}); a model of a linear merge takes: weight"
        )
    if "base_weight" in params:
        raise ConfigError(
            f"{source}: base_weight and the weight of {which} both give its weight in the average; "
            "give it under `models:` only"
        )
    experts = [(ref, p) for ref, p in models if ref != base]
    if not experts:
        alone = f"base_model '{base}' is the only model listed" if named else "only one model is listed"
        raise ConfigError(f"{source}: {alone}; linear averages two models or more (list the others under `models:`)")
    notes.append(
        f"linear: {which} is averaged with its weight (base_weight), the other models as its deltas: "
        "the same weighted mean"
    )
    weight = _first_setting(own.get("weight"), params.get("weight"), 1.0)
    return base, experts, {**params, "base_weight": weight}


def _first_setting(*settings: Any) -> Any:
    """One setting giving each tensor the value of the first of ``settings`` (None: not given) that gives it
    one: filter rules that may match no tensor are followed by the next setting's."""
    found: list[Any] = []
    for setting in settings:
        if setting is None:
            continue
        more = rules(setting)
        if more is None:
            return [*found, {"value": setting}] if found else setting
        found.extend(more)
        if any(r.get("filter") in (None, "*") for r in found):
            return found
    return found


def _spherical_models(
    method: str, base: str | None, models: list[tuple[str, dict]], params: dict[str, Any], source: str, notes: list[str]
) -> tuple[str, list[tuple[str, dict]], dict[str, Any]]:
    """``(base, experts, params)`` of nuslerp and multislerp (without a ``base_model``: the models themselves,
    the first the base) and karcher (always the models, the base among them)."""
    listed = base is not None and base in (ref for ref, _ in models)
    if method == "karcher":
        if base is None:
            base = models[0][0]
            notes.append(
                f"karcher without base_model: the first model, '{base}', is MergePipe's base, one of the "
                "averaged models"
            )
        else:
            notes.append(f"karcher averages base_model '{base}' with the other models, as mergekit does")
        own = dict(models).get(base, {})
        if own:
            raise ConfigError(
                f"{source}: karcher does not take parameter {sorted(own)[0]!r} (model '{base}'); it "
                "takes: max_iter, tol"
            )
    elif base is not None:
        if listed:
            notes.append(f"base_model '{base}' is also listed among the models: skipped there, as mergekit does")
        others = len(models) - listed
        if method == "nuslerp" and params.get("task_vectors", True) is not False and others != 2:
            raise ConfigError(
                f"{source}: nuslerp with a base_model interpolates the task vectors of exactly two "
                f"other models, got {others}"
            )
    else:
        base, own = models[0]
        if method == "nuslerp" and len(models) != 2:
            raise ConfigError(
                f"{source}: nuslerp without base_model interpolates exactly two models, got {len(models)}"
            )
        other = sorted(set(own) - {"weight"})
        if other:
            raise ConfigError(
                f"{source}: {method} does not take parameter {other[0]!r} (the first model, '{base}'); "
                "a model takes: weight"
            )
        if "task_vectors" in params or "base_weight" in params:
            raise ConfigError(
                f"{source}: without base_model, {method} interpolates the models themselves; leave out "
                "task_vectors and base_weight (the first model's weight is the base's)"
            )
        weight = _first_setting(own.get("weight"), params.get("weight"))
        params = {**params, "task_vectors": False, **({"base_weight": weight} if weight != [] else {})}
        notes.append(
            f"{method} without base_model: the first model, '{base}', is MergePipe's base, one of the "
            "interpolated models with its weight (base_weight, task_vectors: false)"
        )
    experts = [(ref, p) for ref, p in models if ref != base]
    if not experts:
        raise ConfigError(f"{source}: {method} merges two models or more; list the others under `models:`")
    return base, experts, params


def _out_dtype(data: Mapping[str, Any], keeps_base: bool, source: str, notes: list[str]) -> str | None:
    """``out_dtype``, else ``dtype`` (as mergekit writes); None (the base's) with ``mergepipe.out_dtype: base``."""
    dtype, out_dtype = data.get("dtype"), data.get("out_dtype")
    if keeps_base and out_dtype is not None:
        raise ConfigError(
            f"{source}: out_dtype {out_dtype} and mergepipe.out_dtype: base contradict each other; keep one"
        )
    written = None if keeps_base else out_dtype if out_dtype is not None else dtype
    if dtype is not None and parse_out_dtype(dtype) != "F32":
        used = "" if out_dtype is not None or keeps_base else f"; the output is written in {dtype}, as mergekit does"
        notes.append(
            f"dtype {dtype}: MergePipe computes in float32 whatever the input dtype (mergekit computes in "
            f"{dtype}, so some elements differ; see docs/MERGEKIT.md){used}"
        )
    return written


def chat_template(value: Any, source: str) -> str | None:
    """The Jinja text of a ``chat_template`` setting (None: the base's stays)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}: chat_template must be a template name or Jinja text, got {value!r}")
    if "{{" in value or "{%" in value:
        return value
    name = value.strip().lower()
    if name in _NAMED_TEMPLATES:
        return _NAMED_TEMPLATES[name]
    if name == "auto":
        raise ConfigError(
            f"{source}: chat_template: auto is not supported; leave it out to keep the base's "
            "template, or give chatml or the Jinja text"
        )
    raise ConfigError(
        f"{source}: chat_template {value!r} is not a template MergePipe knows by name "
        f"({', '.join(_NAMED_TEMPLATES)}); give the Jinja text instead"
    )


def _check_tokenizer(data: Mapping[str, Any], source: str) -> None:
    """``tokenizer_source: base`` (and ``tokenizer: {source: base}``) is what MergePipe does; others are refused."""
    value = data.get("tokenizer_source")
    tokenizer = data.get("tokenizer")
    if isinstance(tokenizer, dict):
        extra = set(tokenizer) - {"source"}
        if extra:
            raise ConfigError(
                f"{source}: tokenizer options {', '.join(sorted(map(str, extra)))} are not supported; "
                "MergePipe copies the base's tokenizer"
            )
        value = tokenizer.get("source", value)
    elif tokenizer is not None:
        raise ConfigError(f"{source}: `tokenizer:` must be a mapping like {{source: base}}")
    if value is not None and value != "base":
        raise ConfigError(
            f"{source}: tokenizer source {value!r} is not supported; MergePipe copies the base's "
            "tokenizer (tokenizer_source: base)"
        )


#: Levels of nesting a config may have: mergekit's deepest (slices, sources, parameters, filter rules) is 6.
MAX_DEPTH = 64
#: Values a config may hold, aliases counted at each use: far above any merge's, far below a stall.
MAX_VALUES = 100_000
#: The request fields the models and method flags set, which a mergekit config sets itself.
_MODEL_FLAGS = {"base": "--base", "experts": "--experts", "operator": "--operator", "weights": "--weights"}


@dataclass(frozen=True)
class ConfigFile:
    """The ``MergeRequest`` fields a config file sets (references and settings as written)."""

    form: str  # "mergepipe" or "mergekit"
    source: str
    fields: Mapping[str, Any]


def load_config(content: bytes | str, source: str) -> ConfigFile:
    """Parse a config file's ``content`` (its bytes, or text already decoded; ``source`` names it in errors)."""
    data = yaml_document(content, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    if "merge_method" in data:
        return ConfigFile("mergekit", source, from_mergekit(data, source))
    return ConfigFile("mergepipe", source, _own_form(data, source))


def merge_request(flags: Mapping[str, Any], config: ConfigFile | None = None) -> MergeRequest:
    """The request the flags (field -> value; None: not given) lay over the config file (``params`` updated)."""
    given = {k: v for k, v in flags.items() if v is not None and v != () and v != {}}
    fields = dict(config.fields) if config is not None else {}
    if config is not None and config.form == "mergekit":
        clash = [flag for key, flag in _MODEL_FLAGS.items() if key in given]
        if clash:
            raise ConfigError(
                f"{config.source} is a mergekit config: it names the models and the method; drop {', '.join(clash)}"
            )
    elif "base" not in given or "experts" not in given:
        raise ConfigError("give --base and --experts (or a mergekit config with --config)")
    params = {**fields.get("params", {}), **given.pop("params", {})}
    return MergeRequest(**{**fields, **given, "params": params})


def _own_form(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """MergePipe's ``params``/``expert_params`` form."""
    unknown = set(data) - {"params", "expert_params"}
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; expected `params` and/or "
            "`expert_params`, or a mergekit config with `merge_method`"
        )
    params = data.get("params") or {}
    experts = data.get("expert_params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: `params` must be a mapping of parameter: value")
    if not isinstance(experts, dict) or not all(isinstance(v, dict) for v in experts.values()):
        raise ConfigError(f"{source}: `expert_params` must map each expert id to a mapping of parameter: value")
    return {"params": dict(params), "expert_params": {str(k): dict(v) for k, v in experts.items()}}


def yaml_document(content: bytes | str, source: str) -> Any:
    """The one YAML document in ``content`` (a file's bytes, read as strict UTF-8), within ``MAX_DEPTH`` and
    ``MAX_VALUES``; anything else is a one-line ``ConfigError`` naming ``source``."""
    text = content
    if isinstance(content, bytes):
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = content.count(b"\n", 0, exc.start) + 1
            raise ConfigError(
                f"{source}: not UTF-8 text (line {line} has the byte {content[exc.start]:#04x}); save it as UTF-8"
            ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({_first_line(exc)})") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to read (a config is a few levels deep)") from None
    except (ValueError, OverflowError) as exc:  # int(): more than 4300 digits; a date out of range
        raise ConfigError(f"{source}: a value cannot be read ({_first_line(exc).split(';')[0]})") from None
    values, _ = _measure(data, 0, {}, source)
    if values > MAX_VALUES:
        raise ConfigError(
            f"{source}: holds {values} values once its aliases are expanded, more than "
            f"{MAX_VALUES}; a merge config is far smaller"
        )
    return data


def _measure(node: Any, above: int, seen: dict[int, tuple[int, int]], source: str) -> tuple[int, int]:
    """(values, levels) of ``node`` nested ``above`` deep, each alias counted at every use; past ``MAX_DEPTH``
    refused without recursing further. ``seen``: each container's result (a shared one is walked once)."""
    if not isinstance(node, (dict, list)):
        return 1, 0
    known = seen.get(id(node))
    if known is None:
        if above + 1 > MAX_DEPTH:
            raise _too_deep(source)
        values, levels = 1, 0
        for child in [*node.keys(), *node.values()] if isinstance(node, dict) else node:
            child_values, child_levels = _measure(child, above + 1, seen, source)
            values, levels = values + child_values, max(levels, child_levels)
        known = seen[id(node)] = (values, levels + 1)
    if above + known[1] > MAX_DEPTH:
        raise _too_deep(source)
    return known


def _too_deep(source: str) -> ConfigError:
    return ConfigError(
        f"{source}: nested more than {MAX_DEPTH} levels deep (or a YAML alias inside its own "
        "anchor); a merge config is a few levels deep"
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__
