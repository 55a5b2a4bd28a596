"""A merge request as a config file states it, before models are resolved.

Two forms are read (``merge_config.py`` tells them apart):

* MergePipe's own: ``params:`` (global settings) and ``expert_params: {ID:
  {...}}``; the models and the operator come from the command line;
* mergekit's (``merge_method:`` present): the whole merge, as mergekit 0.1.5
  reads it, plus an optional ``mergepipe:`` section for MergePipe's own
  choices (``spec/mergekit.py``).

Both become one :class:`MergeRequest`, so the command line has one thing to
combine with its flags. This module is pure: model references stay as
written (ids or paths); the CLI resolves and registers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from mergepipe.errors import ConfigError

#: Keys of the ``mergepipe:`` section and what each sets.
MERGEPIPE_KEYS = {
    "budget": "expert-I/O budget (as --budget)",
    "policy": "budget policy (as --policy)",
    "seed": "seed of random operators (as --seed)",
    "block_bytes": "block size of a new catalog (an existing one must match)",
    "model_id": "id of the merged model (as --model-id)",
    "out_shard_size": "largest output shard (as --out-shard-size)",
}


@dataclass(frozen=True)
class MergeRequest:
    """What a config file asks for. ``base``/``experts``/``operator`` are None
    in MergePipe's own form (they come from flags); ``expert_params`` is keyed
    by the references as written; ``settings`` holds the ``mergepipe:``
    section; ``notes`` are what a user should be told about the translation."""

    form: str
    base: str | None = None
    experts: tuple[str, ...] = ()
    operator: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    expert_params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    out_dtype: str | None = None
    chat_template: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def own_form(data: Mapping[str, Any], source: str) -> MergeRequest:
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
    return MergeRequest(form="mergepipe", params=dict(params),
                        expert_params={str(k): dict(v) for k, v in experts.items()})


def mergepipe_section(value: Any, source: str) -> dict[str, Any]:
    """The ``mergepipe:`` section, checked for unknown keys and value types."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: `mergepipe:` must be a mapping with keys {', '.join(MERGEPIPE_KEYS)}")
    unknown = set(value) - set(MERGEPIPE_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) in `mergepipe:`: {', '.join(sorted(map(str, unknown)))}; "
                          f"known: {', '.join(MERGEPIPE_KEYS)}")
    seed = value.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"{source}: mergepipe.seed must be a non-negative integer, got {seed!r}")
    for key in ("policy", "model_id"):
        if key in value and not isinstance(value[key], str):
            raise ConfigError(f"{source}: mergepipe.{key} must be a string, got {value[key]!r}")
    for key in ("budget", "block_bytes", "out_shard_size"):
        if key in value and (isinstance(value[key], bool) or not isinstance(value[key], (str, int, float))):
            raise ConfigError(f"{source}: mergepipe.{key} must be a number or a size like 5GB, got {value[key]!r}")
    return dict(value)
