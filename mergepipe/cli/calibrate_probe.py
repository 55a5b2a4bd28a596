"""The merge `mergepipe calibrate` ends with: it measures ``steal`` and ``overlap`` as every merge does.

``calibrate`` times each operator's compute alone (``engine/calibrate.py``). What the reading and writing
threads take from the merging worker on a machine whose cores they share (``steal``, ``spec/seconds.py``)
only shows while a merge runs, and it is not small: on 2 cores, 0.17–0.41 s per GB moved. A calibration
that left it at 0 predicted the first merge after it 30% low (the standard suite's first row, BENCHMARKS.md,
"Plans that predict seconds"). So calibration ends with a real, small merge — synthetic bf16 checkpoints
(a base and ``EXPERTS`` experts that change every entry) registered, analysed, planned and merged at a full
budget with task arithmetic in a scratch catalog, the inputs cold — and reads ``steal`` off it with the same
``observe`` that every merge's refinement uses; twice, keeping the lesser (``TRIES``). Everything it wrote is
removed.

It reads ``overlap`` off the same merges, the lesser of the two. The step of ``engine/calibrate.py`` that
runs reading, merging and writing side by side measured 1.00 (no overlap) in every calibration on a 2-core
machine, where merges then learned 1.2-1.9; a calibration that starts from 1.00 predicts the first merges
after it too long (+35-46% for the first served one; replayed on eight recorded runs, starting from 1.3
instead: 713 of 744 merges within ±20% against 708, BENCHMARKS.md, "Plans that predict seconds"). The
probe merge runs in this process, torch loaded, so it is observed as a served merge is (its reads are not
hidden behind loading torch). The lesser of the tries, because a longer prediction is the safer error: a time
budget stays within its seconds. Where neither merge's worker outlasted its longest part, the step's value
stays.

It lives in the command line because it is the one layer that may use the analysis, the planner and the
engine together.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.calibrate_io import evict
from mergepipe.engine.engine import Engine
from mergepipe.errors import ConfigError
from mergepipe.machine import machine_key
from mergepipe.planner.planner import Planner
from mergepipe.planner.seconds import with_prediction
from mergepipe.spec.refinement import observe
from mergepipe.spec.seconds import STEAL, Rates

#: Bytes of each synthetic checkpoint: large enough that the merge streams for a few tenths of a second
#: (it measured 0.2 s per GB here, as full-budget merges do), small enough for calibrate's ~30 s.
PROBE_MODEL_BYTES = 192 * 1024 * 1024
#: Experts merged (their reads are most of what the worker's neighbours move).
EXPERTS = 2
#: Probe merges, each in its own catalog; the least ``steal`` is kept. One merge's steal varied 0.09–0.34 s
#: per GB from one calibration to the next on a 2-core machine (four in a row, same rates: 0.10–0.17), and a
#: calibration that kept 0.34 predicted the first merge after it 45% too long (BENCHMARKS.md, "Plans that
#: predict seconds"); something else running slows a merge, nothing makes it faster, as with the operators'
#: two sweeps (``engine/calibrate.py``).
TRIES = 2
#: Each tensor: this many rows of ``COLUMNS`` bf16 values (2 MiB).
ROWS, COLUMNS = 1024, 1024
#: The step's name in calibrate's progress display (after ``engine/calibrate.py``'s ``STEPS``).
STEP = "merge probe"
#: Where the scratch directory goes, named so a leftover is recognisable (``mergepipe calibrate --dir``).
PREFIX = ".mergepipe-calibrate-probe-"


@dataclass(frozen=True)
class Probed:
    """What the probe merges measured."""

    steal: float  # seconds of merging compute lost per byte read or written beside it: the least of the tries
    overlap: float | None  # the least overlap of the tries; None where no merge measured one


def measure(directory: Path, rates: Rates, device: str, block_bytes: int) -> Probed:
    """``steal`` and ``overlap`` (module docstring), measured by small merges run in a scratch directory under
    ``directory`` with ``rates`` (just calibrated) as their catalogs': the least of ``TRIES`` each; a steal of 0
    when a merge took no longer than the operator's own cost."""
    scratch = Path(tempfile.mkdtemp(prefix=PREFIX, dir=directory))
    try:
        try:
            models = _write_models(scratch)
        except OSError as exc:  # a full disk, mostly: the probe writes (1 + EXPERTS) × PROBE_MODEL_BYTES
            size = (1 + EXPERTS) * PROBE_MODEL_BYTES >> 20
            raise ConfigError(f"calibrate's probe merge could not write its {size} MiB of scratch checkpoints "
                              f"under {directory}: {exc.strerror or exc}; free some space there or give --dir on "
                              "another directory of the same disk") from None
        tries = [_merge_once(scratch / f"try-{index}", models, rates, device, block_bytes) for index in range(TRIES)]
        overlaps = [measured["overlap"] for measured in tries if "overlap" in measured]
        return Probed(min(measured.get(STEAL, 0.0) for measured in tries), min(overlaps) if overlaps else None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _merge_once(root: Path, models: dict[str, Path], rates: Rates, device: str, block_bytes: int) -> dict[str, float]:
    """One probe merge in a fresh catalog under ``root`` (a plan executed before would not merge again, but
    re-materialise its snapshot), its inputs cold; what ``observe`` measured of it, as of a served merge."""
    root.mkdir()
    experts = [name for name in models if name != "base"]
    with Catalog.create(root / "probe.db", block_bytes) as catalog:
        for name, path in models.items():
            register_model(catalog, name, path)
        analyze(catalog, experts, base_id="base", progress=False)
        catalog.rates.calibrated(machine_key(device), rates)
        plan = with_prediction(catalog, Planner(catalog).plan("base", experts, "task_arithmetic"), device)
        os.sync()  # written just now: make the pages clean, then drop them, so the merge reads cold
        for path in models.values():
            evict(path / "model.safetensors")
        _, manifest = Engine(catalog, device=device).execute(plan, out=root / "out", model_id="probe")
    if plan.seconds is None:
        return {}
    return observe(plan.seconds.work, rates, manifest.cost.realized.seconds, served=True)


def _write_models(root: Path) -> dict[str, Path]:
    """A base of N(0, 0.02) bf16 tensors and experts that add N(0, 0.002) to every entry, as directories."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, PROBE_MODEL_BYTES // (ROWS * COLUMNS * 2))
    base = {f"layers.{i}.weight": (torch.randn(ROWS, COLUMNS, generator=generator) * 0.02).to(torch.bfloat16)
            for i in range(count)}
    models = {"base": base}
    for e in range(EXPERTS):
        models[f"e{e}"] = {name: (value.float() + torch.randn(value.shape, generator=generator) * 0.002)
                           .to(torch.bfloat16) for name, value in base.items()}
    out = {}
    for name, tensors in models.items():
        (root / name).mkdir()
        save_file(tensors, str(root / name / "model.safetensors"))
        out[name] = root / name
    return out

