"""The file of `mergepipe search`: which merges to try, how to score them, and how long to look.

Its keys, in a complete commented example: docs/CONCEPTS.md, "The search file". Parsing is strict (an
unknown key, a missing one, a value of the wrong type, an empty range or one not finite, an unknown operator: one
``ConfigError`` naming it), before anything is read. A parameter range is ``[low, high]``; ``low == high``
fixes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from mergepipe.app.recipe import read_yaml_mapping
from mergepipe.errors import ConfigError
from mergepipe.evaluation.data import EvalSettings
from mergepipe.spec.operators import canonical_name, get_operator
from mergepipe.spec.request import StrictModel

Range = tuple[float, float]


class _Objective(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    data: str | None = Field(None, min_length=1)
    task: str | None = Field(None, min_length=1)
    metric: str = Field("acc", min_length=1)
    include: str | None = Field(None, min_length=1)
    limit: int | None = Field(None, ge=1, strict=True)
    weight: float = Field(1.0, gt=0)


class _SearchFile(StrictModel):
    what: ClassVar[str] = ""

    base: str = Field(min_length=1)
    experts: list[str] = Field(min_length=1)
    operators: list[str] = Field(min_length=1)
    weight: tuple[float, float] | dict[str, tuple[float, float]] = (0.0, 1.0)
    density: tuple[float, float] | None = None
    lambda_: tuple[float, float] | None = Field(None, alias="lambda")
    layer_groups: int = Field(1, ge=1, le=64, strict=True)
    budget: str | int = "25%"
    final_budget: str | int = "100%"
    policy: Literal["energy", "uniform", "full", "entries"] | None = None
    objective: list[_Objective] = Field(min_length=1)
    max_tokens: int = Field(EvalSettings.max_tokens, ge=2, strict=True)
    batch: int = Field(EvalSettings.batch, ge=1, strict=True)
    tokenizer: str | None = Field(None, min_length=1)
    sampler: Literal["tpe", "cmaes"] = "tpe"
    seed: int = Field(0, ge=0, strict=True)
    trials: int = Field(20, ge=1, strict=True)
    study: str | None = Field(None, min_length=1, max_length=200)


@dataclass(frozen=True)
class Term:
    """One term of the objective: a held-out file's loss (``data``, minimised) or an lm-eval task's
    ``metric`` (``task``, maximised: its negative is summed), times ``weight``."""

    weight: float
    data: Path | None = None
    task: str | None = None
    metric: str = "acc"
    include: Path | None = None
    limit: int | None = None

    @property
    def name(self) -> str:
        return self.data.name if self.data is not None else f"{self.task}/{self.metric}"


@dataclass(frozen=True)
class SearchSpec:
    """A search file, parsed: references resolved against its folder, every range checked."""

    path: Path
    study: str
    base: str
    experts: tuple[str, ...]
    names: tuple[str, ...]  # each expert in trial parameters: a folder's name, else as written (unique)
    operators: tuple[str, ...]
    weights: dict[str, Range]  # per expert, as written in ``experts``
    density: Range | None
    lam: Range | None
    layer_groups: int
    budget: str
    final_budget: str
    policy: str | None  # None: the planner's default (entries when every expert has a delta store)
    objective: tuple[Term, ...]
    settings: EvalSettings
    sampler: str
    seed: int
    trials: int

    def takes(self, operator: str, parameter: str) -> bool:
        """Whether ``operator`` has the parameter (global or per expert)."""
        op = get_operator(operator)
        return any(d.name == parameter for d in (*op.global_params.definitions(), *op.expert_params.definitions()))


def load_search(path: str | Path) -> SearchSpec:
    """Parse the search file at ``path``; ConfigError naming the first problem."""
    path = Path(path)
    where = f"search file {path}"
    data = read_yaml_mapping(path, where)
    try:
        written = _SearchFile(**data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    here = path.resolve().parent
    experts = tuple(_reference(e, here) for e in written.experts)
    if len(set(experts)) != len(experts):
        raise ConfigError(f"{where}: an expert is listed twice")
    names = tuple(Path(e).name if Path(e).is_absolute() else w for w, e in zip(written.experts, experts))
    operators = []
    for name in written.operators:
        try:
            operators.append(canonical_name(name))
        except ConfigError as exc:
            raise ConfigError(f"{where}: operators: {exc}") from None
    if isinstance(written.weight, dict):
        unknown = sorted(set(written.weight) - set(written.experts))
        missing = sorted(set(written.experts) - set(written.weight))
        if unknown or missing:
            problem = f"unknown expert {unknown[0]}" if unknown else f"no range for {missing[0]}"
            raise ConfigError(f"{where}: weight: {problem}")
        weights = {_reference(e, here): written.weight[e] for e in written.experts}
    else:
        weights = {e: written.weight for e in experts}
    for name, value in [*((f"weight of {e}", r) for e, r in weights.items()), ("density", written.density),
                        ("lambda", written.lambda_)]:
        if value is not None and not math.isfinite(value[1] - value[0]):  # what Optuna's samplers draw in
            raise ConfigError(f"{where}: {name}: the range [{value[0]}, {value[1]}] is not finite; give finite "
                              "bounds less than 1.7e308 apart")
        if value is not None and not value[0] <= value[1]:
            raise ConfigError(f"{where}: {name}: the range [{value[0]}, {value[1]}] is empty (low > high)")
    if written.density is not None and not 0 < written.density[0] <= written.density[1] <= 1:
        raise ConfigError(f"{where}: density must lie in (0, 1], got {list(written.density)}")
    objective = tuple(_term(o, here, where) for o in written.objective)
    tokenizer = None if written.tokenizer is None else _reference(written.tokenizer, here)
    return SearchSpec(
        path=path.resolve(), study=written.study or path.stem, base=_reference(written.base, here), experts=experts,
        names=names if len(set(names)) == len(names) else tuple(written.experts), operators=tuple(operators),
        weights=weights, density=written.density, lam=written.lambda_, layer_groups=written.layer_groups,
        budget=str(written.budget), final_budget=str(written.final_budget), policy=written.policy,
        objective=objective, settings=EvalSettings(written.max_tokens, written.batch, tokenizer),
        sampler=written.sampler, seed=written.seed, trials=written.trials)


def _reference(value: str, here: Path) -> str:
    """A folder relative to the search file, made absolute; an id or a URI as written."""
    candidate = Path(value).expanduser()
    candidate = candidate if candidate.is_absolute() else here / candidate
    return str(candidate) if candidate.is_dir() else value


def _term(written: _Objective, here: Path, where: str) -> Term:
    if (written.data is None) == (written.task is None):
        raise ConfigError(f"{where}: objective: each term names either data (a held-out file) or task (an "
                          "lm-eval task)")
    if written.data is not None:
        if written.include is not None or written.limit is not None:
            raise ConfigError(f"{where}: objective: include and limit go with a task, not with data")
        return Term(written.weight, data=_path(written.data, here, where, "data", Path.is_file, "file"))
    include = None if written.include is None else _path(written.include, here, where, "include", Path.is_dir,
                                                         "folder")
    return Term(written.weight, task=written.task, metric=written.metric, include=include, limit=written.limit)


def _path(value: str, here: Path, where: str, key: str, exists: Callable[[Path], bool], kind: str) -> Path:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else here / path
    if not exists(path):
        raise ConfigError(f"{where}: objective {key} {value}: no such {kind}")
    return path

