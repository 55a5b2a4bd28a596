"""Independent helpers for the planner, engine, CLI and end-to-end tests.

Everything that decides what a test *expects* lives here and is written
without MergePipe code: the safetensors layout is parsed by hand, block
geometry follows the contract in docs/ARCHITECTURE.md ("Block"), identical
blocks are found by comparing raw bytes, and the reference merges are plain
torch on whole tensors. MergePipe is used only to *set up* (catalogs) and,
for the random operators, as documented at their reference.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from unittest import mock

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.fixtures.checkpoints import checkpoint_files, layer_of, load_tensors

# Intra-op threads: tests/conftest.py sets one for the session; subprocesses
# get OMP_NUM_THREADS=1 through ``subprocess_env``.

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

__all__ = [
    "REPO",
    "RawTensor",
    "raw_layout",
    "block_ranges",
    "identical_blocks",
    "changed_blocks",
    "make_sparse_expert",
    "load_tensors",
    "deltas_of",
    "ref_task_arithmetic",
    "ref_linear",
    "ref_avg",
    "ref_ties",
    "ref_slerp",
    "ref_model_stock",
    "frobenius",
    "save_reference_checkpoint",
    "build_catalog",
    "clone_catalog",
    "ReadSpy",
    "spy_reads",
    "subprocess_env",
    "snapshot_files",
    "run_forked",
]


# --------------------------------------------------------------------------- raw layout


@dataclass(frozen=True)
class RawTensor:
    """A tensor as the file stores it: absolute byte range ``[begin, end)``."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def raw_layout(ckpt: Path) -> dict[str, RawTensor]:
    """Every tensor of a checkpoint directory, from the safetensors headers
    (8-byte little-endian header length, JSON header, data)."""
    out: dict[str, RawTensor] = {}
    for file in checkpoint_files(ckpt):
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            out[name] = RawTensor(name, file, info["dtype"], tuple(info["shape"]), 8 + n + begin, 8 + n + end)
    return out


