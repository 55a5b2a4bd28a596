"""The operator interface the engine codes against.

An operator merges one block of one tensor (or the whole tensor, for
tensor-level operators) from the fp32 base block and, per expert, the fp32
delta block ``Δi = Ei - B`` or ``None`` ("not read": ``Δi = 0`` for this
block). It never does I/O and keeps no state between calls.

How the engine drives an operator, per merge::

    op = validate_spec(spec, tensor_names, num_layers)   # registry.py; ConfigError before any I/O

per tensor::

    per_expert, global_ = resolve_for_tensor(spec, name, layer_index(name), num_layers)
    op.check_tensor(per_expert, global_, name)            # (validate did it already if given names)
    wanted = [op.needs_thresholds(p) for p in per_expert] # densities to fetch from the catalog
    stream = op.streams_with(per_expert, global_, catalog_has_all(wanted))
    ctx = BlockContext.create(name, shape, spec.expert_ids, per_expert, global_,
                              seed=spec.seed, thresholds=[{d: TrimThreshold} | None, ...])

per block (``stream``) or once with whole tensors (``not stream``)::

    out = op.merge(base_block, [delta_block | None, ...], ctx.for_rows(row_start))

``merge`` raises EngineError when an input holds NaN/Inf (or the merge
overflows). Streaming operators let every input value reach the output
through arithmetic (masks multiply, NaN * 0 = NaN), so one pass over the
output detects it and only then are the inputs scanned to name the culprit;
tensor-level operators check their inputs first. All arithmetic is separate
IEEE fp32 multiplies/adds/divides in a fixed order (experts sorted by id), never
fused multiply-adds, whose rounding differs between CPU builds (checked:
``torch.add(alpha=)`` gives other bits under ``ATEN_CPU_CAPABILITY=default``
than under avx2). So the bits of a streaming result depend on neither block
size, expert order, thread count nor CPU. Tensor-level operators (slerp,
model_stock) reduce whole tensors in float64 to get their scalar
coefficients; torch may order such sums differently with another thread
count, which can move a coefficient in its last float64 bits.

The planner's error bounds, per ``op.error_bound``, with
``beta = op.coefficient(per_expert, global_)``:

* ``"exact"`` (``fixed_coefficient``: avg, linear, task_arithmetic): the
  output is ``s*B + Σ ci Δi`` with data-independent ``ci = beta[i]`` (and
  ``s = 1`` except linear without normalize, ``s = Σw``); omitting block b of
  expert i changes the output by exactly ``|ci| * ||Δi_b||``.
* ``"separable"`` (dare_linear, breadcrumbs, della_linear, not with
  ``rescale=l1``): the output is ``B + Σ Ti(Δi)`` with ``|Ti(Δ)_j| <=
  beta[i] * |Δ_j|`` per element, each ``Ti`` depending on expert i only
  (thresholds and random masks are fixed per tensor), so omitting block b of
  expert i changes the output by at most ``beta[i] * ||Δi_b||``.
* ``"consensus"`` (ties, dare_ties, breadcrumbs_ties, della): one expert
  can flip the elected sign and so change the others' contributions; no
  per-expert bound holds. What holds: the merged delta of a block obeys
  ``|m_j| <= Σi beta[i] * |Δi_j|``, so omitting a set of experts in block b
  changes it by at most ``Σ_all beta ||Δ_b|| + Σ_read beta ||Δ_b||``.
* ``"none"`` (slerp, model_stock): the change depends on the base or on
  whole-tensor statistics; beta is ``inf``. The same holds for DARE/DELLA
  with ``rescale=l1`` (their ``coefficient`` returns ``inf`` then).
  These run at tensor level: the planner reads all of a tensor's expert
  blocks or none, and an unread tensor leaves the base tensor unchanged.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Mapping, Sequence

import torch

from mergepipe.catalog.thresholds import TrimThreshold, find_threshold
from mergepipe.engine.params import PARAMS, MergeSpec, coerce, layer_index, resolve_for_tensor, setting_leaves
from mergepipe.engine.rng import ElementRng
from mergepipe.errors import ConfigError, EngineError


@dataclass(frozen=True)
class BlockContext:
    """Everything an operator needs to merge one block of one tensor.

    Per-expert tuples are in the spec's expert order, the same order as the
    ``deltas`` list given to ``merge``. ``thresholds[i]`` maps a density to
    expert i's TrimThreshold for this tensor (from the catalog); a missing
    entry makes the operator compute it, which needs the whole tensor.
    """

    tensor_name: str
    shape: tuple[int, ...]
    expert_ids: tuple[str, ...]
    expert_params: tuple[Mapping[str, Any], ...]
    global_params: Mapping[str, Any]
    thresholds: tuple[Mapping[float, TrimThreshold] | None, ...] = ()
    rngs: tuple[ElementRng, ...] = ()
    row_start: int = 0

    @classmethod
    def create(
        cls,
        tensor_name: str,
        shape: Sequence[int],
        expert_ids: Sequence[str],
        expert_params: Sequence[Mapping[str, Any]],
        global_params: Mapping[str, Any],
        *,
        seed: int,
        thresholds: Sequence[Mapping[float, TrimThreshold] | None] | None = None,
        row_start: int = 0,
    ) -> "BlockContext":
        """A context for a tensor, with one ElementRng per expert from ``seed``."""
        ids = tuple(expert_ids)
        if len(expert_params) != len(ids):
            raise ValueError("expert_params must have one entry per expert")
        thr = tuple(thresholds) if thresholds is not None else (None,) * len(ids)
        if len(thr) != len(ids):
            raise ValueError("thresholds must have one entry per expert")
        return cls(
            tensor_name=tensor_name,
            shape=tuple(int(s) for s in shape),
            expert_ids=ids,
            expert_params=tuple(expert_params),
            global_params=global_params,
            thresholds=thr,
            rngs=tuple(ElementRng(seed, e, tensor_name) for e in ids),
            row_start=row_start,
        )

    def for_rows(self, row_start: int) -> "BlockContext":
        """The same tensor context for the block starting at ``row_start``
        (a shallow copy: cached per-tensor values are kept)."""
        block = copy.copy(self)
        object.__setattr__(block, "row_start", row_start)
        return block

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def row_numel(self) -> int:
        """Elements per row: a 0-d or 1-D tensor is a single row."""
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else self.numel

    @property
    def flat_start(self) -> int:
        """Flat row-major index of the block's first element."""
        return self.row_start * self.row_numel

    @cached_property
    def order(self) -> tuple[int, ...]:
        """Expert indices sorted by expert id: every sum over experts runs in
        this order, so the result does not depend on the order of the spec."""
        return tuple(sorted(range(len(self.expert_ids)), key=lambda i: self.expert_ids[i]))

    def threshold(self, expert: int, density: float) -> TrimThreshold | None:
        return find_threshold(self.thresholds[expert] if self.thresholds else None, density)


