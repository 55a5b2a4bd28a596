"""The recipe of `mergepipe integrate`: one continuous-integration pipeline, in YAML.

    base: ./Qwen3-0.6B              # or {id: base, uri: ./Qwen3-0.6B}; the id defaults to "base"
    experts:                        # id: checkpoint directory (relative paths: to the recipe)
      math: ./experts/math
      code: s3://bucket/experts/code   # s3:// and http(s):// checkpoints are read where they are
      chat: hf://org/chat@main      # a Hub model (or mergekit's bare org/chat), at its branch's commit
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

A recipe is a merge request (``spec/request.py``: the same fields, checked
the same way, its models named by their recipe ids) plus where each model
lives and where the versions are published. Parsing is strict: an unknown
key, a missing one or a value of the wrong type is a one-line
``ConfigError`` naming it, before anything is read or written. The YAML is
read as every config is (``spec/merge_config.yaml_document``). A base or an
expert given as an ``s3://``, ``http(s)://`` or ``hf://`` URI stays a
``RemotePath``, and so does mergekit's bare Hub id ``ORG/NAME[@REVISION]``
unless a local path of that spelling exists (relative to the recipe, as in
`merge`); anything else is a local directory. The output root is always
local.

Every run registers each model again, and a remote one is re-checked from
metadata (``analysis/register.py``): a Hub model by the commit its revision
names now, an S3 or HTTP one by its files' ETags; only a new commit or ETag
reads headers and becomes the next version.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from mergepipe.errors import ConfigError
from mergepipe.spec.merge_config import yaml_document
from mergepipe.spec.request import MergeRequest, Policy, StrictModel
from mergepipe.storage.location import Location, RemotePath, hub_uri, location


class _Base(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")  # checked as part of the recipe: one message

    id: str = Field("base", min_length=1)
    uri: str = Field(min_length=1)


class _Output(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(min_length=1)
    model_id: str = Field(min_length=1)
    keep: int | None = Field(None, ge=1, strict=True)


class _RecipeFile(StrictModel):
    """A recipe as written (see the module docstring)."""

    what: ClassVar[str] = ""  # the caller names the recipe file

    base: str | _Base
    experts: dict[str, str] = Field(min_length=1)
    operator: str
    params: dict[str, Any] = Field(default_factory=dict)
    expert_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    weights: list[float] | None = None
    seed: int = Field(0, strict=True)
    budget: str | int = "100%"
    policy: Policy | None = None
    out_dtype: str | None = None
    output: _Output


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe: its merge request (models named by their recipe ids, ``model_id`` the merged
    model's), where each model is (base first), and where versions are published."""

    path: Path
    request: MergeRequest
    locations: dict[str, Path | RemotePath]
    out_root: Path
    keep: int | None

    @property
    def base_id(self) -> str:
        return self.request.base

    @property
    def model_id(self) -> str:
        assert self.request.model_id is not None, "a recipe always names its merged model"
        return self.request.model_id


def load_recipe(path: str | Path) -> Recipe:
    """Parse the recipe at ``path``; ConfigError naming the first problem."""
    path = Path(path)
    where = f"recipe {path}"
    data = read_yaml_mapping(path, where)
    try:
        written = _RecipeFile(**data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    here = path.resolve().parent
    base = written.base if isinstance(written.base, _Base) else _Base(uri=written.base)
    locations = {base.id: _model_location(base.uri, f"{where}: base", here)}
    for name, value in written.experts.items():
        locations[name] = _model_location(value, f"{where}: experts.{name}", here)
    out_root = _location(written.output.root, f"{where}: output.root", here)
    if isinstance(out_root, RemotePath):
        raise ConfigError(f"{where}: output.root {out_root} is remote; give a local directory (snapshots are "
                          "published on this machine)")
    try:
        request = MergeRequest(
            base=base.id, experts=tuple(written.experts), operator=written.operator, weights=written.weights,
            params=written.params, expert_params=written.expert_params, seed=written.seed, budget=written.budget,
            policy=written.policy, out_dtype=written.out_dtype, model_id=written.output.model_id,
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return Recipe(path.resolve(), request, locations, out_root, written.output.keep)


def read_yaml_mapping(path: Path, where: str) -> dict[str, Any]:
    """The YAML file at ``path`` as a mapping of string keys (read as every config is); ConfigError naming
    ``where`` for a file that cannot be read, is not YAML, or is not such a mapping."""
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    data = yaml_document(content, where)
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def _model_location(value: str, where: str, here: Path) -> Location:
    """Where a model of the recipe is: as ``_location`` says, except that mergekit's bare Hub id
    ``ORG/NAME[@REVISION]`` that is no local path (relative to the recipe's folder) is that Hub model."""
    found = _location(value, where, here)
    hub = hub_uri(value) if isinstance(found, Path) and not found.exists() else None
    return found if hub is None else RemotePath(hub)


def _location(value: str, where: str, here: Path) -> Location:
    """An s3://, http(s):// or hf:// URI as it is; a ``file://`` URI or a path made absolute (relative to the
    recipe's folder); another ``scheme://`` refused by ``location``."""
    try:
        found = location(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return found if isinstance(found, RemotePath) else (here / Path(found).expanduser()).resolve()
