"""`mergepipe bisect GOOD BAD --data FILE`: the changes, then the tensors, that make BAD worse than GOOD.

GOOD and BAD are two merges of one base (typically two versions of one
merged model). Their plans list what changed (``planner/bisect.py``: an
expert's version, an expert added or removed, a parameter or setting). A
hybrid takes some changes from BAD and the rest from GOOD; it is planned as
any merge (reusing every analysed block) and merged in memory, then
evaluated on the data (``app/evaluating.py``). A hybrid *regresses* when its
loss exceeds GOOD's by more than the tolerance (by default half of the gap
from GOOD to BAD: a hybrid regresses when it is nearer BAD than GOOD). The
search (``find_culprits``) finds the culprit changes with about log2(n)
evaluations per culprit; then the same search over tensor groups, GOOD's
tensors with one group's taken from GOOD + the culprit, finds the layers and
then the kind of tensors (attention, MLP, norms) that carry the regression.

Every probe is stored as an evaluation (a hybrid under its plan digest; a
tensor probe under a digest of GOOD, the culprit merge and the group), so a
second bisect of the same pair on the same data computes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergepipe.app.evaluating import (
    Evaluation,
    Subject,
    evaluate_subject,
    merge_subject,
    resolve_subject,
    subject_tensors,
)
from mergepipe.app.planning import make_plan
from mergepipe.app.reports import render_bisect
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import compute_device
from mergepipe.errors import ConfigError
from mergepipe.evaluation.data import EvalData, EvalSettings, load_data
from mergepipe.planner.bisect import (
    Change,
    changes,
    find_culprits,
    hybrid_request,
    narrow_tensors,
    tensor_groups,
)
from mergepipe.spec.plan import Plan
from mergepipe.txn.outpath import writable_file, write_report


@dataclass(frozen=True)
class Probe:
    """One evaluation of the search: what it took from BAD, its loss, whether it regresses, and whether it
    was computed now (False: found in the catalog)."""

    stage: str  # "changes" | "layers" | "kinds"
    what: str
    loss: float
    regresses: bool
    computed: bool


@dataclass
class Bisection:
    """The result: GOOD's and BAD's losses, the tolerance, every probe in order, the culprit changes and
    the tensors they act through."""

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
            "probes": [
                {"stage": p.stage, "what": p.what, "loss": p.loss, "regresses": p.regresses, "computed": p.computed}
                for p in self.probes
            ],
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
    """The culprit changes from ``good`` to ``bad`` (snapshots, merged model ids or plans) and, with
    ``tensors``, the tensor groups they act through (module docstring)."""
    settings = settings or EvalSettings()
    loaded = load_data(data, settings)
    compute_device(device)
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        result = _Search(catalog, loaded, settings, device, progress, reporter).run(good, bad, tolerance, tensors)
    if page is not None:
        write_report(page, render_bisect(result.summary()))
    return result


class _Search:
    """One bisect: the catalog, the data, and the evaluations made so far."""

    def __init__(
        self, catalog: Catalog, data: EvalData, settings: EvalSettings, device: str, progress: bool, reporter: Reporter
    ) -> None:
        self.catalog, self.data, self.settings = catalog, data, settings
        self.device, self.progress, self.reporter = device, progress, reporter

    def run(self, good: str, bad: str, tolerance: float | None, narrow: bool) -> Bisection:
        good_subject, bad_subject = resolve_subject(self.catalog, good), resolve_subject(self.catalog, bad)
        for name, subject in ((good, good_subject), (bad, bad_subject)):
            if subject.plan is None:
                raise ConfigError(f"'{name}' is not a merge: bisect compares two merges of one base")
        assert good_subject.plan is not None and bad_subject.plan is not None
        items = changes(good_subject.plan, bad_subject.plan)
        good_eval, bad_eval = self._evaluate(good_subject), self._evaluate(bad_subject)
        gap = bad_eval.loss - good_eval.loss
        if tolerance is not None and tolerance < 0:
            raise ConfigError(f"--tolerance must be at least 0, got {tolerance}")
        tolerance = max(gap / 2, 0.0) if tolerance is None else tolerance
        if gap <= tolerance:
            raise ConfigError(
                f"no regression to bisect: BAD's loss {bad_eval.loss:.4f} is not above GOOD's "
                f"{good_eval.loss:.4f} by more than {tolerance:.4g} on {self.data.name}"
            )
        result = Bisection(good_eval, bad_eval, tolerance, items)
        self.reporter.note(f"{len(items)} change(s) from GOOD to BAD; loss {good_eval.loss:.4f} -> {bad_eval.loss:.4f}")
        limit = good_eval.loss + tolerance
        plans = (good_subject.plan, bad_subject.plan)

        def hybrid_regresses(subset: frozenset[Change]) -> bool:
            if len(subset) == len(items):
                return True
            if not subset:
                return False
            evaluation = self._evaluate(self._hybrid(plans, subset))
            regresses = evaluation.loss > limit
            result.probes.append(
                Probe(
                    "changes",
                    " + ".join(c.description for c in _ordered(items, subset)),
                    evaluation.loss,
                    regresses,
                    not evaluation.stored,
                )
            )
            return regresses

        found = find_culprits(items, hybrid_regresses)
        result.culprits = [_ordered(items, group) for group in found.culprits]
        if narrow:
            for group in result.culprits:
                culprit = bad_subject if len(group) == len(items) else self._hybrid(plans, frozenset(group))
                result.tensor_culprits += self._narrow(result, good_subject, culprit, limit)
        return result

    # -------------------------------------------------------------------------------- probes

    def _evaluate(self, subject: Subject, tensors: Callable[[], dict[str, torch.Tensor]] | None = None) -> Evaluation:
        return evaluate_subject(
            self.catalog, subject, self.data, self.settings, device=self.device, progress=self.progress, tensors=tensors
        )

    def _hybrid(self, plans: tuple[Plan, Plan], subset: Collection[Change]) -> Subject:
        request = hybrid_request(plans[0], plans[1], subset)
        made = make_plan(
            self.catalog,
            request,
            analyze_missing=True,
            strict=False,
            device=self.device,
            progress=self.progress,
            reporter=self.reporter,
        )
        return merge_subject(self.catalog, made, "hybrid")

    def _narrow(
        self, result: Bisection, good: Subject, culprit: Subject, limit: float
    ) -> list[tuple[str, tuple[str, ...]]]:
        """The tensor groups of ``culprit`` (GOOD + culprit changes) that carry the regression on their own:
        layers first, then the kinds of tensors within the culprit layers (``narrow_tensors``). GOOD's and
        the culprit's weights are read or merged only when a probe is not stored."""
        weights: dict[str, dict[str, torch.Tensor]] = {}

        def loaded(subject: Subject) -> dict[str, torch.Tensor]:
            if subject.key not in weights:
                weights[subject.key] = subject_tensors(self.catalog, subject, self.progress)
            return weights[subject.key]

        assert good.plan is not None
        names = [t.name for t in self.catalog.models.tensors(good.plan.base.id)]
        layers, kinds = tensor_groups(names), tensor_groups(names, by="kind")

        def tensors_regress(chosen: frozenset[str]) -> bool:
            key = hashlib.sha256(
                "\n".join(["mergepipe-bisect-tensors/1", good.key, culprit.key, *sorted(chosen)]).encode()
            ).hexdigest()

            def mixed() -> dict[str, torch.Tensor]:
                return {n: (loaded(culprit) if n in chosen else loaded(good))[n] for n in loaded(good)}

            probe = Subject(key, "hybrid", "tensor probe", None, None, good.config_folder, good.tokenizers)
            evaluation = self._evaluate(probe, mixed)
            regresses = evaluation.loss > limit
            whole = [g for g in layers if set(g.tensors) <= chosen]
            if {t for g in whole for t in g.tensors} == chosen:
                stage, what = "layers", ", ".join(g.name for g in whole)
            else:
                stage, what = "kinds", ", ".join(g.name for g in kinds if set(g.tensors) <= chosen)
            result.probes.append(Probe(stage, what, evaluation.loss, regresses, not evaluation.stored))
            return regresses

        found = narrow_tensors(names, tensors_regress)
        position = {name: i for i, name in enumerate(names)}
        return [
            (g.name, g.tensors) for group in found.culprits for g in sorted(group, key=lambda g: position[g.tensors[0]])
        ]


def _ordered(items: Sequence, subset: Collection) -> list:
    return [item for item in items if item in subset]
