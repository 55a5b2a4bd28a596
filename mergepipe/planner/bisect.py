"""Bisect two merges: which of the changes from GOOD to BAD make BAD worse, in few evaluations.

GOOD and BAD are two plans onto one base (typically two versions of one merged model). ``changes`` lists
what differs between them, one ``Change`` each: an expert's version, an expert added or removed, an
operator parameter (global or one expert's), and the operator, budget, policy, seed, output dtype, expert
order and output options as one change each. ``hybrid_request`` is GOOD's merge with a subset of the
changes taken from BAD, as a ``MergeRequest`` naming exact versions: the empty subset plans to GOOD's digest
and the full set to BAD's (as merged from scratch: ``merge_digest``). A parameter only one of two operators
takes travels with the operator change, so every hybrid is a merge its operator accepts by name.

The search (``find_culprits``) knows nothing of merges: ``regresses(S)`` says whether GOOD with the items
of S taken from BAD is worse than GOOD; all items (BAD) are known to be, none (GOOD) known not to be.
Adaptive group testing: halve the set known to regress and evaluate the first half; if it regresses, go
on in it; if not, go on in the second half without evaluating it (it regresses unless the regression needs
items from both halves). The single item reached that way is evaluated once, unless its last step was an
evaluation. So one culprit among n costs at most ceil(log2 n) + 1 evaluations, and one more (everything
but the culprits found) says whether there is another; if that regresses, the search starts again inside
it, along the same halves, so a half evaluated before is not evaluated again. One culprit: at most
ceil(log2 n) + 2 evaluations; two independent ones at most 2 ceil(log2 n) + 4 (+4 only when both are
reached without their last step evaluated; often fewer).

When the item reached does not regress alone, the regression needs several items together (an
interaction). The smallest set the search saw regress is narrowed to a set whose every item is needed,
reported as one culprit set: a binary search finds each item it needs (about log2 n evaluations each), and
delta debugging (Zeller's ddmin) on the few found checks that none can go. No subset is evaluated twice.

``narrow_tensors`` runs the same search over a model's tensors, grouped by transformer layer
(``tensor_groups``), then by kind (attention, MLP, norms) inside the culprit layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar

from mergepipe.errors import BudgetError, ConfigError
from mergepipe.sizes import format_bytes
from mergepipe.spec.request import Budget, parse_budget
from mergepipe.spec.operators import get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.settings import VERSIONED, family
from mergepipe.spec.request import MergeRequest

__all__ = [
    "Change",
    "Probe",
    "Search",
    "TensorGroup",
    "changes",
    "find_culprits",
    "hybrid_request",
    "merge_digest",
    "narrow_tensors",
    "tensor_groups",
]

ChangeKind = Literal["expert version", "expert added", "expert removed", "parameter", "setting"]
#: A part of a merge that GOOD and BAD may set differently: ``("expert", name)``, ``("param", key)``,
#: ``("param", key, name)`` (one expert's), ``("order",)`` or one of ``_SETTINGS``.
Slot = tuple[str, ...]
#: The merge-wide settings, in the order changes list them, and how they are named there.
_SETTINGS = {
    "operator": "operator",
    "budget": "budget",
    "policy": "policy",
    "seed": "seed",
    "out_dtype": "output dtype",
    "out_shard_bytes": "output shards",
    "chat_template": "chat template",
    "copy_tokenizer": "tokenizer files",
}
_ORDER: Slot = ("order",)
_OPERATOR: Slot = ("operator",)
_UNSET = object()  # a slot one plan does not set (an expert it does not merge, a parameter left at its default)


@dataclass(frozen=True)
class Change:
    """One difference between GOOD and BAD: its kind, its description in words (for a table), and the
    part of the merge (``slot``) a hybrid takes from BAD when it applies the change."""

    kind: ChangeKind
    description: str
    slot: Slot


# ---------------------------------------------------------------------------------------------- changes


def changes(good: Plan, bad: Plan) -> list[Change]:
    """What differs between GOOD and BAD, in a stable order: experts (in GOOD's order, added ones where BAD
    has them), parameters (global, then each expert's), then the settings. ConfigError (one line) for two
    plans bisect cannot recombine: other bases, a passthrough, a time budget, a delta-updated output, or
    the same merge twice."""
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
    """The digest of ``plan`` merged from scratch (without the blocks it copies from a previous snapshot,
    which give the same bytes): what ``hybrid_request`` of no change plans to for GOOD, of every change
    for BAD."""
    return replace(plan, reuse=None).digest


@dataclass(frozen=True)
class _Merge:
    """A plan's merge as slots (see ``Slot``) and its experts' names in order: what hybrids mix."""

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
        if _budget(plan.budget_text).seconds is not None:
            raise ConfigError(
                f"{which}'s budget {plan.budget_text!r} is a time, which this machine's timings "
                f"turned into {plan.budget_bytes} bytes when it was planned; bisect needs a merge "
                f"it can plan again: merge {which} with --budget {plan.budget_bytes}B"
            )
        if plan.reuse is not None and (plan.reuse.updated or plan.reuse.errors):
            raise ConfigError(
                f"{which} updated blocks of a previous output (--delta-update), so its bytes are "
                "not those of any plan; merge it again without --delta-update to bisect it"
            )
        spec = plan.merge
        names = tuple(family(e) for e in spec.expert_ids)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(
                f"{which} merges several versions of {', '.join(twice)}; bisect pairs the experts "
                "of GOOD and BAD by name"
            )
        slots: dict[Slot, Any] = {
            ("operator",): spec.operator,
            ("budget",): plan.budget_text,
            ("policy",): plan.policy,
            ("seed",): spec.seed,
            ("out_dtype",): plan.out_dtype,
            ("out_shard_bytes",): plan.out_shard_bytes,
            ("chat_template",): plan.chat_template,
            ("copy_tokenizer",): plan.copy_tokenizer,
        }
        slots.update({("param", key): value for key, value in spec.params.items()})
        for name, expert in zip(names, spec.experts):
            slots[("expert", name)] = expert.expert_id
            slots.update({("param", key, name): value for key, value in expert.params.items()})
        return cls(slots, names)

    def get(self, slot: Slot) -> Any:
        return self.slots.get(slot, _UNSET)

    @property
    def operator(self) -> str:
        return str(self.slots[_OPERATOR])

    def common_order(self, other: _Merge) -> tuple[str, ...]:
        """This merge's experts that ``other`` merges too, in this merge's order."""
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
    """The change a slot belongs to: a parameter only one of the two operators takes belongs to the
    operator change, one of an expert only one merge has to that expert's change, any other to itself."""
    if slot[0] != "param":
        return slot
    if not _portable(slot, g.operator, b.operator):
        return _OPERATOR
    if len(slot) == 3 and (g.get(("expert", slot[2])) is _UNSET or b.get(("expert", slot[2])) is _UNSET):
        return ("expert", slot[2])
    return slot


def _portable(slot: Slot, first: str, second: str) -> bool:
    """Whether both operators take parameter ``slot`` where it is set (one expert's, or global)."""
    if first == second:
        return True

    def takes(operator: str) -> bool:
        definition = get_operator(operator)
        every = (*definition.expert_params.definitions(), *definition.global_params.definitions())
        return any(d.name == slot[1] and (len(slot) == 2 or d.scope != "global") for d in every)

    return takes(first) and takes(second)


def _rank(slot: Slot, g: _Merge, b: _Merge) -> tuple[int, int, str]:
    """Where a slot's change is listed: experts in order, then parameters (global first), then settings."""
    names = _union(g.names, b.names)
    if slot[0] == "expert":
        return 0, names.index(slot[1]), ""
    if slot[0] == "param":
        return 1, 0 if len(slot) == 2 else 1 + names.index(slot[2]), slot[1]
    return 2, list(_SETTINGS).index(slot[0]) if slot[0] in _SETTINGS else len(_SETTINGS), ""


def _describe(owner: Slot, slots: Sequence[Slot], g: _Merge, b: _Merge) -> Change:
    """The change ``owner`` stands for, in words."""
    before, after = g.get(owner), b.get(owner)
    if owner[0] == "expert":
        if before is _UNSET:
            return Change("expert added", f"expert {after} added", owner)
        if after is _UNSET:
            return Change("expert removed", f"expert {before} removed", owner)
        return Change("expert version", f"{owner[1]}: {_exact(before)} -> {_exact(after)}", owner)
    if owner[0] == "param":
        operator = f"{g.operator} " if g.operator == b.operator else ""
        of = f" of {owner[2]}" if len(owner) == 3 else ""
        return Change("parameter", f"{operator}{owner[1]}{of}: {_shown(before)} -> {_shown(after)}", owner)
    if owner == _ORDER:
        return Change(
            "setting", f"expert order: {', '.join(g.common_order(b))} -> {', '.join(b.common_order(g))}", owner
        )
    description = f"{_SETTINGS[owner[0]]}: {_setting(owner[0], before)} -> {_setting(owner[0], after)}"
    carried = sorted({s[1] for s in slots if s != owner})
    if carried:
        description += f" (with {', '.join(carried)}, which only one of them takes)"
    return Change("setting", description, owner)


def _shown(value: Any) -> str:
    return "unset" if value is _UNSET else str(value)


def _setting(name: str, value: Any) -> str:
    """A setting's value as people read it (None is the base's, for the output options)."""
    if name == "out_dtype":
        return "base's" if value is None else str(value)
    if name == "out_shard_bytes":
        return "base's files" if value is None else f"at most {format_bytes(value)}"
    if name == "chat_template":
        return "base's" if value is None else f"a template of {len(value)} characters"
    if name == "copy_tokenizer":
        return "copied" if value else "left out"
    return _shown(value)


# ---------------------------------------------------------------------------------------------- hybrids


def hybrid_request(good: Plan, bad: Plan, subset: Collection[Change]) -> MergeRequest:
    """GOOD's merge with the changes of ``subset`` taken from BAD (every other part from GOOD), naming
    each model by its exact version (``name@N``). ValueError for a change that is not between GOOD and
    BAD; ConfigError (one line) when the mix is no merge the operator accepts (say, no expert left)."""
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

    refs = {n: _exact(value(("expert", n))) for n in names}
    try:
        return MergeRequest(
            base=_exact(good.base.id),
            experts=tuple(refs[n] for n in names),
            operator=value(_OPERATOR),
            params=settings(()),
            expert_params={refs[n]: settings((n,)) for n in names if settings((n,))},
            seed=value(("seed",)),
            budget=_budget(value(("budget",))),
            policy=value(("policy",)),
            out_dtype=value(("out_dtype",)),
            out_shard_bytes=value(("out_shard_bytes",)),
            chat_template=value(("chat_template",)),
            copy_tokenizer=value(("copy_tokenizer",)),
        )
    except ConfigError as exc:
        taken = ", ".join(c.description for c in every if c in subset) or "nothing"
        raise ConfigError(f"GOOD with {taken} from BAD is not a merge: {exc}") from None


def _exact(model_id: str) -> str:
    """A reference to exactly this stored id: ``name@N`` as it is, version 1 (stored as ``name``, which
    means the latest version) as ``name@1``."""
    return model_id if VERSIONED.match(model_id) else f"{model_id}@1"


def _budget(text: str) -> Budget:
    """A plan's budget text as the budget it was parsed from. A whole number given from Python (``0``,
    ``1000.0``) keeps that text, which the command line's parser refuses: it was that many bytes."""
    try:
        return parse_budget(text)
    except BudgetError:
        try:
            number = float(text)
        except ValueError:
            raise ConfigError(f"the plan's budget {text!r} is not one MergePipe reads; make the plan again") from None
        if not number.is_integer() or number < 0:
            raise
        return Budget(text=text, bytes=int(number))


def _reorder(names: Sequence[str], order: Sequence[str]) -> list[str]:
    """``names`` with the ones in ``order`` put in that order, in the places they hold."""
    ordered = iter(order)
    return [next(ordered) if n in order else n for n in names]


def _union(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """Both lists merged, each name once: the shared ones in ``first``'s order (in the same order in both
    when hybrids mix them), the others where their own list has them."""
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


# ---------------------------------------------------------------------------------------------- search

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class Probe(Generic[T]):
    """One evaluation: GOOD with ``subset`` taken from BAD, and whether it regressed."""

    subset: frozenset[T]
    regresses: bool


@dataclass(frozen=True)
class Search(Generic[T]):
    """What a search found: the culprit sets (one item each, several for an interaction), in the order
    found, and every evaluation it made, in order."""

    culprits: tuple[frozenset[T], ...]
    probes: tuple[Probe[T], ...]

    @property
    def evaluations(self) -> int:
        return len(self.probes)


def find_culprits(items: Sequence[T], regresses: Callable[[frozenset[T]], bool]) -> Search[T]:
    """The culprits among ``items`` (see the module docstring): ``regresses(S)`` is called at most once per
    subset, never for no item or every item (GOOD and BAD, whose answers are known)."""
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
    """``regresses`` memoised, with the known ends (no item: no; every item: yes) and a log of the calls."""

    def __init__(self, regresses: Callable[[frozenset[T]], bool], everything: frozenset[T]) -> None:
        self._regresses = regresses
        self._known: dict[frozenset[T], bool] = {frozenset(): False, everything: True}
        self.log: list[Probe[T]] = []

    def __call__(self, subset: frozenset[T]) -> bool:
        if subset not in self._known:
            result = bool(self._regresses(subset))
            self._known[subset] = result
            self.log.append(Probe(subset, result))
        return self._known[subset]


def _descend(order: Sequence[T], regressing: frozenset[T], probe: _Probes[T]) -> frozenset[T]:
    """A culprit set inside ``regressing`` (known to regress), halving along the positions of ``order``:
    the same halves in every round, so those evaluated before are free."""
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
    return _narrow([x for x in order if x in seen], probe)


def _narrow(regressing: list[T], probe: _Probes[T]) -> frozenset[T]:
    """A set of items of ``regressing`` (known to regress, in order) that regresses and stops regressing
    without any one of them. Each item needed is found by a binary search for the shortest prefix that
    regresses with the ones found before (its last item is needed): about log2 n evaluations per item, where
    ddmin alone spends several times that. ddmin then checks that each one is needed (and narrows further
    where an evaluation contradicted the search's assumption that more of BAD is never better)."""
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
    """Zeller's delta debugging: a subset of ``regressing`` that regresses and stops regressing without
    any one of its items (1-minimal). Tries chunks, then complements of chunks, refining the chunks when
    neither regresses."""
    current, chunks = regressing, 2
    while len(current) >= 2:
        parts = _split(current, chunks)
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


def _split(items: Sequence[T], count: int) -> list[list[T]]:
    """``items`` in ``count`` consecutive chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


# ---------------------------------------------------------------------------------------------- tensors

#: A transformer layer's prefix: ``model.layers.N``, ``layers.N``, ``transformer.h.N``, ``blocks.N`` (the
#: first such part of the name).
_LAYER = re.compile(r"^(?P<stack>(?:[^.]+\.)*?(?:layers|h|blocks))\.(?P<index>\d+)\.(?P<rest>.+)$")
#: Kinds inside a layer, in the order they are listed, by the layer's module a tensor belongs to.
_KINDS = ("attention", "MLP", "norms", "other")
_ATTENTION_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "wq", "wk", "wv", "wo"}
_MLP_MODULES = {"gate_proj", "up_proj", "down_proj", "fc1", "fc2", "c_fc", "w1", "w2", "w3"}
#: Groups outside the layers, by where they sit in a model.
_OUTSIDE = ("embeddings", "final norm", "lm_head", "other tensors")


@dataclass(frozen=True)
class TensorGroup:
    """Tensors searched together: a layer (``model.layers.3``, its ``parts`` by kind: ``model.layers.3
    attention``...), or a group outside the layers (embeddings, final norm, lm_head, other tensors)."""

    name: str
    tensors: tuple[str, ...]
    parts: tuple[TensorGroup, ...] = ()


def tensor_groups(names: Sequence[str], by: Literal["layer", "kind"] = "layer") -> list[TensorGroup]:
    """Every tensor of ``names`` in exactly one group: the embeddings, one group per layer (in layer
    order), the final norm, the lm_head, other tensors (groups with no tensor left out). A layer with
    tensors of several kinds has them as its ``parts``, each tensor in exactly one; ``by="kind"`` lists
    those parts in the layer's place (the second level of ``narrow_tensors``)."""
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
    """The tensor groups that make BAD's version of a model worse: ``regresses(S)`` says whether GOOD with
    BAD's tensors ``S`` (names) regresses. ``find_culprits`` over the groups of ``tensor_groups``, then
    over the parts of the culprit layers; each set of tensors is evaluated once, and the probes list every
    evaluation of both steps."""
    log: list[Probe[TensorGroup]] = []
    known: dict[frozenset[str], bool] = {}

    def by_tensors(chosen: frozenset[TensorGroup]) -> bool:
        tensors = frozenset(t for group in chosen for t in group.tensors)
        if tensors not in known:
            known[tensors] = bool(regresses(tensors))
            log.append(Probe(chosen, known[tensors]))
        return known[tensors]

    groups = tensor_groups(names)
    culprits: list[frozenset[TensorGroup]] = []
    for found in find_culprits(groups, by_tensors).culprits:
        parts = tensor_groups([t for g in groups if g in found for t in g.tensors], by="kind")
        culprits.extend(find_culprits(parts, by_tensors).culprits if len(parts) > len(found) else (found,))
    return Search(tuple(culprits), tuple(log))


def _layer_group(name: str, tensors: Iterable[str]) -> TensorGroup:
    """A layer's group, with its parts by kind when it has several."""
    members = tuple(tensors)
    by_kind: dict[str, list[str]] = {}
    for tensor in members:
        match = _LAYER.match(tensor)
        assert match is not None
        by_kind.setdefault(_layer_kind(match["rest"]), []).append(tensor)
    parts = tuple(TensorGroup(f"{name} {kind}", tuple(by_kind[kind])) for kind in _KINDS if kind in by_kind)
    return TensorGroup(name, members, parts if len(parts) > 1 else ())


def _layer_kind(rest: str) -> str:
    """The kind of a tensor inside a layer, by the module it belongs to (``self_attn.q_norm`` is
    attention's; ``post_attention_layernorm`` a norm)."""
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