def _all_finite(x: torch.Tensor) -> bool:
    """A sum is one cheap pass; only when it is not finite (NaN/Inf present,
    or a sum overflow) is the exact element check run."""
    return x.numel() == 0 or math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def require_finite(x: torch.Tensor, what: str, ctx: BlockContext) -> None:
    """EngineError naming ``what`` if ``x`` has NaN/Inf."""
    if _all_finite(x):
        return
    rows = max(1, x.numel() // max(ctx.row_numel, 1))
    raise EngineError(
        f"{what} of tensor {ctx.tensor_name!r} (rows {ctx.row_start}..{ctx.row_start + rows - 1}) "
        "contains NaN or Inf; the checkpoint is damaged or was saved after an overflow: "
        "fix or re-export it, or leave it out of the merge"
    )


class Operator(ABC):
    """A merge operator. Subclasses set the class attributes and ``_merge``."""

    #: Canonical lower-case name, as in the registry.
    name: ClassVar[str]
    #: False: needs whole tensors (the engine passes them; planned all-or-nothing).
    streaming: ClassVar[bool] = True
    #: True: output = s*B + Σ ci Δi with data-independent ci = coefficient(...).
    fixed_coefficient: ClassVar[bool] = False
    #: "exact", "separable", "consensus" or "none": see the module docstring.
    error_bound: ClassVar[str] = "none"
    #: Parameter names set per expert (or globally as the experts' default).
    expert_params: ClassVar[tuple[str, ...]] = ()
    #: Parameter names set only globally.
    global_params: ClassVar[tuple[str, ...]] = ()
    #: Defaults that differ from params.PARAMS for this operator.
    default_overrides: ClassVar[Mapping[str, Any]] = {}
    #: Negative weights are rejected where a weighted mean or sign election
    #: makes them meaningless.
    nonnegative_weights: ClassVar[bool] = False
    min_experts: ClassVar[int] = 1
    max_experts: ClassVar[int | None] = None

    def __repr__(self) -> str:
        return f"<operator {self.name}>"

    @property
    def defaults(self) -> dict[str, Any]:
        names = (*self.expert_params, *self.global_params)
        return {n: self.default_overrides.get(n, PARAMS[n].default) for n in names}

    # ---- validation (before any I/O) ---------------------------------

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        """ConfigError for anything wrong with ``spec`` for this operator.

        Checks counts, ids, parameter names, the structure of every setting
        and every value it can take. Combinations of parameters (della's
        epsilon vs density, weights summing to 0) depend on the tensor when
        settings use gradients or filters: pass ``tensor_names`` (and
        ``num_layers``) to check them for every tensor; without names they are
        checked when all settings are plain scalars.
        """
        from mergepipe.engine.operators.registry import canonical_name  # the registry imports this module

        if canonical_name(spec.operator) != self.name:
            raise ValueError(f"spec for {spec.operator!r} validated by operator {self.name!r}")
        n = len(spec.experts)
        want = self._count_phrase()
        if n < self.min_experts or (self.max_experts is not None and n > self.max_experts):
            raise ConfigError(f"{self.name} needs {want}, got {n}")
        ids = spec.expert_ids
        if any(not isinstance(e, str) or not e for e in ids):
            raise ConfigError(f"expert ids must be non-empty strings, got {list(ids)!r}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"an expert is listed twice in {list(ids)!r}; list each expert once")
        allowed_global = set(self.expert_params) | set(self.global_params)
        for key, value in spec.params.items():
            if key not in allowed_global:
                raise ConfigError(
                    f"{self.name} does not take parameter {key!r}; it takes: {self._params_phrase()}"
                )
            self._check_leaves(key, value, "global parameters")
        for e in spec.experts:
            for key, value in e.params.items():
                if key in self.global_params:
                    raise ConfigError(
                        f"{key!r} is a global parameter of {self.name}; set it once for the merge, "
                        f"not for expert {e.expert_id!r}"
                    )
                if key not in self.expert_params:
                    raise ConfigError(
                        f"{self.name} does not take parameter {key!r} (expert {e.expert_id!r}); "
                        f"it takes: {self._params_phrase()}"
                    )
                self._check_leaves(key, value, f"expert {e.expert_id!r}")
        if tensor_names:
            for name in tensor_names:
                per_expert, global_ = resolve_for_tensor(spec, name, layer_index(name), num_layers)
                self.check_tensor(per_expert, global_, name)
        elif self._scalar_only(spec):
            per_expert, global_ = resolve_for_tensor(spec, "", None, 0)
            self.check_tensor(per_expert, global_, "every tensor")

    def _count_phrase(self) -> str:
        if self.max_experts == self.min_experts:
            return f"exactly {self.min_experts} expert{'s' if self.min_experts > 1 else ''}"
        return f"at least {self.min_experts} expert{'s' if self.min_experts > 1 else ''}"

    def _params_phrase(self) -> str:
        names = [*self.expert_params, *self.global_params]
        return ", ".join(names) if names else "no parameters"

    def _check_leaves(self, key: str, value: Any, where: str) -> None:
        try:
            for leaf in setting_leaves(value):
                checked = coerce(key, leaf)
                if key == "weight" and self.nonnegative_weights and checked < 0:
                    raise ConfigError(
                        f"weight must be >= 0 for {self.name} (a weighted mean/sign election), got {leaf!r}; "
                        "use task_arithmetic for negative weights"
                    )
        except ConfigError as exc:
            raise ConfigError(f"{self.name}, {where}: {exc}") from None

    @staticmethod
    def _scalar_only(spec: MergeSpec) -> bool:
        settings = [*spec.params.values(), *(v for e in spec.experts for v in e.params.values())]
        return all(isinstance(v, (bool, int, float, str)) for v in settings)

    def check_tensor(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], tensor_name: str) -> None:
        """ConfigError for a combination of resolved parameters that is invalid
        for this tensor. Default: nothing to check."""

    # ---- planning ----------------------------------------------------

    def needs_thresholds(self, expert_params: Mapping[str, Any]) -> list[float]:
        """Densities whose per-tensor TrimThreshold this expert needs."""
        return []

    def streams_with(
        self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any], thresholds_available: bool
    ) -> bool:
        """Whether this tensor can be merged block by block, given whether the
        catalog has every threshold ``needs_thresholds`` asked for. If False
        the engine passes whole tensors (and the op computes thresholds)."""
        if not self.streaming:
            return False
        needs = any(self.needs_thresholds(p) for p in per_expert)
        return thresholds_available or not needs

    def coefficient(self, per_expert: Sequence[Mapping[str, Any]], global_: Mapping[str, Any]) -> list[float]:
        """Per-expert ``beta`` of the error bound (see the module docstring);
        for fixed-coefficient operators the exact signed multiplier of Δi."""
        return [math.inf] * len(per_expert)

    # ---- merging -----------------------------------------------------

    def merge(self, base: torch.Tensor, deltas: Sequence[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        """The merged fp32 block (base + merged delta), same shape as ``base``."""
        if len(deltas) != len(ctx.expert_ids):
            raise ValueError(f"{self.name}: {len(deltas)} deltas for {len(ctx.expert_ids)} experts")
        if base.dtype != torch.float32:
            raise ValueError(f"{self.name}: base block must be float32, got {base.dtype}")
        n = base.numel()
        if ctx.row_numel and (n % ctx.row_numel or ctx.flat_start + n > ctx.numel):
            raise ValueError(
                f"{self.name}: block of {n} elements at row {ctx.row_start} does not fit "
                f"tensor {ctx.tensor_name!r} of shape {ctx.shape} in whole rows"
            )
        if not self.streaming and n != ctx.numel:
            raise ValueError(f"{self.name} is tensor-level: pass the whole tensor {ctx.tensor_name!r}")
        for expert_id, d in zip(ctx.expert_ids, deltas):
            if d is not None and (d.shape != base.shape or d.dtype != torch.float32):
                raise ValueError(
                    f"{self.name}: delta of expert {expert_id!r} has shape {tuple(d.shape)} {d.dtype}, "
                    f"expected {tuple(base.shape)} float32"
                )
        if not self.streaming:
            self._require_finite_inputs(base, deltas, ctx)
        out = self._merge(base, list(deltas), ctx)
        if not _all_finite(out):
            # Streaming operators let every input value flow into the output
            # through arithmetic (masks multiply: NaN * 0 = NaN), so checking
            # the output alone catches any NaN/Inf input for one pass instead
            # of K + 1; only now find which input it was.
            self._require_finite_inputs(base, deltas, ctx)
            rows = max(1, n // max(ctx.row_numel, 1))
            raise EngineError(
                f"merging tensor {ctx.tensor_name!r} (rows {ctx.row_start}..{ctx.row_start + rows - 1}) "
                f"with {self.name} overflowed to Inf; check the weights and lambda"
            )
        return out

    @staticmethod
    def _require_finite_inputs(base: torch.Tensor, deltas: Sequence[torch.Tensor | None], ctx: BlockContext) -> None:
        require_finite(base, "the base", ctx)
        for expert_id, d in zip(ctx.expert_ids, deltas):
            if d is not None:
                require_finite(d, f"the delta of expert {expert_id!r}", ctx)

    @abstractmethod
    def _merge(self, base: torch.Tensor, deltas: list[torch.Tensor | None], ctx: BlockContext) -> torch.Tensor:
        ...

    def _is_whole(self, block: torch.Tensor, ctx: BlockContext) -> bool:
        return ctx.row_start == 0 and block.numel() == ctx.numel
