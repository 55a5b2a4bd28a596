"""What the planner and the engine need to know about an operator, without its math.

An ``OperatorDef`` declares an operator's parameters (two typed dataclasses,
see ``params.py``), whether it streams block by block or needs whole
tensors, and which error bound it admits; it validates a ``MergeSpec``
before any I/O and resolves the spec's settings to typed values for one
tensor. The math lives in ``engine/operators/``, one kernel per operator,
keyed by the same name.

Error bounds, per ``error_bound``, with ``beta = definition.beta(params)``
(see docs/ARCHITECTURE.md, "Planning"):

* ``"exact"`` (avg, linear, task_arithmetic): the output is
  ``s*B + Σ ci Δi`` with data-independent ``ci``; omitting block b of expert
  i changes the output by exactly ``|ci| * ||Δi_b||`` (``beta[i] = |ci|``).
* ``"separable"`` (dare_linear, breadcrumbs, della_linear): the output is
  ``B + Σ Ti(Δi)`` with ``|Ti(Δ)_j| <= beta[i] * |Δ_j|``, each ``Ti``
  depending on expert i only, so omitting block b of expert i changes the
  output by at most ``beta[i] * ||Δi_b||``.
* ``"consensus"`` (ties, dare_ties, breadcrumbs_ties, della): one expert can
  flip the elected sign; what holds is ``|m_j| <= Σi beta[i] * |Δi_j|``, so
  omitting experts in block b changes it by at most
  ``Σ_all beta ||Δ_b|| + Σ_read beta ||Δ_b||``.
* ``"none"`` (slerp, model_stock, and DARE/DELLA with ``rescale: l1``): the
  change depends on whole-tensor statistics; ``beta`` is ``inf``. These run
  at tensor level: the planner reads all of a tensor's expert blocks or none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Mapping, Sequence, TypeVar

from mergepipe.errors import ConfigError
from mergepipe.spec.merge_spec import MergeSpec
from mergepipe.spec.params import NoParams, ParamDef, ParamSet
from mergepipe.spec.settings import layer_index, resolve, setting_leaves

ERROR_BOUNDS = ("exact", "separable", "consensus", "none")

E = TypeVar("E", bound=ParamSet)
G = TypeVar("G", bound=ParamSet)


@dataclass(frozen=True)
class TensorParams(Generic[E, G]):
    """An operator's parameters resolved for one tensor: one ``E`` per expert
    (in the spec's expert order) and one ``G``."""

    experts: tuple[E, ...]
    global_: G


class OperatorDef:
    """Base of the operator definitions (``operators.py`` lists them)."""

    #: Canonical lower-case name, shared with the engine's kernel registry.
    name: ClassVar[str]
    #: One line for the CLI's help.
    summary: ClassVar[str] = ""
    #: Per-expert and global parameters (frozen dataclasses of ``param()`` fields).
    expert_params: ClassVar[type[ParamSet]] = NoParams
    global_params: ClassVar[type[ParamSet]] = NoParams
    #: False: needs whole tensors (the engine passes them; planned all-or-nothing).
    streaming: ClassVar[bool] = True
    #: One of ``ERROR_BOUNDS``: see the module docstring.
    error_bound: ClassVar[str] = "none"
    #: Negative weights are refused where a weighted mean or a sign election
    #: makes them meaningless.
    nonnegative_weights: ClassVar[bool] = False
    #: Whether the kernel draws random numbers (keyed by seed, expert family and tensor): then the output
    #: depends on the experts' names, not only on their content (analysis/provenance.py).
    random: ClassVar[bool] = False
    #: Output = base·s + Σ ci·Δi with per-expert constants ci: a block can be updated from a previous
    #: output when an expert is replaced (``merge --delta-update``, planner/reuse.py).
    delta_updatable: ClassVar[bool] = False
    min_experts: ClassVar[int] = 1
    max_experts: ClassVar[int | None] = None
    #: What a plan that leaves expert bytes unread means for this operator, beyond what every plan says
    #: (the planner adds it to such plans' notes); '' when reading less needs no word of its own.
    budget_note: ClassVar[str] = ""

    def __repr__(self) -> str:
        return f"<operator {self.name}>"

    # ---- validation (before any I/O) ---------------------------------

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        """ConfigError for anything wrong with ``spec`` for this operator.

        Checks counts, ids, parameter names and scopes, the structure of every
        setting and every value it can take. Combinations that depend on the
        tensor (della's epsilon vs density, weights summing to 0) are checked
        for every tensor in ``tensor_names``. Without names (before any I/O)
        they are checked where every model is known to be: everywhere for
        plain scalars, at both ends of the layer gradients (any model with
        layers and embeddings has a tensor at each: t = 0 outside the layers
        and at the first, t = 1 at the last); the points between, which
        depend on the layer count, and filter rules, which depend on the
        names, wait for the names (``app/registering.py`` gives the base's
        before any expert is registered).
        """
        n = len(spec.experts)
        if n < self.min_experts or (self.max_experts is not None and n > self.max_experts):
            raise ConfigError(f"{self.name} needs {self._count_phrase()}, got {n}")
        ids = spec.expert_ids
        if any(not isinstance(e, str) or not e for e in ids):
            raise ConfigError(f"expert ids must be non-empty strings, got {list(ids)!r}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"an expert is listed twice in {list(ids)!r}; list each expert once")
        for key, value in spec.params.items():
            self._check_setting(self._definition(key, None), value, "global parameters")
        for e in spec.experts:
            for key, value in e.params.items():
                self._check_setting(self._definition(key, e.expert_id), value, f"expert {e.expert_id!r}")
        if tensor_names:
            for name in tensor_names:
                self.check_tensor(self.resolve(spec, name, num_layers), name)
        elif _scalar_only(spec):
            self.check_tensor(self.resolve(spec, "", 0), "every tensor")
        elif not _has_rules(spec):
            self.check_tensor(self.resolve(spec, "", 0), "the first layer (and the tensors outside the layers)")
            self.check_tensor(self.resolve(spec, *_LAST_LAYER), "the last layer")

    def _definition(self, key: str, expert_id: str | None) -> ParamDef:
        by_name = {d.name: d for d in (*self.expert_params.definitions(), *self.global_params.definitions())}
        where = "" if expert_id is None else f" (expert {expert_id!r})"
        if key not in by_name:
            raise ConfigError(f"{self.name} does not take parameter {key!r}{where}; it takes: {self._params_phrase()}")
        definition = by_name[key]
        if expert_id is not None and definition.scope == "global":
            raise ConfigError(
                f"{key!r} is a global parameter of {self.name}; set it once for the merge, "
                f"not for expert {expert_id!r}"
            )
        return definition

    def _check_setting(self, definition: ParamDef, value: Any, where: str) -> None:
        try:
            for leaf in setting_leaves(value):
                checked = definition.coerce(leaf)
                if definition.name == "weight" and self.nonnegative_weights and checked < 0:
                    raise ConfigError(
                        f"weight must be >= 0 for {self.name} (a weighted mean/sign election), got {leaf!r}; "
                        "use task_arithmetic for negative weights"
                    )
        except ConfigError as exc:
            raise ConfigError(f"{self.name}, {where}: {exc}") from None

    def _count_phrase(self) -> str:
        plural = "s" if self.min_experts > 1 else ""
        if self.max_experts == self.min_experts:
            return f"exactly {self.min_experts} expert{plural}"
        return f"at least {self.min_experts} expert{plural}"

    def _params_phrase(self) -> str:
        names = [*self.expert_params.names(), *self.global_params.names()]
        return ", ".join(names) if names else "no parameters"

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        """ConfigError for a combination of resolved values that is invalid for
        this tensor. Default: nothing to check."""

    # ---- resolution ----------------------------------------------------

    def resolve(self, spec: MergeSpec, tensor_name: str, num_layers: int) -> TensorParams:
        """The typed parameters of one tensor: an expert's own setting, else
        the global one, else the operator's default."""
        layer = layer_index(tensor_name)

        def values(names: Sequence[ParamDef], sources: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
            out = {}
            for definition in names:
                for source in sources:
                    if definition.name in source:
                        value = resolve(source[definition.name], tensor_name, layer, num_layers)
                        if value is not None:
                            out[definition.name] = definition.coerce(value)
                            break
            return out

        expert_defs = self.expert_params.definitions()
        experts = tuple(self.expert_params.build(values(expert_defs, (e.params, spec.params))) for e in spec.experts)
        return TensorParams(experts, self.global_params.build(values(self.global_params.definitions(), (spec.params,))))

    # ---- planning ----------------------------------------------------

    def needs_thresholds(self, expert: Any) -> tuple[float, ...]:
        """Densities whose per-tensor TrimThreshold this expert needs."""
        return ()

    def streams_with(self, params: TensorParams, thresholds_available: bool) -> bool:
        """Whether this tensor can be merged block by block, given whether the
        catalog has every threshold ``needs_thresholds`` asked for. If False
        the engine passes whole tensors (and the kernel computes thresholds)."""
        if not self.streaming:
            return False
        return thresholds_available or not any(self.needs_thresholds(p) for p in params.experts)

    def absent_neutral(self, params: TensorParams) -> bool:
        """Whether an expert whose delta is absent for a block (not read: ``None``) takes no part in
        the block's result, bit for bit: its weight and parameters do not enter the arithmetic of the
        others. Provenance keys (``analysis/provenance.py``) then leave it out, so adding an expert
        does not invalidate the blocks it does not touch. False unless an operator knows better."""
        return False

    def keeps_base(self, params: TensorParams) -> bool:
        """Whether the output is the base where every expert's Δ is 0 (``B + f(Δ)`` with ``f(0) = 0``): only then
        is a block no expert is read for (identical to the base, or left out by the budget) the base's bytes,
        copied without the kernel. Not so for an output that scales B (linear without normalisation: ``Σw·B``).
        ``tests/cli/test_untouched_tensors.py`` checks every method against it."""
        return True

    def beta(self, params: TensorParams) -> list[float]:
        """Per-expert multiplier of the error bound (>= 0, or inf: no bound)."""
        return [math.inf] * len(params.experts)


#: A tensor of the last of two layers, as ``resolve`` takes it: the end of every layer gradient (t = 1).
_LAST_LAYER = ("layers.1", 2)


def _settings(spec: MergeSpec) -> list[Any]:
    return [*spec.params.values(), *(v for e in spec.experts for v in e.params.values())]


def _scalar_only(spec: MergeSpec) -> bool:
    return all(isinstance(v, (bool, int, float, str)) for v in _settings(spec))


def _has_rules(spec: MergeSpec) -> bool:
    """Whether a setting is ``{filter, value}`` rules, whose values depend on the tensors' names."""
    return any(isinstance(v, Mapping) or (isinstance(v, (list, tuple)) and any(isinstance(x, Mapping) for x in v))
               for v in _settings(spec))
