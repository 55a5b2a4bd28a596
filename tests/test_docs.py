"""The user docs work as written.

docs/QUICKSTART.md runs block by block, in order, in an empty directory: its
```python blocks through ``exec``, its ```bash blocks line by line through
``mergepipe.cli.main`` (each line must be one plain ``mergepipe`` command, so
that it means the same in a shell). docs/PYTHON_API.md's ```python example
runs in an empty directory holding the tiny ``make demo`` checkpoints
under ``models/``. A block that is not meant to run is marked ```text; any
other kind of block in those two pages fails the test rather than being
skipped. Every relative link between docs/*.md and README.md must point to an
existing file.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from mergepipe.cli import main
from examples.demo_models import make_demo_models
from mergepipe.txn.verify import verify_snapshot

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
QUICKSTART = DOCS / "QUICKSTART.md"
PYTHON_API = DOCS / "PYTHON_API.md"

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
#: What a shell would treat specially: a line using any of it might not mean in bash what it means here.
_SHELL_SYNTAX = re.compile(r"[|;&<>$`*?(){}\[\]~!]")


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block of ``path``, in order."""
    return [(lang.strip(), body) for lang, body in _FENCE.findall(path.read_text(encoding="utf-8"))]


def runnable_blocks(path: Path) -> list[tuple[str, str]]:
    """The python and bash blocks of ``path``; any block that is neither these nor ``text`` is an error,
    so nothing is skipped silently."""
    blocks = fenced_blocks(path)
    other = [lang or "(no language)" for lang, _ in blocks if lang not in ("python", "bash", "text")]
    assert not other, f"{path.name}: blocks marked {other}; mark each block python, bash (both run) or text"
    return [(lang, body) for lang, body in blocks if lang != "text"]


def bash_commands(body: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        args = shlex.split(line, comments=True)
        if not args:
            continue
        code = line.split(" #")[0]
        assert not _SHELL_SYNTAX.search(code), f"not a plain command (shell syntax): {line!r}"
        assert args[0] == "mergepipe", f"a bash block may only run `mergepipe` commands, got {line!r}"
        commands.append(args[1:])
    return commands


def run_command(args: list[str]) -> str:
    """Run one `mergepipe` command through the console entry point; its output, or a failure naming it."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exc:
            code = exc.code
    assert code in (0, None), f"`mergepipe {shlex.join(args)}` exited {code}:\n{err.getvalue()}{out.getvalue()}"
    return out.getvalue()


def run_doc(path: Path) -> None:
    """Run every runnable block of ``path`` in order, in the current directory."""
    for n, (lang, body) in enumerate(runnable_blocks(path), 1):
        if lang == "python":
            exec(compile(body, f"{path.name} (block {n})", "exec"), {"__name__": f"docs_{path.stem.lower()}"})
        else:
            for args in bash_commands(body):
                run_command(args)


@pytest.fixture(scope="module")
def demo_models(tmp_path_factory) -> Path:
    """The tiny checkpoints `make demo` makes, generated once for this module."""
    root = tmp_path_factory.mktemp("demo-models")
    make_demo_models(root / "models")
    return root / "models"


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """The directory the quick start ran in (it makes its own models)."""
    workdir = tmp_path_factory.mktemp("quickstart")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        mp.setenv("COLUMNS", "200")
        run_doc(QUICKSTART)
    return workdir


@pytest.fixture(scope="module")
def python_api(tmp_path_factory, demo_models) -> Path:
    """The directory docs/PYTHON_API.md's example ran in, with the demo models at ``models/``."""
    workdir = tmp_path_factory.mktemp("python-api")
    (workdir / "models").symlink_to(demo_models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        mp.chdir(workdir)
        run_doc(PYTHON_API)
    return workdir


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def test_the_docs_have_what_the_tests_run():
    quick = runnable_blocks(QUICKSTART)
    assert [lang for lang, _ in quick].count("bash") >= 2
    assert sum(len(bash_commands(body)) for lang, body in quick if lang == "bash") >= 10
    assert [lang for lang, _ in runnable_blocks(PYTHON_API)] == ["python"]  # the one complete example


def test_the_quick_start_runs_and_publishes_what_it_describes(quickstart):
    first, second = quickstart / "merged", quickstart / "merged-v2"
    for directory in (first, second):
        report = verify_snapshot(directory)
        assert report.ok, report.problems
    v1, v2 = _manifest(first), _manifest(second)
    assert (v1["model_id"], v2["model_id"]) == ("merged", "merged@2")
    # the budgeted merge: realized <= planned <= budget, and a real reduction at 25%
    realized, planned = v1["cost"]["realized"]["expert_bytes"], v1["cost"]["estimated"]["expert_bytes"]
    assert 0 < realized <= planned <= v1["budget_bytes"]
    # the incremental one reused blocks of the first, so it read fewer expert bytes than it planned
    assert v2["extra"]["reuse"]["blocks"] > 0
    assert v2["cost"]["realized"]["expert_bytes"] < v2["cost"]["estimated"]["expert_bytes"]


def test_the_python_example_runs_and_gives_the_quick_starts_snapshot(python_api, quickstart):
    report = verify_snapshot(python_api / "merged")
    assert report.ok, report.problems
    # the same inputs and the same plan, once through the CLI and once through the API: the same snapshot
    assert _manifest(python_api / "merged")["snapshot_id"] == _manifest(quickstart / "merged")["snapshot_id"]


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links(path: Path) -> list[str]:
    """Link targets of a markdown file, outside code blocks and inline code."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    return _LINK.findall(text)


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name} links to missing files: {broken}"


def test_the_link_check_sees_links():
    """The checker is not vacuous: README.md links to the docs it lists."""
    assert {"docs/QUICKSTART.md", "docs/CONCEPTS.md", "docs/PYTHON_API.md"} <= set(_links(ROOT / "README.md"))


def test_the_readme_s_first_screen_is_the_two_commands_then_mergepipe_yaml_then_the_loop():
    """A mergekit user finds the one command on the first screen, after `make demo` / `make test`, before the
    catalog loop; and the README says how much `make test` runs."""
    first = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:60]
    where = {needle: next(n for n, line in enumerate(first) if needle in line)
             for needle in ("make test", "mergepipe-yaml config.yml ./out", "mergepipe init-db")}
    assert where["make test"] < where["mergepipe-yaml config.yml ./out"] < where["mergepipe init-db"]
    assert re.search(r"`make test` runs the [\d,]+ tests in about \S+ minutes on a 2-core machine",
                     " ".join(first[:where["mergepipe-yaml config.yml ./out"]]))
    assert "download.pytorch.org/whl/cpu" in "\n".join(first)  # the CPU wheel where there is no GPU


@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "gpu"])
def test_make_installs_the_cpu_torch_where_there_is_no_gpu(tmp_path, gpu):
    """What `make install` would run (``make -n``) on a fresh machine: the pinned torch, from PyTorch's CPU index
    too where `nvidia-smi` is not on PATH, so pip takes torch==2.13.0+cpu, not PyPI's CUDA build."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "python3", *(["nvidia-smi"] if gpu else [])):
        (bin_dir / tool).symlink_to(shutil.which(tool) or "/bin/true")
    done = subprocess.run([make, "-n", "-W", "pyproject.toml", "install", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                          env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60, check=True)
    (line,) = [x for x in done.stdout.splitlines() if '"torch==2.13.0"' in x]
    assert line.rstrip().endswith('install -q "torch==2.13.0"' if gpu else
                         'install -q "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu'), line
