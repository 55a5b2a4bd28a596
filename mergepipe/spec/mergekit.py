"""mergekit's YAML, read as mergekit 0.1.5 means it, and written back.

A mergekit user's config runs as it is: ``merge_method``, ``base_model``,
``models`` (each with ``parameters``), global ``parameters``, ``dtype``,
``out_dtype``, ``tokenizer_source: base``, ``chat_template``, plus a
``mergepipe:`` section for MergePipe's own choices. Where mergekit's meaning
differs from MergePipe's own form, the translation makes mergekit's explicit:

* ``rescale: true`` (mergekit's default for DARE and DELLA) is MergePipe's
  ``rescale: l1``; ``false`` is ``none``;
* ``linear`` needs no base in mergekit: without ``base_model`` the first
  model is the base, and a base listed among the models keeps its weight in
  the average: Σ wi Mi / Σ w = B + Σ (wi / Σ w) Δi runs as task arithmetic
  with those weights (which must then be numbers);
* other methods skip a ``base_model`` also listed under ``models``, as
  mergekit does;
* MergePipe computes in fp32 whatever ``dtype`` says; the output is written in
  ``out_dtype``, else ``dtype``, as mergekit writes it.

Everything MergePipe cannot do is refused by name, before any I/O.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mergepipe.errors import ConfigError
from mergepipe.spec.request import one_line, parse_shard_bytes

#: mergekit methods MergePipe runs (same names).
METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties",
           "della", "della_linear", "slerp", "model_stock")
#: mergekit 0.1.5 methods MergePipe does not have.
OTHER_METHODS = ("passthrough", "nuslerp", "multislerp", "karcher", "sce", "nearswap", "arcee_fusion", "ram")
#: Methods whose ``rescale`` mergekit turns on by default.
RESCALED = ("dare_linear", "dare_ties", "della", "della_linear")
_TOP_KEYS = ("merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "tokenizer_source",
             "tokenizer", "chat_template", "mergepipe")
_REFUSED_KEYS = {
    "slices": "`slices` (layer ranges, frankenmerges) are not supported: MergePipe merges whole models tensor by "
              "tensor; list the models under `models:`",
    "modules": "`modules` (per-module configs) are not supported; list the models under `models:`",
}
#: A chat template MergePipe knows by name: ChatML, the one most fine-tunes use.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
_NAMED_TEMPLATES = {"chatml": CHATML}


class MergepipeSection(BaseModel):
    """The ``mergepipe:`` section: MergePipe's own choices, each as the flag of the same name sets it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget: str | int | None = Field(None, description="expert-I/O budget (as --budget)")
    policy: str | None = Field(None, description="budget policy (as --policy)")
    seed: int | None = Field(None, ge=0, strict=True, description="seed of random operators (as --seed)")
    block_bytes: str | int | None = Field(None, description="block size of a new catalog (an existing one must "
                                          "match)")
    model_id: str | None = Field(None, description="id of the merged model (as --model-id)")
    out_shard_size: str | int | None = Field(None, description="largest output shard (as --out-shard-size)")

    def fields(self) -> dict[str, Any]:
        """The ``MergeRequest`` fields the section sets."""
        out = self.model_dump(exclude_none=True)
        if "out_shard_size" in out:  # a bare number here is bytes in MergePipe and billions of them in mergekit
            out["out_shard_bytes"] = parse_shard_bytes(out.pop("out_shard_size"), "mergepipe.out_shard_size")
        return out


def mergepipe_section(value: Any, source: str) -> dict[str, Any]:
    """The request fields a ``mergepipe:`` section sets; one line naming a key that is unknown or wrong."""
    if value is None:
        return {}
    known = list(MergepipeSection.model_fields)
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: `mergepipe:` must be a mapping with keys {', '.join(known)}")
    unknown = set(value) - set(known)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) in `mergepipe:`: {', '.join(sorted(map(str, unknown)))}; "
                          f"known: {', '.join(known)}")
    try:
        return MergepipeSection(**value).fields()
    except ValidationError as exc:
        raise ConfigError(f"{source}: {one_line(exc, '`mergepipe:`').replace('`mergepipe:`: ', 'mergepipe.')}"
                          ) from None


