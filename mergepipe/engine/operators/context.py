"""What a kernel knows about the block it merges, and the finiteness checks.

A kernel merges one block of one tensor (or the whole tensor, for
tensor-level operators) from the fp32 base block and, per expert, the fp32
delta block ``Δi = Ei - B`` or ``None`` ("not read": ``Δi = 0`` for this
block). It never does I/O and keeps no state between calls. Everything else
it needs is in the ``BlockContext``: the operator's definition and typed
parameters for this tensor, the trim thresholds from the catalog, one
element-addressed random stream per expert, and where the block starts.

All arithmetic is separate IEEE fp32 multiplies/adds/divides in a fixed
order (experts sorted by id), never fused multiply-adds, whose rounding
differs between CPU builds (checked: ``torch.add(alpha=)`` gives other bits
under ``ATEN_CPU_CAPABILITY=default`` than under avx2). So the bits of a
streaming result depend on neither block size, expert order, thread count
nor CPU. Tensor-level operators (slerp, model_stock) reduce whole tensors in
float64 to get their scalar coefficients; torch may order such sums
differently with another thread count, which can move a coefficient in its
last float64 bits.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

import torch

from mergepipe.engine.rng import ElementRng
from mergepipe.errors import EngineError
from mergepipe.spec.operators import OperatorDef, TensorParams
from mergepipe.spec.settings import family
from mergepipe.spec.operators import TrimThreshold, find_threshold


@dataclass(frozen=True)
class BlockContext:
    """Everything a kernel needs to merge one block of one tensor.

    Per-expert tuples are in the spec's expert order, the same order as the
    ``deltas`` given to the kernel. ``thresholds[i]`` maps a density to
    expert i's TrimThreshold for this tensor (from the catalog); a missing
    entry makes the kernel compute it, which needs the whole tensor.
    """

    tensor_name: str
    shape: tuple[int, ...]
    expert_ids: tuple[str, ...]
    definition: OperatorDef
    params: TensorParams
    thresholds: tuple[Mapping[float, TrimThreshold] | None, ...] = ()
    rngs: tuple[ElementRng, ...] = ()
    row_start: int = 0
    #: the kernel may overwrite the delta blocks it is given (the engine's: made for this one call);
    #: a caller that reuses its deltas (the tests' references) leaves this False
    owns_deltas: bool = False

    @classmethod
    def create(
        cls,
        definition: OperatorDef,
        tensor_name: str,
        shape: Sequence[int],
        expert_ids: Sequence[str],
        params: TensorParams,
        *,
        seed: int,
        thresholds: Sequence[Mapping[float, TrimThreshold] | None] | None = None,
        owns_deltas: bool = False,
    ) -> BlockContext:
        """A context for a whole tensor, with one ElementRng per expert from ``seed``."""
        ids = tuple(expert_ids)
        if len(params.experts) != len(ids):
            raise ValueError("params must have one entry per expert")
        thr = tuple(thresholds) if thresholds is not None else (None,) * len(ids)
        if len(thr) != len(ids):
            raise ValueError("thresholds must have one entry per expert")
        return cls(
            tensor_name=tensor_name,
            shape=tuple(int(s) for s in shape),
            expert_ids=ids,
            definition=definition,
            params=params,
            thresholds=thr,
            rngs=tuple(ElementRng(seed, family(e), tensor_name) for e in ids),  # versions share a stream
            owns_deltas=owns_deltas,
        )

    def for_rows(self, row_start: int) -> BlockContext:
        """The same tensor context for the block starting at ``row_start``
        (a shallow copy: cached per-tensor values are kept)."""
        block = copy.copy(self)
        object.__setattr__(block, "row_start", row_start)
        return block

    @property
    def expert_params(self) -> tuple[Any, ...]:
        return self.params.experts

    @property
    def global_params(self) -> Any:
        return self.params.global_

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

    def is_whole(self, block: torch.Tensor) -> bool:
        """Whether ``block`` is the whole tensor (tensor-level steps need it)."""
        return self.row_start == 0 and block.numel() == self.numel


def all_finite(x: torch.Tensor) -> bool:
    """A sum is one cheap pass; only when it is not finite (NaN/Inf present,
    or a sum overflow) is the exact element check run."""
    return x.numel() == 0 or math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def require_finite(x: torch.Tensor, what: str, ctx: BlockContext) -> None:
    """EngineError naming ``what`` if ``x`` has NaN/Inf."""
    if all_finite(x):
        return
    rows = max(1, x.numel() // max(ctx.row_numel, 1))
    raise EngineError(
        f"{what} of tensor {ctx.tensor_name!r} (rows {ctx.row_start}..{ctx.row_start + rows - 1}) "
        "contains NaN or Inf; the checkpoint is damaged or was saved after an overflow: "
        "fix or re-export it, or leave it out of the merge"
    )
