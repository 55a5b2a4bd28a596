"""The operator definitions and the one registry of operator names.

Each definition says which parameters the operator takes (typed dataclasses
of ``param()`` fields), how it streams and which error bound it admits. The
formulas, references and every intentional difference from mergekit are in
the docstring of the operator's kernel, ``engine/operators/<family>.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from mergepipe.errors import ConfigError
from mergepipe.spec.merge_spec import MergeSpec
from mergepipe.spec.operator import OperatorDef, TensorParams
from mergepipe.spec.params import NoParams, ParamSet, param

# ----------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Weighted(ParamSet):
    weight: float = param("weight")


@dataclass(frozen=True)
class Trimmed(ParamSet):
    weight: float = param("weight")
    density: float = param("density")


@dataclass(frozen=True)
class Crumbs(ParamSet):
    weight: float = param("weight")
    density: float = param("density")
    gamma: float = param("gamma")


@dataclass(frozen=True)
class Magprune(ParamSet):
    weight: float = param("weight")
    density: float = param("density")
    epsilon: float = param("epsilon")


@dataclass(frozen=True)
class Averaged(ParamSet):
    normalize: bool = param("normalize", True)
    # mergekit's linear averages the models it lists: the base too where it is one of them (spec/mergekit.py)
    base_weight: float = param("base_weight", 0.0, low=0.0,
                               doc="Linear: the base's weight among the averaged models (mergekit's linear without "
                                   "base_model, or with it listed among the models); 0: the base is not one of them")


@dataclass(frozen=True)
class ScaledSum(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", False)


@dataclass(frozen=True)
class ScaledMean(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", True)


@dataclass(frozen=True)
class RescaledSum(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", False)
    rescale: str = param("rescale")


@dataclass(frozen=True)
class RescaledMean(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", True)
    rescale: str = param("rescale")


@dataclass(frozen=True)
class Interpolation(ParamSet):
    t: float = param("t")


@dataclass(frozen=True)
class Stock(ParamSet):
    filter_wise: bool = param("filter_wise")


# -------------------------------------------------------------- shared rules


def linear_coefficients(
    weights: Sequence[float], lam: float, normalize: bool, op_name: str, tensor_name: str = "this tensor"
) -> list[float]:
    """``ci = λ wi / Σw`` (normalize) or ``λ wi``, in float64.

    The sum is exactly rounded (``math.fsum``), so it does not depend on the
    order of the experts.
    """
    if not normalize:
        return [lam * w for w in weights]
    total = math.fsum(weights)
    if abs(total) < 1e-8:
        raise ConfigError(
            f"{op_name}: the expert weights sum to {total!r} for {tensor_name}, so they cannot be "
            "normalised; change the weights or set normalize: false"
        )
    return [lam * w / total for w in weights]


def band_fractions(gamma: float, density: float) -> tuple[float, float]:
    """Breadcrumbs ``(top, outer)``: the kept band lies between these two trim fractions."""
    return min(gamma, 1.0 - density), min(gamma + density, 1.0)


# -------------------------------------------------------------- definitions


class LinearDef(OperatorDef):
    name = "linear"
    summary = "weighted average of the experts (and of the base, with base_weight): B + Σ wi Δi / Σw"
    # declared as the base's (any ParamSet): avg and task_arithmetic take others
    expert_params: ClassVar[type[ParamSet]] = Weighted
    global_params: ClassVar[type[ParamSet]] = Averaged
    error_bound = "exact"
    nonnegative_weights = True
    delta_updatable = True

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        """The signed multiplier of each expert's delta: wi / Σw, the base's weight in the sum (the base
        is one of the averaged models, with Δ = 0), or wi."""
        weights = [e.weight for e in params.experts]
        every = [*weights, params.global_.base_weight]  # + 0.0 leaves an exactly rounded sum as it was
        return linear_coefficients(every, 1.0, params.global_.normalize, self.name, tensor_name)[:-1]

    def base_scale(self, params: TensorParams) -> float:
        """Multiplier of B in the output: 1, or Σw (the base's weight included) without normalize."""
        if params.global_.normalize:
            return 1.0
        return math.fsum([*(e.weight for e in params.experts), params.global_.base_weight])

    def keeps_base(self, params: TensorParams) -> bool:
        return self.base_scale(params) == 1.0  # Σw·B without normalize: the base's only where Σw = 1

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.coefficients(params, tensor_name)

    def beta(self, params: TensorParams) -> list[float]:
        return [abs(c) for c in self.coefficients(params)]


class AvgDef(LinearDef):
    name = "avg"
    summary = "plain average of the experts: B + Σ Δi / K"
    expert_params = NoParams
    global_params = NoParams

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        return [1.0 / len(params.experts)] * len(params.experts)

    def base_scale(self, params: TensorParams) -> float:
        return 1.0


class TaskArithmeticDef(LinearDef):
    name = "task_arithmetic"
    summary = "sum of weighted task vectors: B + λ Σ wi Δi (negative weights allowed)"
    global_params = ScaledSum
    nonnegative_weights = False

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        weights = [e.weight for e in params.experts]
        g = params.global_
        return linear_coefficients(weights, g.lambda_, g.normalize, self.name, tensor_name)

    def base_scale(self, params: TensorParams) -> float:
        return 1.0

    def absent_neutral(self, params: TensorParams) -> bool:
        return not params.global_.normalize  # λ wi: no sum over all experts' weights


class TiesDef(OperatorDef):
    name = "ties"
    summary = "trim each delta to its top density, elect signs, disjoint mean"
    expert_params = Trimmed
    global_params = ScaledMean
    error_bound = "consensus"
    nonnegative_weights = True

    def needs_thresholds(self, expert: Trimmed) -> tuple[float, ...]:
        return (expert.density,) if expert.density < 1.0 else ()

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # sign election and the agreeing-weight divisor see only the deltas present

    def beta(self, params: TensorParams) -> list[float]:
        g = params.global_
        return [abs(g.lambda_) * (1.0 if g.normalize else abs(e.weight)) for e in params.experts]


class SparsifyThenSumDef(OperatorDef):
    """Per-expert sparsification, then ``B + Σ ci xi`` with linear coefficients."""

    error_bound = "separable"

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        weights = [e.weight for e in params.experts]
        g = params.global_
        return linear_coefficients(weights, g.lambda_, g.normalize, self.name, tensor_name)

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.coefficients(params, tensor_name)

    def absent_neutral(self, params: TensorParams) -> bool:
        return getattr(params.global_, "normalize", True) is False  # λ wi: no sum over all weights

    def gain(self, expert: ParamSet, params: TensorParams) -> float:
        """Largest factor the rescaling applies to a kept entry (1: none)."""
        return 1.0

    def l1_rescaled(self, params: TensorParams) -> bool:
        """Whether survivors are rescaled to the whole tensor's L1 norm (tensor-level)."""
        return getattr(params.global_, "rescale", None) == "l1"

    def beta(self, params: TensorParams) -> list[float]:
        if self.l1_rescaled(params):  # a per-tensor factor: no per-element bound
            return [math.inf] * len(params.experts)
        return [abs(c) * self.gain(e, params) for c, e in zip(self.coefficients(params), params.experts)]


class SparsifyThenConsensusDef(SparsifyThenSumDef):
    """Per-expert sparsification, then TIES sign election and disjoint mean."""

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
        return [
            abs(g.lambda_) * (1.0 if g.normalize else abs(e.weight)) * self.gain(e, params)
            for e in params.experts
        ]


class RandomDropDef(SparsifyThenSumDef):
    """DARE and DELLA: entries kept at random, survivors rescaled by 1/p, l1 or not.

    They need no thresholds, so they stream unless the L1 rescale needs whole tensors.
    """

    global_params: ClassVar[type[ParamSet]] = RescaledSum  # DELLA's mean takes RescaledMean
    random = True

    def streams_with(self, params: TensorParams, thresholds_available: bool) -> bool:
        return not self.l1_rescaled(params)

    # ``expert`` is one of the operator's own ``expert_params`` (each subclass names its class), as in
    # ``needs_thresholds``: typed Any here so that a subclass may declare its own.
    def min_keep_probability(self, expert: Any) -> float:
        raise NotImplementedError

    def gain(self, expert: Any, params: TensorParams) -> float:
        """Largest factor the rescale applies to a kept entry: 1 / the smallest keep probability."""
        inverse = params.global_.rescale == "inverse" and expert.density < 1.0
        return 1.0 / self.min_keep_probability(expert) if inverse else 1.0


class DareLinearDef(RandomDropDef):
    name = "dare_linear"
    summary = "drop delta entries at random (keep density), rescale, sum"
    expert_params = Trimmed

    def min_keep_probability(self, expert: Trimmed) -> float:
        return expert.density


class DareTiesDef(SparsifyThenConsensusDef, DareLinearDef):
    name = "dare_ties"
    summary = "DARE's random drop, then TIES sign election"


class BreadcrumbsDef(SparsifyThenSumDef):
    name = "breadcrumbs"
    summary = "drop the largest (gamma) and smallest delta entries, keep a density band, sum"
    expert_params = Crumbs
    global_params = ScaledSum

    def needs_thresholds(self, expert: Crumbs) -> tuple[float, ...]:
        if expert.density >= 1.0:
            return ()
        return tuple(f for f in band_fractions(expert.gamma, expert.density) if 0.0 < f < 1.0)


class BreadcrumbsTiesDef(SparsifyThenConsensusDef, BreadcrumbsDef):
    name = "breadcrumbs_ties"
    summary = "breadcrumbs' band, then TIES sign election"


class DellaLinearDef(RandomDropDef):
    name = "della_linear"
    summary = "drop entries with a probability that falls with magnitude rank (MAGPRUNE), rescale, sum"
    expert_params = Magprune

    def min_keep_probability(self, expert: Magprune) -> float:
        return expert.density - expert.epsilon

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.check_epsilon(params.experts, tensor_name)
        super().check_tensor(params, tensor_name)

    def check_epsilon(self, experts: Sequence[Magprune], tensor_name: str) -> None:
        for e in experts:
            d, eps = e.density, e.epsilon
            if d < 1.0 and not (d - eps > 0.0 and d + eps < 1.0):
                raise ConfigError(
                    f"{self.name}: density {d!r} +- epsilon {eps!r} must stay inside (0, 1) for {tensor_name}; "
                    "lower epsilon or move density away from 0 and 1"
                )


class DellaDef(SparsifyThenConsensusDef, DellaLinearDef):
    name = "della"
    summary = "DELLA's MAGPRUNE drop, then TIES sign election"
    global_params = RescaledMean

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.check_epsilon(params.experts, tensor_name)


class SlerpDef(OperatorDef):
    name = "slerp"
    summary = "spherical interpolation between the base and one expert, per tensor"
    global_params = Interpolation
    streaming = False
    min_experts = 1
    max_experts = 1


class ModelStockDef(OperatorDef):
    name = "model_stock"
    summary = "average of the experts moved toward the base by their mutual cosine, per tensor (or row)"
    global_params = Stock
    streaming = False
    min_experts = 2


# ------------------------------------------------------ two-model fusions


@dataclass(frozen=True)
class SwapDistance(ParamSet):
    # mergekit's t here is a distance with no upper end (0.001 is typical), not slerp's fraction
    t: float = param("t", high=None, doc="NearSwap: the distance |E - B| up to which the expert's value is taken")


class NearswapDef(OperatorDef):
    """Element-wise: each entry's weight depends on its own |Δ| only, w |Δ| <= |Δ|, so it streams and an
    unread block is the base's (beta 1)."""

    name = "nearswap"
    summary = "take the expert's value where it is within t of the base's, a step of t toward it elsewhere"
    global_params = SwapDistance
    error_bound = "separable"
    min_experts = 1
    max_experts = 1

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        super().validate(spec, tensor_names, num_layers)
        if "t" not in spec.params:  # no default means anything: 0.5 would take nearly every entry whole
            raise ConfigError("nearswap needs t, the distance |E - B| up to which the expert's value is taken "
                              "(e.g. 0.001); mergekit requires it too")

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # an unread block is the base's

    def beta(self, params: TensorParams) -> list[float]:
        return [1.0]


class ArceeFusionDef(OperatorDef):
    """Tensor-level: the importance threshold is a quantile of the whole tensor, so a partial budget
    fuses whole tensors or keeps them as the base's."""

    name = "arcee_fusion"
    summary = "keep the expert's changes whose importance (|Δ| x its row's softmax KL) is an outlier, per tensor"
    streaming = False
    budget_note = ("arcee_fusion fuses whole tensors: each is read whole or not at all (then it keeps the base's "
                   "values), since its importance threshold is a quantile of the whole tensor")
    min_experts = 1
    max_experts = 1


# ---------------------------------------- variance selection, agent merging


@dataclass(frozen=True)
class VarianceSelection(ParamSet):
    select_topk: float = param("select_topk")


#: RAM's epsilon is mergekit's global threshold on |Δ|, not DELLA's per-expert spread of the same name.
_RAM_EPSILON: dict[str, Any] = {"scope": "global", "high": None, "high_open": False,
                                "doc": "RAM: |Δ| above which an entry counts as changed by the expert"}


@dataclass(frozen=True)
class ChangeThreshold(ParamSet):
    epsilon: float = param("epsilon", 1e-5, **_RAM_EPSILON)


@dataclass(frozen=True)
class ReinforcedThreshold(ParamSet):
    r: float = param("r")
    alpha: float = param("alpha")
    epsilon: float = param("epsilon", 1e-5, **_RAM_EPSILON)


class SceDef(OperatorDef):
    """Tensor-level: the variance selection and the experts' weights need every expert's whole tensor."""

    name = "sce"
    summary = "keep the entries that vary most across the experts, weight experts by energy, erase minority signs"
    global_params = VarianceSelection
    streaming = False
    budget_note = ("sce merges whole tensors, each from every expert or not at all (then it keeps the base's "
                   "values); an expert tensor a delta-store plan leaves unread counts as Δ = 0 among the experts "
                   "(its zeros enter the variance; its weight is 0)")


class RamDef(OperatorDef):
    """Element-wise, so it streams: each entry keeps the deltas that changed it, whole or divided by their
    count, so |m_j| <= Σ |Δi_j| (beta 1, a consensus bound), and an unread expert takes no part."""

    name = "ram"
    summary = "keep each expert's changed entries (|Δ| > epsilon); the mean where several experts changed one"
    global_params = ChangeThreshold
    error_bound = "consensus"

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # Δ = 0 changes no entry and counts for none

    def beta(self, params: TensorParams) -> list[float]:
        return [1.0] * len(params.experts)


class RamPlusTlDef(OperatorDef):
    """Tensor-level: each expert's gain counts its shared and unique entries over the whole tensor."""

    name = "ramplus_tl"
    summary = "RAM, each expert's unique entries scaled by 1 + r min(shared/unique, alpha) per tensor"
    global_params = ReinforcedThreshold
    streaming = False
    budget_note = ("ramplus_tl merges whole tensors, each from every expert or not at all (then it keeps the "
                   "base's values); an expert tensor a delta-store plan leaves unread takes no part in it")

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # Δ = 0 changes no entry and counts for none


# ------------------------------------------------------------ spherical means


@dataclass(frozen=True)
class NuSlerpParams(ParamSet):
    nuslerp_flatten: bool = param("nuslerp_flatten")
    nuslerp_row_wise: bool = param("nuslerp_row_wise")
    task_vectors: bool = param("task_vectors")
    base_weight: float = param("base_weight")


@dataclass(frozen=True)
class MultiSlerpParams(ParamSet):
    normalize_weights: bool = param("normalize_weights")
    eps: float = param("eps")
    task_vectors: bool = param("task_vectors")
    base_weight: float = param("base_weight")


@dataclass(frozen=True)
class KarcherParams(ParamSet):
    max_iter: int = param("max_iter")
    tol: float = param("tol")


class SphericalDef(OperatorDef):
    """Interpolation on the sphere of either the experts' task vectors (``task_vectors: true``) or the
    models themselves, the base one of them with ``base_weight`` (``engine/operators/_spherical.py``).
    Tensor-level: norms and angles are whole tensors' (or whole rows'), so a partial budget reads a
    tensor of every expert or of none, and an unread tensor keeps the base's."""

    expert_params = Weighted
    streaming = False

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        super().validate(spec, tensor_names, num_layers)
        if "base_weight" in spec.params and spec.params.get("task_vectors", True) is not False:
            raise ConfigError(f"{self.name}: base_weight is the base's weight among the interpolated models; "
                              "it needs task_vectors: false")


class NuSlerpDef(SphericalDef):
    name = "nuslerp"
    summary = "spherical interpolation of two task vectors (or of the base and one model), per tensor or vector"
    global_params = NuSlerpParams
    min_experts = 1
    max_experts = 2
    budget_note = ("nuslerp merges whole tensors, whatever nuslerp_flatten says, each from every expert or not at "
                   "all (then it keeps the base's values: without a base_model, the first model's)")

    def _count_phrase(self) -> str:
        return "two experts (one with task_vectors: false, the base being the other point)"

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        task_vectors, n = params.global_.task_vectors, len(params.experts)
        if n != (2 if task_vectors else 1):
            points = "the task vectors of two experts" if task_vectors else "the base and one expert"
            raise ConfigError(f"nuslerp with task_vectors: {str(task_vectors).lower()} interpolates {points}, "
                              f"got {n} expert{'s' if n > 1 else ''} for {tensor_name}")


class MultiSlerpDef(SphericalDef):
    name = "multislerp"
    summary = "barycentric interpolation of the experts' task vectors (or of the models) on the sphere, per tensor"
    global_params = MultiSlerpParams
    budget_note = ("multislerp merges whole tensors, each from every expert or not at all (then it keeps the "
                   "base's values: without a base_model, the first model's, times |Σw| with normalize_weights: false)")

    def keeps_base(self, params: TensorParams) -> bool:
        g = params.global_  # the models themselves, unnormalised: copies of B average to |Σw|·B
        return g.task_vectors or g.normalize_weights or \
            abs(math.fsum([*(e.weight for e in params.experts), g.base_weight])) == 1.0

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        g = params.global_
        weights = [e.weight for e in params.experts] + ([] if g.task_vectors else [g.base_weight])
        if g.normalize_weights and len(weights) > 1 and abs(math.fsum(weights)) < 1e-8:
            raise ConfigError(f"multislerp: the weights sum to {math.fsum(weights)!r} for {tensor_name}, so they "
                              "cannot be normalised; change the weights or set normalize_weights: false")


class KarcherDef(OperatorDef):
    """The base is always one of the averaged models (mergekit's karcher has no task-vector form).
    Tensor-level, as the spherical means above."""

    name = "karcher"
    summary = "Riemannian (Karcher) mean of the base and the experts on the sphere, rescaled to their mean norm"
    global_params = KarcherParams
    streaming = False
    budget_note = ("karcher averages whole tensors, each from every model or not at all (then it keeps the base's "
                   "values, the base being one of the averaged models)")


# ------------------------------------------------------------------ registry

OPERATORS: dict[str, OperatorDef] = {
    d.name: d
    for d in (
        AvgDef(), LinearDef(), TaskArithmeticDef(), TiesDef(), DareLinearDef(), DareTiesDef(),
        BreadcrumbsDef(), BreadcrumbsTiesDef(), DellaDef(), DellaLinearDef(), SlerpDef(), ModelStockDef(),
        NearswapDef(),
        ArceeFusionDef(),
        SceDef(),
        RamDef(),
        RamPlusTlDef(),
        NuSlerpDef(),
        MultiSlerpDef(),
        KarcherDef(),
    )
}

#: Other spellings people use (the seed vocabulary: AVG, TIES, DARE).
ALIASES: dict[str, str] = {"dare": "dare_linear"}


def canonical_name(name: str) -> str:
    """``"DARE-TIES"`` -> ``"dare_ties"``; ConfigError for an unknown name."""
    key = str(name).strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in OPERATORS:
        known = ", ".join([*OPERATORS, *ALIASES])
        raise ConfigError(f"unknown merge operator {name!r}; known operators: {known}")
    return key


def get_operator(name: str) -> OperatorDef:
    """The definition of operator ``name`` (any spelling ``canonical_name`` accepts)."""
    return OPERATORS[canonical_name(name)]


def validate_spec(spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> OperatorDef:
    """Check a spec before any I/O; returns its operator's definition."""
    definition = get_operator(spec.operator)
    definition.validate(spec, tensor_names, num_layers)
    return definition
