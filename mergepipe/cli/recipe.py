"""The recipe of `mergepipe integrate`: one continuous-integration pipeline, in YAML.

    base: ./Qwen3-0.6B              # or {id: base, uri: ./Qwen3-0.6B}; the id defaults to "base"
    experts:                        # id: checkpoint directory (relative paths: to the recipe)
      math: ./experts/math
      code: s3://bucket/experts/code   # s3:// and http(s):// checkpoints are read where they are
    operator: ties
    params: {density: 0.5}          # global parameters (gradients and filter rules allowed)
    expert_params: {math: {weight: 0.7}}
    seed: 0
    budget: 100%
    policy: energy
    out_dtype: bf16                 # optional
    output:
      root: ./deploy                # each run publishes ROOT/<model_id>-v<N>
      model_id: merged
      keep: 3                       # optional: keep the last 3 published directories (default: all)

Parsing is strict: an unknown key, a missing one or a value of the wrong type
is a one-line ``ConfigError`` naming it, before anything is read or written;
the YAML itself is read as every config is (``spec/merge_config.py``:
``yaml_document``). A base or an expert given as an ``s3://`` or
``http(s)://`` URI stays a ``RemotePath`` (``storage/location.py``), which
``register`` reads remotely; anything else is a local directory. The output
root is always local.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.errors import ConfigError
from mergepipe.spec.merge_config import yaml_document
from mergepipe.storage.location import Location, RemotePath, location

_KEYS = {"base", "experts", "operator", "params", "expert_params", "weights", "seed", "budget", "policy",
         "out_dtype", "output"}
_OUTPUT_KEYS = {"root", "model_id", "keep"}


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe; local paths are absolute, remote checkpoints ``RemotePath``s."""

    path: Path
    base_id: str
    base_uri: Path | RemotePath
    experts: dict[str, Path | RemotePath]  # id -> checkpoint, in recipe order
    operator: str
    out_root: Path
    model_id: str
    params: dict[str, Any] = field(default_factory=dict)
    expert_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    weights: list[float] | None = None
    seed: int = 0
    budget: str = "100%"
    policy: str = "energy"
    out_dtype: str | None = None
    keep: int | None = None


def load_recipe(path: Path) -> Recipe:
    """Parse the recipe at ``path``; ConfigError naming the first problem."""
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the recipe ({exc.strerror})") from None
    where = f"recipe {path}"
    data = yaml_document(content, where)
    data = _mapping(data, where, _KEYS, required={"base", "experts", "operator", "output"})
    here = Path(path).resolve().parent
    base_id, base_uri = _base(data["base"], where, here)
    experts = {str(k): _location(v, f"{where}: experts.{k}", here)
               for k, v in _mapping(data["experts"], f"{where}: experts").items()}
    if not experts:
        raise ConfigError(f"{where}: experts is empty; name at least one expert and its directory")
    output = _mapping(data["output"], f"{where}: output", _OUTPUT_KEYS, required={"root", "model_id"})
    out_root = _location(output["root"], f"{where}: output.root", here)
    if isinstance(out_root, RemotePath):
        raise ConfigError(f"{where}: output.root {out_root} is remote; give a local directory (snapshots are "
                          "published on this machine)")
    keep = output.get("keep")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"{where}: output.keep must be a whole number >= 1, got {keep!r}")
    return Recipe(
        path=Path(path).resolve(),
        base_id=base_id,
        base_uri=base_uri,
        experts=experts,
        operator=_text(data["operator"], f"{where}: operator"),
        out_root=out_root,
        model_id=_text(output["model_id"], f"{where}: output.model_id"),
        params=dict(_mapping(data.get("params") or {}, f"{where}: params")),
        expert_params={str(k): dict(_mapping(v, f"{where}: expert_params.{k}"))
                       for k, v in _mapping(data.get("expert_params") or {}, f"{where}: expert_params").items()},
        weights=_weights(data.get("weights"), where),
        seed=_integer(data.get("seed", 0), f"{where}: seed"),
        budget=str(data.get("budget", "100%")),
        policy=_text(data.get("policy", "energy"), f"{where}: policy"),
        out_dtype=None if data.get("out_dtype") is None else _text(data["out_dtype"], f"{where}: out_dtype"),
        keep=keep,
    )


def _mapping(value: Any, where: str, allowed: set[str] | None = None, required: set[str] = frozenset()) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    if allowed is not None:
        unknown = sorted(set(map(str, value)) - allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    missing = sorted(required - set(value))
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    return value


def _base(value: Any, where: str, here: Path) -> tuple[str, Location]:
    if isinstance(value, dict):
        d = _mapping(value, f"{where}: base", {"id", "uri"}, required={"uri"})
        return _text(d.get("id", "base"), f"{where}: base.id"), _location(d["uri"], f"{where}: base.uri", here)
    return "base", _location(value, f"{where}: base", here)


def _location(value: Any, where: str, here: Path) -> Location:
    """An s3:// or http(s):// URI as it is; a ``file://`` URI or a path made absolute (relative to the
    recipe's folder); another ``scheme://`` refused by ``location``."""
    try:
        found = location(_text(value, where))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return found if isinstance(found, RemotePath) else _path(str(found), where, here)


def _path(value: Any, where: str, here: Path) -> Path:
    return (here / Path(_text(value, where)).expanduser()).resolve()


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected a whole number, got {value!r}")
    return value


def _weights(value: Any, where: str) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in value):
        raise ConfigError(f"{where}: weights must be a list of numbers, one per expert")
    return [float(w) for w in value]