def block_ranges(t: RawTensor, block_bytes: int) -> list[tuple[int, int]]:
    """Absolute byte ranges of a tensor's blocks, per the ARCHITECTURE contract:
    whole rows, ``rows_per_block = max(1, block_bytes // row_bytes)``; a 0-d or
    1-D tensor, or one of at most ``block_bytes``, is one block."""
    if len(t.shape) < 2 or t.nbytes <= block_bytes:
        return [(t.begin, t.end)]
    rows = t.shape[0]
    row_bytes = t.nbytes // rows
    per_block = max(1, block_bytes // row_bytes)
    return [
        (t.begin + r * row_bytes, t.begin + min(r + per_block, rows) * row_bytes)
        for r in range(0, rows, per_block)
    ]


@lru_cache(maxsize=None)
def _file_bytes(path: Path) -> bytes:
    return Path(path).read_bytes()


def identical_blocks(base: Path, expert: Path, block_bytes: int) -> dict[str, set[int]]:
    """Tensor -> indices of the expert's blocks whose bytes equal the base's."""
    b_layout, e_layout = raw_layout(base), raw_layout(expert)
    out: dict[str, set[int]] = {}
    for name, bt in b_layout.items():
        et = e_layout[name]
        same = set()
        for i, ((b0, b1), (e0, e1)) in enumerate(zip(block_ranges(bt, block_bytes), block_ranges(et, block_bytes))):
            if _file_bytes(bt.file)[b0:b1] == _file_bytes(et.file)[e0:e1]:
                same.add(i)
        out[name] = same
    return out


def changed_blocks(base: Path, expert: Path, block_bytes: int) -> dict[str, set[int]]:
    """Tensor -> indices of the expert's blocks whose bytes differ from the base's."""
    same = identical_blocks(base, expert, block_bytes)
    layout = raw_layout(base)
    return {
        name: set(range(len(block_ranges(t, block_bytes)))) - same[name] for name, t in layout.items()
    }


# --------------------------------------------------------------------------- fixtures


def make_sparse_expert(
    base_dir: Path,
    out_dir: Path,
    seed: int,
    scale: float = 0.02,
    tensor_fraction: float = 0.7,
    row_fraction: float = 0.5,
    layer_scale: dict[int, float] | None = None,
    touch: Callable[[str], bool] | None = None,
) -> Path:
    """Base + random deltas on a random subset of tensors and, inside each,
    of rows, so that some blocks of a changed tensor stay byte-identical.
    ``layer_scale`` multiplies the deltas of one layer (0 leaves it alone)."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    for f in checkpoint_files(base_dir):
        with safe_open(str(f), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        for name, value in tensors.items():
            if touch is not None and not touch(name):
                continue
            if float(torch.rand((), generator=gen)) >= tensor_fraction:
                continue
            factor = scale
            if layer_scale is not None and layer_of(name) is not None:
                factor *= layer_scale.get(layer_of(name), 1.0)
            if factor == 0.0:
                continue
            delta = torch.randn(value.shape, generator=gen) * factor
            if value.dim() >= 2:
                rows = torch.rand(value.shape[0], generator=gen) < row_fraction
                delta[~rows] = 0.0
            tensors[name] = (value.float() + delta).to(value.dtype)
        save_file(tensors, str(out_dir / f.name), metadata=metadata)
    for extra in base_dir.iterdir():
        if extra.suffix != ".safetensors":
            shutil.copy2(extra, out_dir / extra.name)
    return out_dir


# --------------------------------------------------------------------------- references
#
# Plain formulas on whole fp32 tensors. For bit-for-bit comparisons the fp32
# operations are done in the order the contracts fix: coefficients are
# Python floats (float64) applied as multipliers, terms are summed left to
# right in expert-id order (tests name experts so that list order = id
# order), and the merged delta is added to the base last.


def deltas_of(base: dict[str, torch.Tensor], experts: Sequence[dict[str, torch.Tensor]], name: str):
    """(fp32 base, [fp32 Δi]) of one tensor."""
    b = base[name].float()
    return b, [e[name].float() - b for e in experts]


def _sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def ref_task_arithmetic(b, ds, weights, lam=1.0):
    """out = B + Σ λ wi Δi."""
    return b + _sum([d * (lam * w) for d, w in zip(ds, weights)])


def ref_linear(b, ds, weights):
    """out = B + Σ (wi / Σw) Δi  (mergekit's Σ wi Ei / Σw written in deltas)."""
    total = math.fsum(weights)
    return b + _sum([d * (w / total) for d, w in zip(ds, weights)])


def ref_avg(b, ds):
    """out = B + Σ Δi / K, with 1/K applied as a multiplier."""
    return b + _sum([d * (1.0 / len(ds)) for d in ds])


def _trim(d: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k = max(1, int(density n)) entries of largest |Δ|, ties broken
    by position (a stable descending sort)."""
    if density >= 1.0:
        return d
    flat = d.reshape(-1)
    k = max(1, int(density * flat.numel()))
    order = torch.sort(flat.abs(), descending=True, stable=True).indices
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order[:k]] = True
    return torch.where(keep.view(d.shape), d, 0.0)


def ref_ties(b, ds, weights, density, lam=1.0):
    """TIES: trim, elect the sign of Σ w·trimmed (0 -> +), disjoint weighted
    mean over agreeing experts normalised by Σ agreeing weights, × λ, + B."""
    ys = [_trim(d, density) * w for d, w in zip(ds, weights)]
    sign = torch.where(_sum(ys) >= 0, 1.0, -1.0)
    agree = [(y * sign) > 0 for y in ys]
    num = _sum([torch.where(a, y, 0.0) for a, y in zip(agree, ys)])
    den = _sum([torch.where(a, w, 0.0) for a, w in zip(agree, weights)])
    den = torch.where(den == 0, 1.0, den)
    return b + (num / den) * lam


def _norm64(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


def ref_slerp(b, d, t):
    """SLERP from B to E = B + Δ over the tensor as one vector; lerp B + tΔ
    when |cos θ| > 0.9995 (norms <= 1e-8 count as 1)."""
    e = b + d
    nb, ne = _norm64(b), _norm64(e)
    nb = nb if nb > 1e-8 else 1.0
    ne = ne if ne > 1e-8 else 1.0
    cos = float((b * e).sum(dtype=torch.float64)) / (nb * ne)
    cos = min(1.0, max(-1.0, cos))
    if abs(cos) > 0.9995:
        return b + d * t
    theta = math.acos(cos)
    s = math.sin(theta)
    return b * (math.sin((1 - t) * theta) / s) + e * (math.sin(t * theta) / s)


def ref_model_stock(b, ds):
    """Model stock: t = N cos / (1 + (N-1) cos) from the mean pairwise cosine
    of the deltas; out = B + t · mean Δ."""
    n = len(ds)
    cos = []
    for i in range(n):
        for j in range(i + 1, n):
            dot = float((ds[i] * ds[j]).sum(dtype=torch.float64))
            c = dot / max(_norm64(ds[i]) * _norm64(ds[j]), 1e-6)
            cos.append(min(1.0, max(-1.0, c)))
    c = math.fsum(cos) / len(cos)
    den = 1 + (n - 1) * c
    t = 0.0 if abs(den) < 1e-6 else n * c / den
    if t == 0.0:
        return b.clone()
    return b + (_sum(ds) / n) * t


def frobenius(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Frobenius norm of the difference over every tensor, in float64."""
    total = 0.0
    for name in a:
        diff = a[name].double() - b[name].double()
        total += float((diff * diff).sum())
    return math.sqrt(total)


def save_reference_checkpoint(base_dir: Path, tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """A single-file HF checkpoint of ``tensors`` with the base's config."""
    out_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(base_dir / "config.json", out_dir / "config.json")
    return out_dir


# --------------------------------------------------------------------------- catalogs


def build_catalog(path: Path, block_bytes: int, models: dict[str, Path], base: str | None = None,
                  experts: Sequence[str] = ()) -> Path:
    """Create a catalog, register ``models`` and analyse ``experts`` against
    ``base``; closed on return (copy it with ``clone_catalog``)."""
    from mergepipe.analysis.analyze import analyze
    from mergepipe.analysis.register import register_model
    from mergepipe.catalog import Catalog

    with Catalog.create(path, block_bytes) as catalog:
        for model_id, directory in models.items():
            register_model(catalog, model_id, directory)
        if base is not None and experts:
            analyze(catalog, list(experts), base_id=base, progress=False)
    return path


def clone_catalog(template: Path, dest: Path) -> Path:
    """A private copy of a closed catalog file (its WAL was checkpointed on close)."""
    shutil.copyfile(template, dest)
    return dest


# --------------------------------------------------------------------------- read spy


@dataclass(frozen=True)
class ReadCall:
    path: str
    begin: int
    end: int
    tag: str | None


class ReadSpy:
    """Every ``CheckpointSource.read`` made while active (any thread)."""

    def __init__(self) -> None:
        self.calls: list[ReadCall] = []
        self._lock = threading.Lock()

    def bytes_of(self, directory: Path) -> int:
        root = str(Path(directory).resolve())
        return sum(c.end - c.begin for c in self.calls if str(Path(c.path).resolve()).startswith(root + os.sep))

    def ranges_of(self, file: Path) -> list[tuple[int, int]]:
        target = Path(file).resolve()
        return [(c.begin, c.end) for c in self.calls if Path(c.path).resolve() == target]


@contextmanager
def spy_reads() -> Iterator[ReadSpy]:
    from mergepipe.storage.source import CheckpointSource

    spy = ReadSpy()
    original = CheckpointSource.read

    def read(self, path, begin, end, out=None, tag=None):
        with spy._lock:
            spy.calls.append(ReadCall(os.fspath(path), begin, end, tag))
        return original(self, path, begin, end, out=out, tag=tag)

    with mock.patch.object(CheckpointSource, "read", read):
        yield spy


# --------------------------------------------------------------------------- processes, dirs


def subprocess_env() -> dict[str, str]:
    """Environment for child Python processes: the repo importable, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("COLUMNS", None)
    return env



def snapshot_files(directory: Path) -> dict[str, bytes]:
    """Relative name -> bytes of every file of a snapshot except manifest.json and the model card and
    config file written from it (they name the model id)."""
    root = Path(directory)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", "README.md", "mergepipe_config.yml")
    }


# --------------------------------------------------------------------------- forked jobs
#
# Crash and concurrency tests need real processes that die by SIGKILL or run
# at the same time. Starting one interpreter per job costs ~2 CPU seconds of
# imports on this two-core machine, so one runner process imports MergePipe
# once and forks a child per job (a clean, single-threaded parent: no pytest
# state, no open catalog). Each child is an ordinary process: SIGKILL ends it
# without any Python cleanup, and the kernel drops its locks.

RUNNER = r'''
import json, os, signal, sys, time, traceback
from pathlib import Path

jobs = json.loads(Path(sys.argv[1]).read_text())

from mergepipe.catalog import Catalog
from mergepipe.cli import main as cli_main
from mergepipe.engine.engine import Engine
from mergepipe.spec.plan import Plan
from mergepipe.storage.source import CheckpointSource
from mergepipe.storage.writer import ShardWriter
from mergepipe.txn.publish import TransactionManager


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_on_call(cls, method, n):
    original = getattr(cls, method)
    calls = [0]

    def wrapper(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            die()
        return original(self, *args, **kwargs)

    setattr(cls, method, wrapper)


def wait_at_staged(directory, parties, timeout=20.0):
    """Every party stops after `staged` until all have staged: the publishes overlap."""
    original_init = TransactionManager.__init__

    def init(self, on_step=None):
        original_init(self, on_step)
        inner = self._on_step

        def step(name):
            inner(name)
            if name == "staged":
                Path(directory).mkdir(exist_ok=True)
                (Path(directory) / str(os.getpid())).touch()
                deadline = time.time() + timeout
                while len(list(Path(directory).iterdir())) < parties and time.time() < deadline:
                    time.sleep(0.01)

        self._on_step = step

    TransactionManager.__init__ = init


def run(job):
    kind, _, arg = job.get("mode", "").partition(":")
    on_step = None
    if kind == "step":
        on_step = lambda step: die() if step == arg else None
    elif kind == "read":
        kill_on_call(CheckpointSource, "read", int(arg))
    elif kind == "write":
        kill_on_call(ShardWriter, "write", int(arg))
    if "barrier" in job:
        wait_at_staged(job["barrier"], job["parties"])
    if "argv" in job:
        cli_main(job["argv"])
        return {}
    plan = Plan.from_json(Path(job["plan"]).read_text())
    with Catalog.open(job["db"]) as catalog:
        snapshot_id, manifest = Engine(catalog, on_step=on_step).execute(
            plan, out=job["out"], model_id=job["model_id"]
        )
    return {"snapshot_id": snapshot_id, "manifest_hash": manifest.manifest_hash}


children = {}
for index, job in enumerate(jobs):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            Path(job["result"]).write_text(json.dumps(run(job)))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    children[pid] = index

statuses = {}
for _ in range(len(children)):
    pid, status = os.waitpid(-1, 0)
    statuses[children[pid]] = {
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
    }
print("RUNNER-RESULT " + json.dumps([statuses[i] for i in range(len(jobs))]))
'''


def run_forked(jobs: list[dict], workdir: Path, timeout: float = 180) -> list[dict]:
    """Run ``jobs`` (see RUNNER) in forked children of one fresh interpreter,
    all at once; returns per job ``{"signal", "code", "result", "log"}``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for i, job in enumerate(jobs):
        job.setdefault("result", str(workdir / f"result-{i}.json"))
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    (workdir / "runner.py").write_text(RUNNER)
    proc = subprocess.run(
        [PYTHON, str(workdir / "runner.py"), str(workdir / "jobs.json")],
        env=subprocess_env(), capture_output=True, text=True, timeout=timeout,
    )
    marker = [line for line in proc.stdout.splitlines() if line.startswith("RUNNER-RESULT ")]
    assert proc.returncode == 0 and marker, f"runner failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    statuses = json.loads(marker[-1][len("RUNNER-RESULT "):])
    out = []
    for job, status in zip(jobs, statuses):
        result = Path(job["result"])
        status["result"] = json.loads(result.read_text()) if result.exists() else None
        status["log"] = proc.stderr[-4000:]
        out.append(status)
    return out
