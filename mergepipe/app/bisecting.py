"""`mergepipe bisect GOOD BAD --data FILE`: the changes between two merges (``changes``), hybrids taking some
from BAD (``hybrid_request``), the culprit search (``find_culprits``), then the tensor groups they act through
(``narrow_tensors``); every probe is stored as an evaluation."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch

from mergepipe.app.evaluating import EvalSettings, Evaluation, Subject, Term, data_term, evaluate_subject, load_data
from mergepipe.app.evaluating import merge_subject, resolve_subject, subject_tensors
from mergepipe.app.planning import make_plan
from mergepipe.app.reports import render
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import compute_device
from mergepipe.errors import BudgetError, ConfigError
from mergepipe.sizes import format_bytes
from mergepipe.spec.operators import get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import Budget, MergeRequest, parse_budget
from mergepipe.spec.settings import VERSIONED, family
from mergepipe.txn.outpath import writable_file, write_report


@dataclass(frozen=True)
class Probe:
    """One evaluation of the search; ``computed``: False when found in the catalog."""

    stage: str  # "changes" | "layers" | "kinds"
    what: str
    loss: float
    regresses: bool
    computed: bool


@dataclass
class Bisection:
    """GOOD's and BAD's losses, every probe in order, the culprit changes and the tensors they act through."""

    good: Evaluation
    bad: Evaluation
    tolerance: float
    changes: list[Change]
    probes: list[Probe] = field(default_factory=list)
    culprits: list[list[Change]] = field(default_factory=list)
    tensor_culprits: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (group, tensor names)

    @property
    def computed(self) -> int:
        """Evaluations computed by this run (GOOD and BAD included)."""
        return sum(p.computed for p in self.probes) + (not self.good.stored) + (not self.bad.stored)

    def summary(self) -> dict[str, object]:
        return {
            "data": {"name": self.good.data.name, "digest": self.good.data.digest, "tokens": self.good.tokens},
            "good": {"target": self.good.subject.name, "loss": self.good.loss},
            "bad": {"target": self.bad.subject.name, "loss": self.bad.loss},
            "tolerance": self.tolerance,
            "changes": [c.description for c in self.changes],
            "culprits": [[c.description for c in group] for group in self.culprits],
            "tensors": [{"group": g, "tensors": list(names)} for g, names in self.tensor_culprits],
            "probes": [vars(p) for p in self.probes],
            "evaluations_computed": self.computed,
        }


def bisect(  # noqa: PLR0913 - keyword-only options, as the command's flags
    db: Catalogish,
    good: str,
    bad: str,
    data: Sequence[str | Path],
    *,
    settings: EvalSettings | None = None,
    tolerance: float | None = None,
    tensors: bool = True,
    device: str = "cpu",
    html: str | Path | None = None,
    force: bool = False,
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> Bisection:
    """The culprit changes from ``good`` to ``bad`` and, with ``tensors``, the tensor groups they act through."""
    settings = settings or EvalSettings()
    term = data_term(load_data(data, settings))
    compute_device(device)
    if tolerance is not None and tolerance < 0:
        raise ConfigError(f"--tolerance must be at least 0, got {tolerance}")
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        result = _Bisect(catalog, term, settings, device, progress, reporter).run(good, bad, tolerance, tensors)
    if page is not None:
        title = f"{result.good.subject.name} -> {result.bad.subject.name}"
        write_report(page, render("bisect", title="MergePipe bisect", subtitle=title, b=result.summary()))
    return result


@dataclass
class _Bisect:
    """One bisect: the catalog, the data, how to evaluate; once GOOD and BAD are scored, the result."""

    catalog: Catalog
    term: Term
    settings: EvalSettings
    device: str
    progress: bool
    reporter: Reporter

    def run(self, good: str, bad: str, tolerance: float | None, narrow: bool) -> Bisection:
        (good_subject, good_plan), (bad_subject, bad_plan) = self._merge(good), self._merge(bad)
        items = changes(good_plan, bad_plan)
        good_eval, bad_eval = self._evaluate(good_subject), self._evaluate(bad_subject)
        gap = bad_eval.loss - good_eval.loss
        tolerance = max(gap / 2, 0.0) if tolerance is None else tolerance
        if gap <= tolerance:
            raise ConfigError(
                f"no regression to bisect: BAD's loss {bad_eval.loss:.4f} is not above GOOD's "
                f"{good_eval.loss:.4f} by more than {tolerance:.4g} on {self.term.name}"
            )
        self.result, self.limit = Bisection(good_eval, bad_eval, tolerance, items), good_eval.loss + tolerance
        self.reporter.note(f"{len(items)} change(s) from GOOD to BAD; loss {good_eval.loss:.4f} -> {bad_eval.loss:.4f}")

        def hybrid_regresses(subset: frozenset[Change]) -> bool:
            what = " + ".join(c.description for c in items if c in subset)
            return self._regresses("changes", what, self._hybrid(good_plan, bad_plan, subset))

        found = find_culprits(items, hybrid_regresses).culprits
        self.result.culprits = [[c for c in items if c in group] for group in found]
        for group in self.result.culprits if narrow else []:
            culprit = bad_subject if len(group) == len(items) else self._hybrid(good_plan, bad_plan, group)
            self.result.tensor_culprits += self._narrow(good_subject, good_plan.base.id, culprit)
        return self.result

    def _merge(self, target: str) -> tuple[Subject, Plan]:
        subject = resolve_subject(self.catalog, target)
        if subject.plan is None:
            raise ConfigError(f"'{target}' is not a merge: bisect compares two merges of one base")
        return subject, subject.plan

    def _evaluate(self, subject: Subject, tensors: Callable[[], dict[str, torch.Tensor]] | None = None) -> Evaluation:
        return evaluate_subject(
            self.catalog, subject, self.term, self.settings, device=self.device, progress=self.progress, tensors=tensors
        )

    def _regresses(
        self, stage: str, what: str, subject: Subject, tensors: Callable[[], dict[str, torch.Tensor]] | None = None
    ) -> bool:
        evaluation = self._evaluate(subject, tensors)
        regresses = evaluation.loss > self.limit
        self.result.probes.append(Probe(stage, what, evaluation.loss, regresses, not evaluation.stored))
        return regresses

    def _hybrid(self, good: Plan, bad: Plan, subset: Collection[Change]) -> Subject:
        request = hybrid_request(good, bad, subset)
        made = make_plan(self.catalog, request, device=self.device, progress=self.progress, reporter=self.reporter)
        return merge_subject(self.catalog, made, "hybrid")

    def _narrow(self, good: Subject, base_id: str, culprit: Subject) -> list[tuple[str, tuple[str, ...]]]:
        """The tensor groups of ``culprit`` that carry the regression on their own (layers, then kinds)."""
        weights: dict[str, dict[str, torch.Tensor]] = {}

        def loaded(subject: Subject) -> dict[str, torch.Tensor]:
            if subject.key not in weights:
                weights[subject.key] = subject_tensors(self.catalog, subject, self.progress)
            return weights[subject.key]

        names = [t.name for t in self.catalog.models.tensors(base_id)]
        layers, kinds = tensor_groups(names), tensor_groups(names, by="kind")

        def tensors_regress(chosen: frozenset[str]) -> bool:
            key = hashlib.sha256(
                "\n".join(["mergepipe-bisect-tensors/1", good.key, culprit.key, *sorted(chosen)]).encode()
            ).hexdigest()

            def mixed() -> dict[str, torch.Tensor]:
                return {n: (loaded(culprit) if n in chosen else loaded(good))[n] for n in loaded(good)}

            probe = Subject(key, "hybrid", "tensor probe", None, None, good.config_folder, good.tokenizers)
            whole = [g for g in layers if set(g.tensors) <= chosen]
            if {t for g in whole for t in g.tensors} == chosen:
                return self._regresses("layers", ", ".join(g.name for g in whole), probe, mixed)
            return self._regresses("kinds", ", ".join(g.name for g in kinds if set(g.tensors) <= chosen), probe, mixed)

        found = narrow_tensors(names, tensors_regress)
        position = {name: i for i, name in enumerate(names)}
        return [
            (g.name, g.tensors) for group in found.culprits for g in sorted(group, key=lambda g: position[g.tensors[0]])
        ]


# ---------------------------------------------------------------------- changes and hybrids

ChangeKind = Literal["expert version", "expert added", "expert removed", "parameter", "setting"]
#: A part of a merge GOOD and BAD may set differently: ``("expert", name)``, ``("param", key)``, ``("param",
#: key, name)`` (one expert's), ``("order",)`` or one of ``_SETTINGS``.
Slot = tuple[str, ...]
#: The merge-wide settings (``MergeRequest`` fields), in the order changes list them: how they are named there,
#: and how a value reads (None is the base's, for the output options).
_SETTINGS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "operator": ("operator", str),
    "budget": ("budget", lambda budget: str(budget.text)),
    "policy": ("policy", str),
    "seed": ("seed", str),
    "out_dtype": ("output dtype", lambda dtype: "base's" if dtype is None else str(dtype)),
    "out_shard_bytes": (
        "output shards",
        lambda size: "base's files" if size is None else f"at most {format_bytes(size)}",
    ),
    "chat_template": (
        "chat template",
        lambda text: "base's" if text is None else f"a template of {len(text)} characters",
    ),
    "copy_tokenizer": ("tokenizer files", lambda copied: "copied" if copied else "left out"),
}
_ORDER: Slot = ("order",)
_OPERATOR: Slot = ("operator",)
_UNSET = object()  # a slot one merge does not set (an expert it does not merge, a parameter left at its default)


@dataclass(frozen=True)
class Change:
    """One difference between GOOD and BAD; ``slot``: the part of the merge a hybrid takes from BAD for it."""

    kind: ChangeKind
    description: str
    slot: Slot


def changes(good: Plan, bad: Plan) -> list[Change]:
    """What differs between GOOD and BAD, in a stable order; ConfigError for plans bisect cannot recombine."""
    _check_pair(good, bad)
    g, b = _Merge.of(good, "GOOD"), _Merge.of(bad, "BAD")
    owned: dict[Slot, list[Slot]] = {}
    for slot in sorted(g.slots.keys() | b.slots.keys(), key=lambda s: _rank(s, g, b)):
        if g.get(slot) != b.get(slot):
            owned.setdefault(_owner(slot, g, b), []).append(slot)
    if g.common_order(b) != b.common_order(g):
        owned[_ORDER] = [_ORDER]
    found = [_describe(owner, slots, g, b) for owner, slots in sorted(owned.items(), key=lambda o: _rank(o[0], g, b))]
    if not found:
        raise ConfigError(f"GOOD and BAD are the same merge (plan {merge_digest(good)[:12]}); nothing to bisect")
    return found


def merge_digest(plan: Plan) -> str:
    """The digest of ``plan`` merged from scratch (without blocks copied from a previous snapshot)."""
    return replace(plan, reuse=None).digest


def request_of(plan: Plan) -> MergeRequest:
    """The request ``plan`` merges from scratch, naming exact versions."""
    spec = plan.merge
    refs = [_exact(e.expert_id) for e in spec.experts]
    try:
        budget = parse_budget(plan.budget_text)
    except BudgetError:  # a whole number given from Python ("1000.0"): that many bytes
        try:
            number = float(plan.budget_text)
        except ValueError:
            raise ConfigError(
                f"the plan's budget {plan.budget_text!r} is not one MergePipe reads; plan it again"
            ) from None
        if not number.is_integer() or number < 0:
            raise
        budget = Budget(text=plan.budget_text, bytes=int(number))
    return MergeRequest(
        base=_exact(plan.base.id),
        experts=tuple(refs),
        operator=spec.operator,
        params=dict(spec.params),
        expert_params={ref: dict(e.params) for ref, e in zip(refs, spec.experts) if e.params},
        seed=spec.seed,
        budget=budget,
        policy=plan.policy,
        out_dtype=plan.out_dtype,
        out_shard_bytes=plan.out_shard_bytes,
        chat_template=plan.chat_template,
        copy_tokenizer=plan.copy_tokenizer,
    )


@dataclass(frozen=True)
class _Merge:
    slots: Mapping[Slot, Any]
    names: tuple[str, ...]

    @classmethod
    def of(cls, plan: Plan, which: str) -> _Merge:
        """The merge ``plan`` makes; ConfigError for a plan no request can make again."""
        if plan.copies is not None:
            raise ConfigError(
                f"{which} is a passthrough (layers copied from several models), not a merge of "
                "experts; bisect compares two merges"
            )
        if plan.reuse is not None and (plan.reuse.updated or plan.reuse.errors):
            raise ConfigError(
                f"{which} updated blocks of a previous output (--delta-update), so its bytes are "
                "not those of any plan; merge it again without --delta-update to bisect it"
            )
        request = request_of(plan)
        if request.budget.seconds is not None:
            raise ConfigError(
                f"{which}'s budget {plan.budget_text!r} is a time, which this machine's timings "
                f"turned into {plan.budget_bytes} bytes when it was planned; bisect needs a merge "
                f"it can plan again: merge {which} with --budget {plan.budget_bytes}B"
            )
        names = tuple(family(e) for e in request.experts)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(
                f"{which} merges several versions of {', '.join(twice)}; bisect pairs the experts "
                "of GOOD and BAD by name"
            )
        slots: dict[Slot, Any] = {(name,): getattr(request, name) for name in _SETTINGS}
        slots.update({("param", key): value for key, value in request.params.items()})
        for name, ref in zip(names, request.experts):
            slots[("expert", name)] = ref
            slots.update({("param", key, name): value for key, value in request.expert_params.get(ref, {}).items()})
        return cls(slots, names)

    def get(self, slot: Slot) -> Any:
        return self.slots.get(slot, _UNSET)

    @property
    def operator(self) -> str:
        return str(self.slots[_OPERATOR])

    def common_order(self, other: _Merge) -> tuple[str, ...]:
        return tuple(n for n in self.names if n in other.names)


def _check_pair(good: Plan, bad: Plan) -> None:
    """ConfigError unless GOOD and BAD merge onto one base, on one catalog, with one content per id."""
    g, b = good.base.id, bad.base.id
    if g != b:
        if family(g) == family(b):
            raise ConfigError(
                f"GOOD and BAD merge onto different versions of {family(g)}: {_exact(g)} (GOOD) "
                f"and {_exact(b)} (BAD); bisect compares merges onto one base"
            )
        raise ConfigError(
            f"GOOD and BAD merge onto different bases: {g} (GOOD) and {b} (BAD); bisect compares merges onto one base"
        )
    if good.block_bytes != bad.block_bytes:
        raise ConfigError(
            f"GOOD and BAD were planned on catalogs of other block sizes ({good.block_bytes} and "
            f"{bad.block_bytes} bytes); bisect them on the catalog that made both"
        )
    bad_prints = {m.id: m.fingerprint for m in (bad.base, *bad.experts)}
    for model in (good.base, *good.experts):
        if bad_prints.get(model.id, model.fingerprint) != model.fingerprint:
            raise ConfigError(
                f"model {model.id} has other content in BAD's plan than in GOOD's (registered "
                "again with --force): GOOD cannot be planned again to bisect it"
            )


def _owner(slot: Slot, g: _Merge, b: _Merge) -> Slot:
    """The change a slot belongs to (the operator's, or an expert's only one merge has, else its own)."""
    if slot[0] != "param":
        return slot
    if not _portable(slot, g.operator, b.operator):
        return _OPERATOR
    if len(slot) == 3 and (g.get(("expert", slot[2])) is _UNSET or b.get(("expert", slot[2])) is _UNSET):
        return ("expert", slot[2])
    return slot


def _portable(slot: Slot, first: str, second: str) -> bool:

    def takes(operator: str) -> bool:
        definition = get_operator(operator)
        every = (*definition.expert_params.definitions(), *definition.global_params.definitions())
        return any(d.name == slot[1] and (len(slot) == 2 or d.scope != "global") for d in every)

    return first == second or (takes(first) and takes(second))


def _rank(slot: Slot, g: _Merge, b: _Merge) -> tuple[int, int, str]:
    names = _union(g.names, b.names)
    if slot[0] == "expert":
        return 0, names.index(slot[1]), ""
    if slot[0] == "param":
        return 1, 0 if len(slot) == 2 else 1 + names.index(slot[2]), slot[1]
    return 2, list(_SETTINGS).index(slot[0]) if slot[0] in _SETTINGS else len(_SETTINGS), ""


def _describe(owner: Slot, slots: Sequence[Slot], g: _Merge, b: _Merge) -> Change:
    before, after = g.get(owner), b.get(owner)
    if owner[0] == "expert":
        if before is _UNSET:
            return Change("expert added", f"expert {after.removesuffix('@1')} added", owner)
        if after is _UNSET:
            return Change("expert removed", f"expert {before.removesuffix('@1')} removed", owner)
        return Change("expert version", f"{owner[1]}: {before} -> {after}", owner)
    if owner[0] == "param":
        operator = f"{g.operator} " if g.operator == b.operator else ""
        of = f" of {owner[2]}" if len(owner) == 3 else ""
        return Change("parameter", f"{operator}{owner[1]}{of}: {_shown(before)} -> {_shown(after)}", owner)
    if owner == _ORDER:
        return Change(
            "setting", f"expert order: {', '.join(g.common_order(b))} -> {', '.join(b.common_order(g))}", owner
        )
    name, shown = _SETTINGS[owner[0]]
    description = f"{name}: {shown(before)} -> {shown(after)}"
    carried = sorted({s[1] for s in slots if s != owner})
    if carried:
        description += f" (with {', '.join(carried)}, which only one of them takes)"
    return Change("setting", description, owner)


def _shown(value: Any) -> str:
    return "unset" if value is _UNSET else str(value)


def hybrid_request(good: Plan, bad: Plan, subset: Collection[Change]) -> MergeRequest:
    """GOOD's merge with the changes of ``subset`` taken from BAD, naming each model by its exact version."""
    every = changes(good, bad)
    stray = [c.description for c in subset if c not in every]
    if stray:
        raise ValueError(f"not changes between GOOD and BAD: {', '.join(stray)}")
    g, b = _Merge.of(good, "GOOD"), _Merge.of(bad, "BAD")
    applied = {c.slot for c in subset}

    def value(slot: Slot) -> Any:
        return (b if _owner(slot, g, b) in applied else g).get(slot)

    order = b.common_order(g) if _ORDER in applied else g.common_order(b)
    names = [
        n for n in _union(_reorder(g.names, order), _reorder(b.names, order)) if value(("expert", n)) is not _UNSET
    ]
    slots = sorted(g.slots.keys() | b.slots.keys())

    def settings(scope: Slot) -> dict[str, Any]:
        """The parameters the hybrid sets for ``scope``: ``()`` the global ones, ``(name,)`` an expert's."""
        chosen = {s[1]: value(s) for s in slots if s[0] == "param" and s[2:] == scope}
        return {key: v for key, v in chosen.items() if v is not _UNSET}

    refs = {n: value(("expert", n)) for n in names}
    try:
        return MergeRequest(
            base=_exact(good.base.id),
            experts=tuple(refs[n] for n in names),
            params=settings(()),
            expert_params={refs[n]: settings((n,)) for n in names if settings((n,))},
            **{name: value((name,)) for name in _SETTINGS},
        )
    except ConfigError as exc:
        taken = ", ".join(c.description for c in every if c in subset) or "nothing"
        raise ConfigError(f"GOOD with {taken} from BAD is not a merge: {exc}") from None


