"""Read a merge config file, MergePipe's own form or mergekit's, and combine it with the command line's flags.

Two forms are read, told apart by ``merge_method``:

* MergePipe's own: ``params:`` (global settings) and ``expert_params: {ID:
  {...}}``; the models and the operator come from the command line;
* mergekit's: the whole merge, as mergekit 0.1.5 reads it, plus an optional
  ``mergepipe:`` section for MergePipe's own choices (``spec/mergekit.py``).

Either way the file gives some fields of a ``MergeRequest`` (``ConfigFile``),
and ``merge_request`` lays the flags over them: flags win over the file,
which wins over the defaults. A mergekit config names the models and the
method itself, so ``--base``/``--experts``/``--operator``/``--weights`` are
refused beside one rather than silently mixed in.

``yaml_document`` is the one way a config's YAML is read (``merge --config``
here, ``integrate``'s recipe in ``app/recipe.py``): the file's bytes as
strict UTF-8, ``yaml.safe_load``, and whatever a hostile or broken file
makes the parser raise (invalid bytes, nesting past Python's recursion limit,
an integer of more digits than Python converts, a bad date) turned into one
``ConfigError`` naming the file. What loads is then bounded, so that no later
step recurses or loops on it: at most ``MAX_DEPTH`` levels deep and
``MAX_VALUES`` values, counting each use of a YAML alias (a recursive alias
is too deep, a "billion laughs" too many values).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from mergepipe.errors import ConfigError
from mergepipe.spec.mergekit import from_mergekit
from mergepipe.spec.request import MergeRequest

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
    fields: Mapping[str, Any] = field(default_factory=dict)


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
    """The request the flags (``MergeRequest`` field -> value; None: not given) and the config file ask
    for; the file's global ``params`` are updated by the flags' parameters, never replaced."""
    given = {k: v for k, v in flags.items() if v is not None and v != () and v != {}}
    fields = dict(config.fields) if config is not None else {}
    if config is not None and config.form == "mergekit":
        clash = [flag for key, flag in _MODEL_FLAGS.items() if key in given]
        if clash:
            raise ConfigError(f"{config.source} is a mergekit config: it names the models and the method; drop "
                              f"{', '.join(clash)}")
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
            raise ConfigError(f"{source}: not UTF-8 text (line {line} has the byte {content[exc.start]:#04x}); "
                              "save it as UTF-8") from None
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
        raise ConfigError(f"{source}: holds {values} values once its aliases are expanded, more than "
                          f"{MAX_VALUES}; a merge config is far smaller")
    return data


def _measure(node: Any, above: int, seen: dict[int, tuple[int, int]], source: str) -> tuple[int, int]:
    """(values, levels) of ``node``: the values in it, itself included, each alias counted at every use,
    and how many levels of lists and mappings it nests (0 for a scalar). ``above`` is how many it is
    nested in; past ``MAX_DEPTH`` levels it is refused without recursing further (a recursive alias too).
    ``seen`` holds the result per container already measured, so a shared one is walked once."""
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
    return ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep (or a YAML alias inside its own "
                       "anchor); a merge config is a few levels deep")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__