def from_mergekit(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The ``MergeRequest`` fields a mergekit config states (see the module docstring)."""
    for key, why in _REFUSED_KEYS.items():
        if key in data:
            raise ConfigError(f"{source}: {why}")
    unknown = set(data) - set(_TOP_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; a mergekit config "
                          f"has {', '.join(_TOP_KEYS[:-1])} (and MergePipe's `mergepipe:` section)")
    method = _method(data["merge_method"], source)
    notes: list[str] = []
    models = _models(data.get("models"), source)
    base = data.get("base_model")
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{source}: `base_model` must be a path or a registered model id, got {base!r}")
    params = _global_params(data.get("parameters"), method, source, notes)
    method, base, models, params = _place_base(method, base, models, params, source, notes)
    _check_tokenizer(data, source)
    section = mergepipe_section(data.get("mergepipe"), source)
    return {
        "base": base,
        "experts": tuple(ref for ref, _ in models),
        "operator": method,
        "params": params,
        "expert_params": {ref: p for ref, p in models if p},
        "out_dtype": _out_dtype(data, notes),
        "chat_template": chat_template(data.get("chat_template"), source),
        **section,
        "notes": tuple(notes),
    }


def _method(value: Any, source: str) -> str:
    method = str(value).strip().lower().replace("-", "_")
    if method in METHODS:
        return method
    if method in OTHER_METHODS:
        raise ConfigError(f"{source}: merge_method {value!r} is not supported by MergePipe; it runs "
                          f"{', '.join(METHODS)}")
    raise ConfigError(f"{source}: unknown merge_method {value!r}; MergePipe runs {', '.join(METHODS)}")


def _models(value: Any, source: str) -> list[tuple[str, dict]]:
    """``[(reference, parameters)]`` in the order given."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{source}: `models:` must be a non-empty list of {{model: PATH_OR_ID, parameters: ...}}")
    models: list[tuple[str, dict]] = []
    for entry in value:
        if not isinstance(entry, dict) or "model" not in entry or set(entry) - {"model", "parameters"}:
            raise ConfigError(f"{source}: each entry of `models:` must be {{model: PATH_OR_ID, parameters: {{...}}}}, "
                              f"got {entry!r}")
        ref = entry["model"]
        if isinstance(ref, dict) and "lora" in ref:
            raise ConfigError(f"{source}: model {ref!r} has a LoRA adapter; adapters as inputs are not supported yet "
                              "(merge the adapter into its model first)")
        if not isinstance(ref, str) or not ref:
            raise ConfigError(f"{source}: `model:` must be a path or a registered model id, got {ref!r}")
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: parameters of {ref!r} must be a mapping of parameter: value")
        if ref in (r for r, _ in models):
            raise ConfigError(f"{source}: model {ref!r} is listed twice under `models:`; list it once")
        models.append((ref, dict(params)))
    return models


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
    if "filter_wise" in params:
        if method != "model_stock" or params.pop("filter_wise") is not False:
            raise ConfigError(f"{source}: filter_wise is supported only as false, for model_stock (MergePipe "
                              "computes model stock per tensor)")
    if "rescale" in params:
        params["rescale"] = rescale_from_mergekit(params["rescale"])
    elif method in RESCALED:
        params["rescale"] = "l1"  # mergekit's default for this method
    return params


def rescale_from_mergekit(value: Any) -> Any:
    """mergekit's boolean ``rescale`` in MergePipe's terms; other values pass on to validation."""
    if value is True:
        return "l1"
    if value is False:
        return "none"
    return value


def rescale_to_mergekit(value: str) -> bool | str:
    """MergePipe's ``rescale`` as mergekit writes it (``inverse`` has no mergekit spelling)."""
    return {"l1": True, "none": False}.get(value, value)