def _exact(model_id: str) -> str:
    """A reference to exactly this stored id (``name`` stored as version 1 as ``name@1``)."""
    return model_id if VERSIONED.match(model_id) else f"{model_id}@1"


def _reorder(names: Sequence[str], order: Sequence[str]) -> list[str]:
    ordered = iter(order)
    return [next(ordered) if n in order else n for n in names]


def _union(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """Both lists merged, each name once: shared ones in ``first``'s order, the others in place."""
    shared = set(first) & set(second)
    out: list[str] = []
    i = j = 0
    while i < len(first) or j < len(second):
        if i < len(first) and first[i] not in shared:
            out.append(first[i])
            i += 1
        elif j < len(second) and second[j] not in shared:
            out.append(second[j])
            j += 1
        else:
            out.append(first[i])
            i, j = i + 1, j + 1
    return out


# ---------------------------------------------------------------------- the search

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class Tested(Generic[T]):
    subset: frozenset[T]
    regresses: bool


@dataclass(frozen=True)
class Search(Generic[T]):
    """The culprit sets found and every evaluation, in order."""

    culprits: tuple[frozenset[T], ...]
    probes: tuple[Tested[T], ...]

    @property
    def evaluations(self) -> int:
        return len(self.probes)


def find_culprits(items: Sequence[T], regresses: Callable[[frozenset[T]], bool]) -> Search[T]:
    """The culprits among ``items``; ``regresses(S)`` is called at most once per subset, never for none or all."""
    order = tuple(items)
    if not order:
        raise ValueError("nothing to search: no items")
    if len(set(order)) != len(order):
        raise ValueError("the items to search must be distinct")
    probe = _Probes(regresses, frozenset(order))
    culprits: list[frozenset[T]] = []
    left = frozenset(order)
    while left and (not culprits or probe(left)):
        culprit = _descend(order, left, probe)
        culprits.append(culprit)
        left -= culprit
    return Search(tuple(culprits), tuple(probe.log))


class _Probes(Generic[T]):
    """``regresses`` memoised, the ends known, every call logged."""

    def __init__(self, regresses: Callable[[frozenset[T]], bool], everything: frozenset[T]) -> None:
        self._regresses = regresses
        self._known: dict[frozenset[T], bool] = {frozenset(): False, everything: True}
        self.log: list[Tested[T]] = []

    def __call__(self, subset: frozenset[T]) -> bool:
        if subset not in self._known:
            self._known[subset] = bool(self._regresses(subset))
            self.log.append(Tested(subset, self._known[subset]))
        return self._known[subset]


def _descend(order: Sequence[T], regressing: frozenset[T], probe: _Probes[T]) -> frozenset[T]:
    """A culprit set inside ``regressing``, halving along the fixed positions of ``order``."""
    low, high = 0, len(order)
    current = seen = regressing  # ``seen``: the smallest set known to regress
    while len(current) > 1:
        middle = (low + high) // 2
        first = current & frozenset(order[low:middle])
        if first == current:
            high = middle
        elif first and probe(first):
            current = seen = first
            high = middle
        else:
            current -= first  # regresses unless the culprit spans both halves: checked at the end
            low = middle
    if current == seen or probe(current):
        return current
    return _needed([x for x in order if x in seen], probe)


def _needed(regressing: list[T], probe: _Probes[T]) -> frozenset[T]:
    """An interaction: the items of ``regressing`` it needs (binary search per item, then ddmin)."""
    needed: list[T] = []
    rest = regressing  # invariant: needed + rest regresses
    while not probe(frozenset(needed)):
        low, high = 0, len(rest)  # needed + rest[:low] does not regress, needed + rest[:high] does
        while high - low > 1:
            middle = (low + high) // 2
            if probe(frozenset(needed + rest[:middle])):
                high = middle
            else:
                low = middle
        needed.append(rest[high - 1])
        rest = rest[: high - 1]
    return _ddmin([x for x in regressing if x in needed], probe)


def _ddmin(regressing: list[T], probe: _Probes[T]) -> frozenset[T]:
    """Zeller's delta debugging: a subset of ``regressing`` that regresses and needs every one of its items."""
    current, chunks = regressing, 2
    while len(current) >= 2:
        size, extra = divmod(len(current), chunks)
        bounds = [i * size + min(i, extra) for i in range(chunks + 1)]
        parts = [current[bounds[i] : bounds[i + 1]] for i in range(chunks)]
        smaller = next((p for p in parts if probe(frozenset(p))), None)
        if smaller is not None:
            current, chunks = smaller, 2
            continue
        if chunks > 2:  # with two chunks, each one's complement is the other
            rests = ([x for x in current if x not in p] for p in parts)
            smaller = next((r for r in rests if probe(frozenset(r))), None)
            if smaller is not None:
                current, chunks = smaller, max(chunks - 1, 2)
                continue
        if chunks >= len(current):
            break
        chunks = min(2 * chunks, len(current))
    return frozenset(current)


# ---------------------------------------------------------------------- tensor groups

#: A transformer layer's prefix: ``model.layers.N``, ``layers.N``, ``transformer.h.N``, ``blocks.N``.
_LAYER = re.compile(r"^(?P<stack>(?:[^.]+\.)*?(?:layers|h|blocks))\.(?P<index>\d+)\.(?P<rest>.+)$")
#: Kinds inside a layer, in the order they are listed, by the layer's module a tensor belongs to.
_KINDS = ("attention", "MLP", "norms", "other")
_ATTENTION_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "wq", "wk", "wv", "wo"}
_MLP_MODULES = {"gate_proj", "up_proj", "down_proj", "fc1", "fc2", "c_fc", "w1", "w2", "w3"}
#: Groups outside the layers, by where they sit in a model.
_OUTSIDE = ("embeddings", "final norm", "lm_head", "other tensors")


