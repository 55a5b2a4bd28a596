"""`mergepipe eval --tasks`: an lm-evaluation-harness task defined by a local YAML over a local data file,
run end to end on a merge held in memory; the accuracy checked against a hand computation of each choice's
log-likelihood. Needs the `eval` extra (lm-eval); skipped without it, and never run in CI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mergepipe.app.planning import plan as make_plan
from mergepipe.cli import cli
from examples.demo_models import write_tokenizer
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_base, make_expert
from tests.fixtures.cli import invoke, refused, wide_runner

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional `eval` extra (not installed)")

QUESTIONS = [
    {"question": "Q: 2 + 2 =", "choices": [" 4", " 5", " 22"], "label": 0},
    {"question": "Q: the sky is", "choices": [" blue", " green"], "label": 0},
    {"question": "Q: cats say", "choices": [" woof", " meow", " moo"], "label": 1},
    {"question": "Q: ice is", "choices": [" hot", " cold"], "label": 1},
]


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return wide_runner(monkeypatch)


@pytest.fixture
def task_dir(tmp_path) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")
    return folder


def _json(runner, args) -> dict:
    result = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Running loglikelihood" not in result.stderr  # --no-progress: the harness's bars off too
    return json.loads(result.stdout)


def _expected_accuracy(folder: Path) -> float:
    """Each choice's summed log-likelihood after its question, computed with transformers and torch alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    right = 0
    for q in QUESTIONS:
        context = tokenizer(q["question"])["input_ids"]
        scores = []
        for choice in q["choices"]:
            ids = tokenizer(q["question"] + choice)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            scores.append(sum(float(logp[i - 1, ids[i]]) for i in range(len(context), len(ids))))
        right += int(max(range(len(scores)), key=scores.__getitem__) == q["label"])
    return right / len(QUESTIONS)


def test_a_local_task_runs_on_a_plan_in_memory_and_is_stored(tmp_path, task_dir, runner):
    base = make_base(tmp_path / "base")
    write_tokenizer(base)
    experts = [make_expert(base, tmp_path / f"e{i}", seed=i) for i in (1, 2)]
    db = tmp_path / "c.db"
    made = make_plan(MergeRequest(base=str(base), experts=tuple(map(str, experts)), operator="ties",
                                  params={"density": 0.5}), db, save=True)
    args = ["eval", "--db", db, made.digest[:12], "--tasks", "tiny_choice", "--include", task_dir, "--json",
            "--no-progress"]
    first = _json(runner, args)
    assert not first["stored"] and set(first["scores"]) == {"tiny_choice/acc"}

    out = tmp_path / "merged"
    invoke(runner, ["execute", "--db", db, "--plan", made.digest[:12], "--out", out, "--model-id", "m",
                    "--no-progress"])
    assert first["scores"]["tiny_choice/acc"] == pytest.approx(_expected_accuracy(out))
    again = _json(runner, args)
    assert again["stored"] and again["scores"] == first["scores"]


def test_an_unknown_task_is_one_line(tmp_path, task_dir, runner, capsys):
    base = make_base(tmp_path / "base")
    write_tokenizer(base)
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", base])
    refused(["eval", "--db", db, str(base), "--tasks", "no_such_task", "--include", task_dir], capsys,
            "unknown lm-eval task(s) no_such_task")


def test_a_search_objective_mixes_a_loss_and_a_task_score(tmp_path, task_dir, runner):
    """A search whose objective is a held-out loss minus an lm-eval accuracy: the published best's objective
    equals its loss (`eval --again`) minus the accuracy computed by hand on the published files."""
    pytest.importorskip("optuna", reason="search needs the `search` extra (Optuna)")
    base = make_base(tmp_path / "base")
    write_tokenizer(base)
    experts = [make_expert(base, tmp_path / f"e{i}", seed=i) for i in (1, 2)]
    data = tmp_path / "held.txt"
    data.write_text("Q: 2 + 2 = 4\n\nQ: the sky is blue\n")
    spec = tmp_path / "search.yml"
    spec.write_text(f"base: {base}\nexperts: [{experts[0]}, {experts[1]}]\noperators: [ties]\ndensity: [0.3, 0.9]\n"
                    f"budget: 100%\nobjective:\n  - {{data: {data}, weight: 1.0}}\n"
                    f"  - {{task: tiny_choice, metric: acc, include: {task_dir}, weight: 0.5}}\n"
                    "trials: 3\nseed: 1\nmax_tokens: 32\n")
    db, out = tmp_path / "c.db", tmp_path / "best"
    found = _json(runner, ["search", "--db", db, spec, "--out", out, "--json", "--no-progress"])
    loss = _json(runner, ["eval", "--db", db, out, "--data", data, "--max-tokens", "32", "--again", "--json",
                          "--no-progress"])
    expected = loss["loss"] - 0.5 * _expected_accuracy(out)
    assert found["best"]["objective"] == pytest.approx(expected, abs=1e-6)
