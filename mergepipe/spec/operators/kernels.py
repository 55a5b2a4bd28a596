"""The math methods share (torch imported inside functions): ``merge``, the checked entry point; the two ways
deltas combine (``weighted_sum``, ``sign_consensus``); magnitude trims; the families ``Sparsified`` and
``SignElection``. Every sum runs in IEEE fp32 in expert-id order, never as a fused multiply-add."""

from __future__ import annotations

import math
from typing import Annotated, Any, Sequence

from mergepipe.errors import EngineError
from mergepipe.spec.operators.base import BlockContext, Normalize, OperatorDef, ParamDef, ScaledSum, Tensor
from mergepipe.spec.operators.base import TensorParams, TrimThreshold, kept_count, linear_coefficients

#: mergekit leaves the L1-rescaled delta unscaled when either norm is below this.
L1_EPS = 1e-7


def merge(base: Tensor, deltas: Sequence[Tensor | None], ctx: BlockContext) -> Tensor:
    """The merged fp32 block of ``ctx``'s operator, same shape as ``base``. A streaming kernel carries every
    input value to its output (NaN * 0 = NaN), so one pass over the output finds a NaN or Inf, and only
    then are the inputs scanned to name it; tensor-level kernels check their inputs first."""
    import torch

    name = ctx.definition.name
    if len(deltas) != len(ctx.expert_ids):
        raise ValueError(f"{name}: {len(deltas)} deltas for {len(ctx.expert_ids)} experts")
    if base.dtype != torch.float32:
        raise ValueError(f"{name}: base block must be float32, got {base.dtype}")
    n = base.numel()
    if ctx.row_numel and (n % ctx.row_numel or ctx.flat_start + n > ctx.numel):
        raise ValueError(
            f"{name}: block of {n} elements at row {ctx.row_start} does not fit "
            f"tensor {ctx.tensor_name!r} of shape {tuple(ctx.shape)} in whole rows"
        )
    streaming = ctx.definition.streaming
    if not streaming and n != ctx.numel:
        raise ValueError(f"{name} is tensor-level: pass the whole tensor {ctx.tensor_name!r}")
    for expert_id, d in zip(ctx.expert_ids, deltas):
        if d is not None and (d.shape != base.shape or d.dtype != torch.float32 or d.device != base.device):
            raise ValueError(
                f"{name}: delta of expert {expert_id!r} is {tuple(d.shape)} {d.dtype} on {d.device}, "
                f"expected {tuple(base.shape)} float32 on {base.device}"
            )
    if not streaming:
        _require_finite_inputs(base, deltas, ctx)
    out = ctx.definition.kernel(base, list(deltas), ctx)
    if not all_finite(out):
        _require_finite_inputs(base, deltas, ctx)
        rows = max(1, n // max(ctx.row_numel, 1))
        raise EngineError(
            f"merging tensor {ctx.tensor_name!r} (rows {ctx.row_start}..{ctx.row_start + rows - 1}) "
            f"with {name} overflowed to Inf; check the weights and lambda"
        )
    return out


def _require_finite_inputs(base: Tensor, deltas: Sequence[Tensor | None], ctx: BlockContext) -> None:
    require_finite(base, "the base", ctx)
    for expert_id, d in zip(ctx.expert_ids, deltas):
        if d is not None:
            require_finite(d, f"the delta of expert {expert_id!r}", ctx)


def all_finite(x: Tensor) -> bool:
    """One cheap sum; the exact element check only when it is not finite (NaN/Inf, or a sum overflow)."""
    import torch

    return x.numel() == 0 or math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def require_finite(x: Tensor, what: str, ctx: BlockContext) -> None:
    """EngineError naming ``what`` if ``x`` has NaN/Inf."""
    if all_finite(x):
        return
    rows = max(1, x.numel() // max(ctx.row_numel, 1))
    raise EngineError(
        f"{what} of tensor {ctx.tensor_name!r} (rows {ctx.row_start}..{ctx.row_start + rows - 1}) "
        "contains NaN or Inf; the checkpoint is damaged or was saved after an overflow: "
        "fix or re-export it, or leave it out of the merge"
    )


def weighted_sum(base: Tensor, terms: Sequence[tuple[float, Tensor | None]], base_scale: float = 1.0) -> Tensor:
    """``base * base_scale + Σ c * x`` over the terms whose x is not None: each ``x * c`` rounded to fp32,
    summed left to right, then added to the base."""
    import torch

    acc: Tensor | None = None
    scratch: Tensor | None = None
    for coef, x in terms:
        if x is None:
            continue
        if acc is None:
            acc = x * coef
        elif coef == 1.0:  # x * 1.0 is x, bit for bit: skip the pass
            acc.add_(x)
        else:
            scratch = x * coef if scratch is None else torch.mul(x, coef, out=scratch)
            acc.add_(scratch)
    start = base * base_scale if base_scale != 1.0 else base
    return start.clone() if acc is None else acc.add_(start)  # == start + acc (addition commutes)


def sign_consensus(
    base: Tensor,
    terms: Sequence[tuple[float, Tensor | None]],
    normalize: bool,
    lam: float,
    owned: bool = False,
) -> Tensor:
    """TIES: with ``y_i = w_i x_i`` and σ = sign(Σ y_i) (0 -> +), ``base + λ Σ_agreeing y_i`` divided by
    the agreeing weights with ``normalize`` (none agreeing: by 1); mergekit's ``get_mask(method="sum")``.
    Without bool masks: ``r_i = relu(σ y_i)``, ``m = σ Σ r_i``, agreeing weight ``Σ w_i sign(r_i)``; the
    same bits. ``owned``: the terms may be scaled in place (one term is never added into another)."""
    import torch

    present = [(w, x) for w, x in terms if x is not None]
    if not present:
        return base.clone()
    ys = [x if w == 1.0 else x.mul_(w) if owned else x * w for w, x in present]  # x * 1.0 is x, bit for bit
    total = ys[0] + ys[1] if len(ys) > 1 else ys[0].clone()
    for y in ys[2:]:
        total.add_(y)
    sigma = torch.copysign(total.new_ones(()), total, out=total)  # +1 / -1, in total's memory
    agreeing: Tensor | None = None
    divisor: Tensor | None = None
    agrees: Tensor | None = None
    for (w, x), y in zip(present, ys):
        mine = owned or y is not x  # never write the caller's tensor
        r = (y.mul_(sigma) if mine else y * sigma).relu_()
        agreeing = (r.clone() if owned else r) if agreeing is None else agreeing.add_(r)
        if normalize:
            agrees = torch.sign(r, out=agrees)  # 1 where expert i agrees, else 0
            # the product in add(alpha=) is w * 0 or w * 1, exact: fused or not, the same bits
            divisor = agrees * w if divisor is None else divisor.add_(agrees, alpha=w)
    assert agreeing is not None  # present is not empty
    if divisor is not None:
        # a sum of agreeing fp32 weights is 0 or at least the smallest positive one: raising the zeros to
        # the smallest normal float makes them divide the numerator's zeros to 0 in one pass
        smallest = torch.finfo(torch.float32).tiny
        if all(w == 0 or w >= smallest for w, _ in present):
            divisor.clamp_min_(smallest)
        else:
            divisor.masked_fill_(divisor == 0, 1.0)
        agreeing.div_(divisor)
    agreeing.mul_(sigma)
    return (agreeing if lam == 1.0 else agreeing.mul_(lam)).add_(base)  # == base + m·λ (addition commutes)


def top_k(values: Tensor, k: int, density: float = 0.0) -> TrimThreshold:
    """The threshold keeping the ``k`` largest of a flat fp32 tensor, ties first in row-major order
    (a stable descending sort's first k); none for ``k <= 0``."""
    import torch

    if k <= 0:
        return TrimThreshold(density, 0, math.inf, -1)
    tau = torch.kthvalue(values, values.numel() - k + 1).values  # its bits do not depend on ties
    room = k - int((values > tau).sum())
    return TrimThreshold(density, k, float(tau), int(torch.nonzero(values == tau)[room - 1]))


def keep_mask(abs_block: Tensor, flat_start: int, thr: TrimThreshold) -> Tensor:
    """Which entries of a block a trim keeps; ``flat_start``: the block's first flat index in its tensor."""
    import torch

    above = abs_block > thr.tau
    n = abs_block.numel()
    if thr.last_index < flat_start:
        return above
    if thr.last_index >= flat_start + n - 1:
        return above | (abs_block == thr.tau)
    index = torch.arange(flat_start, flat_start + n, dtype=torch.int64, device=abs_block.device).view(abs_block.shape)
    return above | ((abs_block == thr.tau) & (index <= thr.last_index))


def trimmed(block: Tensor, flat_start: int, thr: TrimThreshold, in_place: bool = False) -> Tensor:
    """``block`` (signed Δ) with what ``keep_mask`` drops set to +0.0, in one ``hardshrink`` pass each side of
    the tie index p (``|d| > t``: tau after p, the fp32 value just below tau up to it)."""
    import numpy as np
    import torch

    below_tau = float(np.nextafter(np.float32(thr.tau), np.float32(-np.inf)))  # |d| > below ⇔ |d| >= tau
    keep_ties = min(max(thr.last_index - flat_start + 1, 0), block.numel())  # entries [0, keep_ties) keep ties
    if keep_ties in (0, block.numel()):
        return torch.hardshrink(block, below_tau if keep_ties else thr.tau, out=block if in_place else None)
    flat = block.reshape(-1)
    out = flat if in_place and block.is_contiguous() else torch.empty_like(flat)  # flat: a view of block then
    torch.hardshrink(flat[:keep_ties], below_tau, out=out[:keep_ties])
    torch.hardshrink(flat[keep_ties:], thr.tau, out=out[keep_ties:])
    return out.view(block.shape)


def magnitude_keeps(abs_block: Tensor, ctx: BlockContext, expert: int, fractions: Sequence[float]) -> list[Tensor]:
    """Keep masks of ``abs_block`` (|Δ| of expert ``expert``) for each fraction: with the catalog's
    thresholds, else with thresholds computed here from the whole tensor."""
    thresholds = [ctx.threshold(expert, f) for f in fractions]
    if None in thresholds:
        if not ctx.is_whole(abs_block):
            missing = [f for f, t in zip(fractions, thresholds) if t is None]
            raise EngineError(
                f"no trim threshold at density {missing} for tensor {ctx.tensor_name!r} of expert "
                f"{ctx.expert_ids[expert]!r}, and only a block was given; the engine must pass the "
                "whole tensor when streams_with() is False (run `mergepipe analyze` to store thresholds)"
            )
        require_finite(abs_block, f"the delta of expert {ctx.expert_ids[expert]!r}", ctx)
        flat = abs_block.reshape(-1)
        thresholds = [
            top_k(flat, kept_count(f, ctx.numel), f) if t is None else t for f, t in zip(fractions, thresholds)
        ]
    return [keep_mask(abs_block, ctx.flat_start, t) for t in thresholds if t is not None]


def magnitude_trim(delta: Tensor, ctx: BlockContext, expert: int, fraction: float) -> Tensor:
    """``delta`` with all but the tensor's top ``fraction`` by |Δ| zeroed."""
    threshold = ctx.threshold(expert, fraction)
    if threshold is None:
        (keep,) = magnitude_keeps(delta.abs(), ctx, expert, [fraction])
        return delta * keep
    return trimmed(delta, ctx.flat_start, threshold, in_place=ctx.owns_deltas)


RESCALE = ParamDef(
    "rescale",
    "DARE/DELLA: rescale survivors by 1/p (inverse), to the L1 norm (l1) or not (none)",
    choices=("inverse", "l1", "none"),
    flag=True,
)
Rescale = Annotated[str, RESCALE]


class RescaledSum(ScaledSum):
    rescale: Rescale = "inverse"


class RescaledMean(RescaledSum):
    normalize: Normalize = True


class Sparsified(OperatorDef):
    """Each expert's Δ sparsified on its own (``sparsify``), then ``B + Σ ci xi`` with linear coefficients.
    With ``rescale`` (DARE, DELLA) survivors are divided by their keep probability (``inverse``: at most
    1 / ``keep_probability``), or scaled to the L1 norm of the whole Δ (``l1``: tensor-level, no bound)."""

    error_bound = "separable"

    def sparsify(self, delta: Tensor, ctx: BlockContext, expert: int) -> Tensor:
        raise NotImplementedError

    def keep_probability(self, expert: Any) -> float:
        """The smallest probability with which an entry is kept (the inverse rescale's largest gain)."""
        return float(expert.density)

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        g = params.global_
        return linear_coefficients([e.weight for e in params.experts], g.lambda_, g.normalize, self.name, tensor_name)

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.coefficients(params, tensor_name)

    def absent_neutral(self, params: TensorParams) -> bool:
        return params.global_.normalize is False  # λ wi: no sum over every expert's weight

    def l1_rescaled(self, params: TensorParams) -> bool:
        return getattr(params.global_, "rescale", None) == "l1"

    def streams_with(self, params: TensorParams, thresholds_available: bool) -> bool:
        return not self.l1_rescaled(params) and super().streams_with(params, thresholds_available)

    def gain(self, expert: Any, params: TensorParams) -> float:
        """Largest factor the rescale applies to a kept entry (1: none)."""
        inverse = getattr(params.global_, "rescale", None) == "inverse" and expert.density < 1.0
        return 1.0 / self.keep_probability(expert) if inverse else 1.0

    def beta(self, params: TensorParams) -> list[float]:
        if self.l1_rescaled(params):  # a per-tensor factor: no per-element bound
            return [math.inf] * len(params.experts)
        return [abs(c) * self.gain(e, params) for c, e in zip(self.coefficients(params), params.experts)]

    def rescaled(self, delta: Tensor, kept: Tensor, ctx: BlockContext) -> Tensor:
        """``kept`` scaled by ``||Δ||_1 / ||kept||_1`` (float64 sums; unscaled when either is below ``L1_EPS``)
        with ``rescale: l1``, which needs the whole tensor; else as it is."""
        import torch

        if ctx.params.global_.rescale != "l1":
            return kept
        if not ctx.is_whole(delta):
            raise ValueError(f"{self.name} with rescale l1 is tensor-level: pass the whole tensor")
        before = float(delta.abs().sum(dtype=torch.float64))
        after = float(kept.abs().sum(dtype=torch.float64))
        return kept if before < L1_EPS or after < L1_EPS else kept * (before / after)

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        return self.combine(base, [None if d is None else self.sparsify(d, ctx, i) for i, d in enumerate(deltas)], ctx)

    def combine(self, base: Tensor, xs: list[Tensor | None], ctx: BlockContext) -> Tensor:
        coefs = self.coefficients(ctx.params, ctx.tensor_name)
        return weighted_sum(base, [(coefs[i], xs[i]) for i in ctx.order])


class SignElection(Sparsified):
    """Sparsified, then TIES' sign election and disjoint mean (``sign_consensus``): mergekit's ``*_ties``."""

    error_bound = "consensus"
    nonnegative_weights = True

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        pass  # normalize divides by the agreeing weights: no sum to check

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # sign election and the agreeing-weight divisor see only the deltas present

    def beta(self, params: TensorParams) -> list[float]:
        if self.l1_rescaled(params):
            return [math.inf] * len(params.experts)
        g = params.global_
        return [abs(g.lambda_) * (1.0 if g.normalize else abs(e.weight)) * self.gain(e, params) for e in params.experts]

    def combine(self, base: Tensor, xs: list[Tensor | None], ctx: BlockContext) -> Tensor:
        g = ctx.params.global_
        terms = [(ctx.params.experts[i].weight, xs[i]) for i in ctx.order]
        return sign_consensus(base, terms, g.normalize, g.lambda_, owned=ctx.owns_deltas)