@dataclass(frozen=True)
class TensorGroup:
    """Tensors searched together: a layer (its ``parts`` by kind), or a group outside the layers."""

    name: str
    tensors: tuple[str, ...]
    parts: tuple[TensorGroup, ...] = ()


def tensor_groups(names: Sequence[str], by: Literal["layer", "kind"] = "layer") -> list[TensorGroup]:
    """Every tensor in exactly one group, in model order; ``by="kind"`` splits each layer into its parts."""
    layers: dict[tuple[str, int], list[str]] = {}
    outside: dict[str, list[str]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            layers.setdefault((match["stack"], int(match["index"])), []).append(name)
        else:
            outside.setdefault(_outside_kind(name), []).append(name)
    stacks = list(dict.fromkeys(stack for stack, _ in layers))
    ordered = sorted(layers.items(), key=lambda kv: (stacks.index(kv[0][0]), kv[0][1]))
    groups = [TensorGroup(kind, tuple(outside[kind])) for kind in _OUTSIDE[:1] if kind in outside]
    groups += [_layer_group(f"{stack}.{index}", tensors) for (stack, index), tensors in ordered]
    groups += [TensorGroup(kind, tuple(outside[kind])) for kind in _OUTSIDE[1:] if kind in outside]
    return groups if by == "layer" else [part for g in groups for part in (g.parts or (g,))]


def narrow_tensors(names: Sequence[str], regresses: Callable[[frozenset[str]], bool]) -> Search[TensorGroup]:
    """The tensor groups that make BAD worse: culprit layers, then the culprit parts of those layers."""
    log: list[Tested[TensorGroup]] = []
    known: dict[frozenset[str], bool] = {}

    def by_tensors(chosen: frozenset[TensorGroup]) -> bool:
        tensors = frozenset(t for group in chosen for t in group.tensors)
        if tensors not in known:
            known[tensors] = bool(regresses(tensors))
            log.append(Tested(chosen, known[tensors]))
        return known[tensors]

    groups = tensor_groups(names)
    culprits: list[frozenset[TensorGroup]] = []
    for found in find_culprits(groups, by_tensors).culprits:
        parts = tensor_groups([t for g in groups if g in found for t in g.tensors], by="kind")
        culprits.extend(find_culprits(parts, by_tensors).culprits if len(parts) > len(found) else (found,))
    return Search(tuple(culprits), tuple(log))


def _layer_group(name: str, tensors: Iterable[str]) -> TensorGroup:
    members = tuple(tensors)
    by_kind: dict[str, list[str]] = {}
    for tensor in members:
        by_kind.setdefault(_layer_kind(tensor.removeprefix(f"{name}.")), []).append(tensor)
    parts = tuple(TensorGroup(f"{name} {kind}", tuple(by_kind[kind])) for kind in _KINDS if kind in by_kind)
    return TensorGroup(name, members, parts if len(parts) > 1 else ())


def _layer_kind(rest: str) -> str:
    """The kind of a tensor inside a layer, by its module."""
    module = rest.split(".")[0]
    if "norm" in module or module.startswith("ln"):
        return "norms"
    if "attn" in module or "attention" in module or module in _ATTENTION_MODULES:
        return "attention"
    if any(word in module for word in ("mlp", "feed_forward", "ffn", "moe")) or module in _MLP_MODULES:
        return "MLP"
    return "other"


def _outside_kind(name: str) -> str:
    if any(word in name for word in ("embed", "wte", "wpe")):
        return "embeddings"
    if "lm_head" in name or name.startswith("output."):
        return "lm_head"
    if "norm" in name or "ln_f" in name:
        return "final norm"
    return "other tensors"
