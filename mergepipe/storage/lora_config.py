"""A PEFT LoRA adapter's ``adapter_config.json``: read it, refuse what we cannot merge exactly.

What we read: ``peft_type`` (``LORA`` only), ``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ``exclude_modules``, ``fan_in_fan_out``,
``modules_to_save``, ``rank_pattern``, ``alpha_pattern``,
``layers_to_transform`` and ``layers_pattern``. Fields this module does not
name are ignored, as PEFT ignores fields it does not know.

Which modules a name rule selects follows PEFT 0.21 exactly (its
``check_target_module_exists`` and ``get_pattern_key``), because a module the
config does not select is one PEFT's loader ignores, and a module whose rank
or alpha we resolve differently would get another scale:

- ``target_modules`` as a string is a regular expression that must match the
  whole module path; as a list, a module is selected when its path equals an
  entry or ends with ``"." + entry``, and then ``layers_to_transform`` (an int
  or a list) restricts it to layers whose index is the first all-digit path
  segment after ``layers_pattern.`` (any segment when no pattern is given).
- ``exclude_modules`` (string: whole-path regex; list: equal or suffix) and
  ``modules_to_save`` (a segment-aligned regex) modules never get LoRA.
- ``rank_pattern`` / ``alpha_pattern``: the first key, in the file's order,
  that as a regex matches a dot-aligned suffix of the module path gives the
  module's rank / alpha; else ``r`` / ``lora_alpha``.
- The scale is ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``.

Every pattern is compiled when the config is read, and matched by RE2 in time
linear in the module path (``lora_patterns.py``): an invalid one is refused
by its field's name, and none can stall ``register``.

Refused, each by name, with what to do (all ``CheckpointError``; a config
that is not a JSON object of the right types is ``CorruptCheckpointError``):
another ``peft_type``; DoRA (``use_dora``) and every other LoRA variant
whose merged weight is not ``W + s·B·A`` (VeLoRA, aLoRA, MonteCLoRA,
BD-LoRA, Arrow, KaSA, QA-LoRA, MiCA init); initialisations that change the
base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA: the adapter is relative
to a residual base we do not have); ``lora_bias`` and trained biases
(``bias`` other than ``none``); ``target_parameters``,
``trainable_token_indices`` and ``layer_replication``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.lora_patterns import ANY_LAYER, KEY, LAYERS, SAVED, PeftRegex, peft_regex

ADAPTER_CONFIG_FILE = "adapter_config.json"
# PEFT's shorthand that its own loader expands from the live model's layer types.
ALL_LINEAR = "all-linear"

# What to do with an adapter we cannot read: PEFT can always merge it for us.
MERGE_FIRST = "merge it into its base with peft's merge_and_unload() and register the result as a full checkpoint"
_FIX = "re-save it with peft's save_pretrained"

# Truthy values of these fields make a LoRA variant whose merged weight is not W + s·B·A.
_VARIANT_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "velora_config": "VeLoRA (velora_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens), which cannot be merged",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
}
# init_lora_weights values whose adapter is relative to modified base weights, or a variant.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "mica")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` that decide ΔW, validated.

    Patterns keep the file's order (the first matching key wins). ``sha256``
    hashes the file's bytes as stored, for manifests.
    """

    path: Path
    r: int
    lora_alpha: float
    use_rslora: bool
    fan_in_fan_out: bool
    target_modules: PeftRegex | tuple[str, ...] | None
    exclude_modules: PeftRegex | tuple[str, ...] | None
    modules_to_save: tuple[PeftRegex, ...]
    rank_pattern: tuple[tuple[PeftRegex, int], ...]
    alpha_pattern: tuple[tuple[PeftRegex, float], ...]
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[PeftRegex, ...]
    sha256: str

    def rank_of(self, module: str) -> int:
        """The module's rank: its ``rank_pattern`` entry, else ``r``."""
        return _pattern_value(self.rank_pattern, module, self.r)

    def alpha_of(self, module: str) -> float:
        """The module's alpha: its ``alpha_pattern`` entry, else ``lora_alpha``."""
        return _pattern_value(self.alpha_pattern, module, self.lora_alpha)

    def scale_of(self, module: str) -> float:
        """s = alpha/r, or alpha/sqrt(r) with rsLoRA, as a Python float like PEFT's ``scaling``."""
        r = self.rank_of(module)
        return self.alpha_of(module) / (math.sqrt(r) if self.use_rslora else r)

    def saves(self, module: str) -> bool:
        """Is ``module`` (a path without ``.weight``) one of ``modules_to_save``?"""
        return any(saved.match(module) for saved in self.modules_to_save)

    def targets(self, module: str) -> bool:
        """Does this config put LoRA on ``module``? (PEFT's rule; see the module docstring.)

        ``None`` or ``all-linear`` cannot be checked from names (PEFT resolves
        them from the live model's types), so every module passes.
        """
        if _listed(self.exclude_modules, module) or self.saves(module):
            return False
        chosen = self.target_modules
        if chosen is None or (isinstance(chosen, PeftRegex) and chosen.source.lower() == ALL_LINEAR):
            return True
        if isinstance(chosen, PeftRegex):
            return chosen.match(module) is not None
        if module in chosen:
            return True
        if not any(module.endswith(f".{name}") for name in chosen):
            return False
        wanted = self.layers_to_transform
        if wanted is None or wanted == ():
            return True
        index = _layer_index(module, self.layers_pattern)
        if index is None:
            return False
        return index == wanted if isinstance(wanted, int) else index in wanted