def _place_base(method: str, base: str | None, models: list[tuple[str, dict]], params: dict[str, Any],
                source: str, notes: list[str]) -> tuple[str, str, list[tuple[str, dict]], dict[str, Any]]:
    """The method, base and experts, with mergekit's rules for a base also listed under ``models``."""
    listed = base is not None and base in (ref for ref, _ in models)
    if method == "linear":
        if base is None:
            base, listed = models[0][0], True
            notes.append(f"linear without base_model: '{base}' (the first model) is the base of the deltas; "
                         "it keeps its weight in the average")
        if listed:
            notes.append(f"linear with the base '{base}' among the averaged models runs as task_arithmetic with "
                         "weights wi / Σw (the same weighted mean)")
            return "task_arithmetic", base, *_fold_base_weight(base, models, params, source)
        return method, base, models, params
    if base is None:
        raise ConfigError(f"{source}: merge_method {method} needs a `base_model`")
    if listed:
        models = [(ref, p) for ref, p in models if ref != base]
        notes.append(f"base_model '{base}' is also listed under models: skipped there, as mergekit does")
    if not models:
        raise ConfigError(f"{source}: no model to merge into base_model '{base}'; list the experts under `models:`")
    return method, base, models, params


def _fold_base_weight(base: str, models: list[tuple[str, dict]], params: dict[str, Any],
                      source: str) -> tuple[list[tuple[str, dict]], dict[str, Any]]:
    """Linear with the base among the averaged models: Σ wi Mi / Σ w = B + Σ (wi / Σ w) Δi, which is
    task arithmetic (λ = 1, no normalisation) with weights wi / Σ w. Needs plain numbers."""
    if params.get("normalize", True) is not True:
        raise ConfigError(f"{source}: linear with normalize: false and the base among the models is not supported; "
                          "remove the base from `models:`")
    default = params.get("weight", 1.0)
    weights = {ref: p.get("weight", default) for ref, p in models}
    if not all(_is_number(w) for w in weights.values()):
        raise ConfigError(f"{source}: linear with the base '{base}' among the models needs plain-number weights "
                          "(a gradient or filter rules cannot be folded); remove the base from `models:`")
    total = math.fsum(weights.values())
    if total == 0:
        raise ConfigError(f"{source}: the linear weights sum to 0, so they cannot be normalised")
    experts = [(ref, {**p, "weight": weights[ref] / total}) for ref, p in models if ref != base]
    if not experts:
        raise ConfigError(f"{source}: linear needs at least one model besides the base '{base}'")
    folded = {k: v for k, v in params.items() if k != "weight"}
    folded["normalize"] = False
    return experts, folded


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _out_dtype(data: Mapping[str, Any], notes: list[str]) -> str | None:
    dtype, out_dtype = data.get("dtype"), data.get("out_dtype")
    if dtype is not None:
        used = "" if out_dtype is not None else f"; the output is written in {dtype}, as mergekit does"
        notes.append(f"dtype {dtype}: MergePipe computes in float32 whatever the input dtype{used}")
    return out_dtype if out_dtype is not None else dtype


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
        raise ConfigError(f"{source}: chat_template: auto is not supported; leave it out to keep the base's "
                          "template, or give chatml or the Jinja text")
    raise ConfigError(f"{source}: chat_template {value!r} is not a template MergePipe knows by name "
                      f"({', '.join(_NAMED_TEMPLATES)}); give the Jinja text instead")


def _check_tokenizer(data: Mapping[str, Any], source: str) -> None:
    """``tokenizer_source: base`` (and ``tokenizer: {source: base}``) is what MergePipe does; others are refused."""
    value = data.get("tokenizer_source")
    tokenizer = data.get("tokenizer")
    if isinstance(tokenizer, dict):
        extra = set(tokenizer) - {"source"}
        if extra:
            raise ConfigError(f"{source}: tokenizer options {', '.join(sorted(map(str, extra)))} are not supported; "
                              "MergePipe copies the base's tokenizer")
        value = tokenizer.get("source", value)
    elif tokenizer is not None:
        raise ConfigError(f"{source}: `tokenizer:` must be a mapping like {{source: base}}")
    if value is not None and value != "base":
        raise ConfigError(f"{source}: tokenizer source {value!r} is not supported; MergePipe copies the base's "
                          "tokenizer (tokenizer_source: base)")
