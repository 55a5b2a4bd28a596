"""The file of `mergepipe search`: which merges to try, how to score them, and how long to look.

    base: ./base                       # ids, folders (relative to this file) or Hub ids, as in a merge
    experts: [./math, ./code]
    operators: [task_arithmetic, ties] # one or more; each trial picks one
    weight: [0.0, 1.0]                 # every expert's weight range, or {math: [0.2, 1.0], code: [0, 1]}
    density: [0.3, 0.9]                # for the operators that take it
    lambda: [0.5, 1.5]                 # optional, for the operators that take it
    budget: 25%                        # expert-I/O budget of every trial
    final_budget: 100%                 # of the published best
    objective:                         # minimised: the weighted sum of held-out losses
      - {data: held-out.jsonl, weight: 1.0}
    max_tokens: 256                    # evaluation settings, as `mergepipe eval`
    batch: 8
    sampler: tpe                       # or cmaes
    seed: 0
    trials: 40
    study: my-search                   # optional: the file's name without its suffix

Parsing is strict (an unknown key, a missing one, a value of the wrong type,
an empty range, an unknown operator: one ``ConfigError`` naming it), before
anything is read. A parameter range is ``[low, high]``; ``low == high``
fixes it.
"""

from __future__ import annotations

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

    data: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0)


class _SearchFile(StrictModel):
    what: ClassVar[str] = ""

    base: str = Field(min_length=1)
    experts: list[str] = Field(min_length=1)
    operators: list[str] = Field(min_length=1)
    weight: tuple[float, float] | dict[str, tuple[float, float]] = (0.0, 1.0)
    density: tuple[float, float] | None = None
    lambda_: tuple[float, float] | None = Field(None, alias="lambda")
    budget: str | int = "25%"
    final_budget: str | int = "100%"
    policy: Literal["energy", "uniform", "full", "entries"] = "energy"
    objective: list[_Objective] = Field(min_length=1)
    max_tokens: int = Field(EvalSettings.max_tokens, ge=2, strict=True)
    batch: int = Field(EvalSettings.batch, ge=1, strict=True)
    sampler: Literal["tpe", "cmaes"] = "tpe"
    seed: int = Field(0, ge=0, strict=True)
    trials: int = Field(20, ge=1, strict=True)
    study: str | None = Field(None, min_length=1, max_length=200)


@dataclass(frozen=True)
class SearchSpec:
    """A search file, parsed: references resolved against its folder, every range checked."""

    path: Path
    study: str
    base: str
    experts: tuple[str, ...]
    operators: tuple[str, ...]
    weights: dict[str, Range]  # per expert, as written in ``experts``
    density: Range | None
    lam: Range | None
    budget: str
    final_budget: str
    policy: str
    objective: tuple[tuple[Path, float], ...]
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
        if value is not None and not value[0] <= value[1]:
            raise ConfigError(f"{where}: {name}: the range [{value[0]}, {value[1]}] is empty (low > high)")
    if written.density is not None and not 0 < written.density[0] <= written.density[1] <= 1:
        raise ConfigError(f"{where}: density must lie in (0, 1], got {list(written.density)}")
    objective = tuple((_file(o.data, here, where), o.weight) for o in written.objective)
    return SearchSpec(
        path=path.resolve(), study=written.study or path.stem, base=_reference(written.base, here), experts=experts,
        operators=tuple(operators), weights=weights, density=written.density, lam=written.lambda_,
        budget=str(written.budget), final_budget=str(written.final_budget), policy=written.policy,
        objective=objective, settings=EvalSettings(max_tokens=written.max_tokens, batch=written.batch),
        sampler=written.sampler, seed=written.seed, trials=written.trials)


def _reference(value: str, here: Path) -> str:
    """A folder relative to the search file, made absolute; an id or a URI as written."""
    candidate = Path(value).expanduser()
    candidate = candidate if candidate.is_absolute() else here / candidate
    return str(candidate) if candidate.is_dir() else value


def _file(value: str, here: Path, where: str) -> Path:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else here / path
    if not path.is_file():
        raise ConfigError(f"{where}: objective data {value}: no such file")
    return path