def _pattern_value(pattern: tuple[tuple[PeftRegex, Any], ...], module: str, default: Any) -> Any:
    for key, value in pattern:
        if key.match(module):
            return value
    # PEFT falls back to a lookup of the module path itself.
    return {key.source: value for key, value in pattern}.get(module, default)


def _listed(names: PeftRegex | tuple[str, ...] | None, module: str) -> bool:
    if not names:
        return False
    if isinstance(names, PeftRegex):
        return names.match(module) is not None
    return module in names or any(module.endswith(f".{name}") for name in names)


def _layer_index(module: str, layers_pattern: tuple[PeftRegex, ...]) -> int | None:
    """The first numbered path segment (after one of ``layers_pattern``, when given)."""
    if not layers_pattern:
        found = ANY_LAYER.match(module)
    else:
        found = None
        for pattern in layers_pattern:
            found = pattern.match(module)
            if found is not None:
                break
    index = found.groupdict().get("idx") if found else None
    return int(index) if index is not None else None


def read_adapter_config(root: Path) -> AdapterConfig:
    """Read and check ``root/adapter_config.json`` (see the module docstring for what is refused)."""
    path = root / ADAPTER_CONFIG_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{root} has no {ADAPTER_CONFIG_FILE}; give the folder written by peft's save_pretrained"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptCheckpointError(f"{path} is not valid JSON; {_FIX}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path} is a JSON {type(doc).__name__}, not an object; {_FIX}")
    _refuse_unsupported(path, doc)
    return AdapterConfig(
        path=path,
        r=_positive_int(path, "r", doc.get("r")),
        lora_alpha=_number(path, "lora_alpha", doc.get("lora_alpha")),
        use_rslora=_flag(path, doc, "use_rslora"),
        fan_in_fan_out=_flag(path, doc, "fan_in_fan_out"),
        target_modules=_names(path, "target_modules", doc.get("target_modules")),
        exclude_modules=_names(path, "exclude_modules", doc.get("exclude_modules")),
        modules_to_save=_regexes(path, "modules_to_save", doc.get("modules_to_save"), SAVED),
        rank_pattern=_pattern(path, "rank_pattern", doc.get("rank_pattern"), _positive_int),
        alpha_pattern=_pattern(path, "alpha_pattern", doc.get("alpha_pattern"), _number),
        layers_to_transform=_layers(path, doc.get("layers_to_transform")),
        layers_pattern=_layers_pattern(path, doc.get("layers_pattern")),
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def _refuse_unsupported(path: Path, doc: dict[str, Any]) -> None:
    peft_type = doc.get("peft_type")
    if peft_type != "LORA":
        raise CheckpointError(
            f"{path}: peft_type is {peft_type!r}; MergePipe reads LoRA adapters (peft_type LORA) only: {MERGE_FIRST}"
        )
    for field, what in _VARIANT_FIELDS.items():
        if doc.get(field):
            raise CheckpointError(f"{path}: {what} is not supported: {MERGE_FIRST}")
    bias = doc.get("bias", "none")
    if bias != "none":
        raise CheckpointError(f"{path}: trained biases (bias={bias!r}) are not supported: {MERGE_FIRST}")
    init = doc.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise CheckpointError(
            f"{path}: init_lora_weights={init!r} makes the adapter relative to a modified base; "
            f"convert it with save_pretrained(path_initial_model_for_weight_conversion=...) or {MERGE_FIRST}"
        )


def _bad(path: Path, field: str, value: Any, want: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {field} is {value!r}, not {want}; {_FIX}")


def _positive_int(path: Path, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad(path, field, value, "a positive integer")
    return value


def _number(path: Path, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(path, field, value, "a number")
    return value


def _flag(path: Path, doc: dict[str, Any], field: str) -> bool:
    value = doc.get(field, False)
    if not isinstance(value, bool):
        raise _bad(path, field, value, "true or false")
    return value


def _name_list(path: Path, field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(path, field, value, "a list of module names")
    return tuple(value)


def _names(path: Path, field: str, value: Any) -> PeftRegex | tuple[str, ...] | None:
    """A string is a whole-path regex; a list holds names matched as text (PEFT's equal-or-suffix rule)."""
    if value is None:
        return None
    if isinstance(value, str):
        return peft_regex(path, field, value, whole=True)
    return _name_list(path, field, value)


def _regexes(path: Path, field: str, value: Any, template: str) -> tuple[PeftRegex, ...]:
    return tuple(peft_regex(path, field, name, template) for name in _name_list(path, field, value))


def _pattern(path: Path, field: str, value: Any, check) -> tuple[tuple[PeftRegex, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad(path, field, value, "an object of module patterns")
    return tuple((peft_regex(path, field, key, KEY), check(path, f"{field}[{key!r}]", item))
                 for key, item in value.items())


def _layers(path: Path, value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise _bad(path, "layers_to_transform", value, "an integer or a list of integers")


def _layers_pattern(path: Path, value: Any) -> tuple[PeftRegex, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = [value]
    return _regexes(path, "layers_pattern", value, LAYERS)
