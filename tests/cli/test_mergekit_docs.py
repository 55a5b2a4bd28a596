"""docs/MERGEKIT.md's examples run: every mergekit YAML plans, and the side-by-side flags give the same plan."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from mergepipe.cli import cli
from examples.demo_models import make_demo_models
from tests.fixtures.cli import wide_runner

DOC = Path(__file__).resolve().parents[2] / "docs" / "MERGEKIT.md"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


def _mergekit_examples() -> list[str]:
    return [b for b in _blocks("yaml") if "merge_method" in yaml.safe_load(b)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    make_demo_models(root / "models")
    return root


@pytest.fixture
def workdir(models, tmp_path, monkeypatch) -> Path:
    (tmp_path / "models").symlink_to(models / "models")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")
    return tmp_path


def _plan(runner, args) -> dict:
    result = runner.invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_guide_has_examples():
    assert len(_mergekit_examples()) >= 4


@pytest.mark.parametrize("index", range(len(_mergekit_examples())))
def test_every_mergekit_example_plans(workdir, monkeypatch, index):
    text = _mergekit_examples()[index]
    (workdir / "merge.yml").write_text(text)
    plan = _plan(wide_runner(monkeypatch), ["plan", "--db", "cat.db", "--config", "merge.yml", "--analyze-missing",
                                            "--no-progress"])
    method = yaml.safe_load(text)["merge_method"]
    assert plan["merge"]["operator"] == method


def test_the_side_by_side_flags_give_the_same_plan(workdir, monkeypatch):
    runner = wide_runner(monkeypatch)
    (workdir / "merge.yml").write_text(_mergekit_examples()[0])
    from_yaml = _plan(runner, ["plan", "--db", "cat.db", "--config", "merge.yml", "--analyze-missing",
                               "--no-progress"])
    params = next(b for b in _blocks("yaml") if b.startswith("# params.yml"))
    (workdir / "params.yml").write_text(params)
    command = next(b for b in _blocks("text") if "--config params.yml" in b)
    args = shlex.split(command.replace("\\\n", " "))[2:]  # drop `mergepipe merge`
    drop = {"--out": 2, "--model-id": 2}
    kept, i = [], 0
    while i < len(args):
        if args[i] in drop:
            i += drop[args[i]]
            continue
        kept.append(args[i])
        i += 1
    from_flags = _plan(runner, ["plan", *kept, "--no-progress"])
    assert from_flags["digest"] == from_yaml["digest"]
