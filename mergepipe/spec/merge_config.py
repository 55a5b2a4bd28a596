"""Read a merge config file: MergePipe's own form or mergekit's, told apart by ``merge_method``.

``yaml_document`` is the one way a config's YAML is read (``merge --config``
here, ``integrate``'s recipe in ``cli/recipe.py``): the file's bytes as
strict UTF-8, ``yaml.safe_load``, and whatever a hostile or broken file
makes the parser raise (invalid bytes, nesting past Python's recursion limit,
an integer of more digits than Python converts, a bad date) turned into one
``ConfigError`` naming the file. What loads is then bounded, so that no later
step recurses or loops on it: at most ``MAX_DEPTH`` levels deep and
``MAX_VALUES`` values, counting each use of a YAML alias (a recursive alias
is too deep, a "billion laughs" too many values).
"""

from __future__ import annotations

from typing import Any

import yaml

from mergepipe.errors import ConfigError
from mergepipe.spec.merge_request import MergeRequest, own_form
from mergepipe.spec.mergekit import from_mergekit

#: Levels of nesting a config may have: mergekit's deepest (slices, sources, parameters, filter rules) is 6.
MAX_DEPTH = 64
#: Values a config may hold, aliases counted at each use: far above any merge's, far below a stall.
MAX_VALUES = 100_000


def load_config(content: bytes | str, source: str) -> MergeRequest:
    """Parse a config file's ``content`` (its bytes, or text already decoded; ``source`` names it in errors)."""
    data = yaml_document(content, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    if "merge_method" in data:
        return from_mergekit(data, source)
    return own_form(data, source)


def yaml_document(content: bytes | str, source: str) -> Any:
    """The one YAML document in ``content`` (a file's bytes, read as strict UTF-8), within ``MAX_DEPTH`` and
    ``MAX_VALUES``; anything else is a one-line ``ConfigError`` naming ``source``."""
    if isinstance(content, bytes):
        try:
            content = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = content.count(b"\n", 0, exc.start) + 1
            raise ConfigError(f"{source}: not UTF-8 text (line {line} has the byte {content[exc.start]:#04x}); "
                              "save it as UTF-8") from None
    try:
        data = yaml.safe_load(content)
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
