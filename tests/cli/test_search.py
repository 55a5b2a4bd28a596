"""`mergepipe search`: a planted optimum recovered, a stopped, interrupted or killed search resumed, the best
published as a plain merge would publish it.

The fixture plants the optimum: G is the base trained on the data (low loss),
D = G - B, R a random direction as large as D; expert 1 is B + D/(2 w1) + R and
expert 2 is B + D/(2 w2) - (w1/w2) R, so task arithmetic with weights (w1, w2)
gives exactly G, and any other weights add some of R or scale D wrong.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergepipe.app import searching
from mergepipe.app.merging import merge
from mergepipe.app.evaluating import LocalRunner
from examples.demo_models import HELD_OUT, make_demo_models, write_tokenizer
from mergepipe.spec.request import MergeRequest
from tests.fixtures.cli import invoke, refused, wide_runner
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 (fixtures)
from tests.fixtures.ray_tasks import ray_instance
from tests.test_docs import DOCS, fenced_blocks

optuna = pytest.importorskip("optuna", reason="search needs the `search` extra (Optuna)")

PLANTED = (0.6, 0.2)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "Two plus two is four; three times three is nine.", "A merge of experts keeps what each one learned."]


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("search")
    base = write_tokenizer(root / "base")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=120, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    batches = [torch.tensor([tokenizer(t)["input_ids"]]) for t in TEXTS]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(80):
        ids = batches[step % len(batches)]
        model.to(torch.float32)(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    good = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    b = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    w1, w2 = PLANTED
    experts = {"e1": {}, "e2": {}}
    for name, value in b.items():
        d = good[name].double() - value.double()
        r = torch.randn(value.shape, generator=gen, dtype=torch.float64) * (d.std() if d.numel() > 1 else 0.0)
        experts["e1"][name] = (value.double() + d / (2 * w1) + r).to(torch.bfloat16)
        experts["e2"][name] = (value.double() + d / (2 * w2) - (w1 / w2) * r).to(torch.bfloat16)
    for name, tensors in experts.items():
        folder = root / name
        folder.mkdir()
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        for side in base.iterdir():
            if side.suffix != ".safetensors":
                (folder / side.name).write_bytes(side.read_bytes())
    data = root / "held-out.txt"
    data.write_text("\n\n".join(TEXTS) + "\n")
    return {"root": root, "base": base, "e1": root / "e1", "e2": root / "e2", "data": data}


def _search_file(planted: dict[str, Path], folder: Path, trials: int, study: str = "planted",
                 sampler: str = "tpe") -> Path:
    path = folder / "search.yml"
    path.write_text(
        f"base: {planted['base']}\nexperts: [{planted['e1']}, {planted['e2']}]\noperators: [task_arithmetic]\n"
        f"weight: [0.0, 1.0]\nbudget: 100%\nobjective:\n  - data: {planted['data']}\nmax_tokens: 64\n"
        f"sampler: {sampler}\nseed: 0\ntrials: {trials}\nstudy: {study}\n")
    return path


#: Trials of the resume tests: past TPE's random startup trials would take 10; these 8 keep the tests short.
TRIALS = 8


def _resume_file(planted: dict[str, Path], folder: Path, study: str, sampler: str = "tpe") -> Path:
    """The search of the resume tests: one text a batch (four running losses a trial, four pruning points)."""
    path = _search_file(planted, folder, TRIALS, study=study, sampler=sampler)
    path.write_text(path.read_text() + "batch: 1\n")
    return path


def _ran(db: Path, study: str) -> list[tuple]:
    """The trials of the study that ran (complete or pruned), in order: number, parameters, objective."""
    trials = optuna.load_study(study_name=study, storage=f"sqlite:///{db}").trials
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return [(t.number, t.params, t.value) for t in trials if t.state in states]


def _resumed(db: Path, study: str, before: list[tuple]) -> None:
    """A resumed study: one study numbered on, the trials that ran before kept as they were, TRIALS trials ran,
    and no parameters proposed twice (a resumed sampler does not draw the first run's proposals again)."""
    trials = optuna.load_study(study_name=study, storage=f"sqlite:///{db}").trials
    assert [t.number for t in trials] == list(range(len(trials)))
    ran = _ran(db, study)
    assert len(ran) == TRIALS and ran[: len(before)] == before
    assert len({tuple(sorted(params.items())) for _, params, _ in ran}) == TRIALS


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def test_search_recovers_the_planted_weights_and_publishes_the_plain_merge(planted, tmp_path, runner):
    db, spec = tmp_path / "c.db", _search_file(planted, tmp_path, trials=30)
    out = _stdout(runner, ["search", "--db", db, spec, "--out", tmp_path / "best", "--model-id", "best",
                           "--html", tmp_path / "search.html", "--json", "--no-progress"])
    best = out["best"]["params"]
    # the objective's minimum lies near the planted weights, not on them (bf16 experts, a 64-token window):
    # the search must do at least as well as the planted merge, evaluated on its own, and find weight 1
    merge(MergeRequest(base=str(planted["base"]), experts=(str(planted["e1"]), str(planted["e2"])),
                       operator="task_arithmetic", weights=PLANTED, model_id="planted"), db, tmp_path / "planted")
    scored = _stdout(runner, ["eval", "--db", db, "planted", "--data", planted["data"], "--max-tokens", "64",
                              "--json", "--no-progress"])
    assert out["best"]["objective"] <= scored["loss"] and abs(best["weight e2"] - PLANTED[1]) < 0.1
    assert len(out["trials"]) == 30
    assert "Objective per trial" in (tmp_path / "search.html").read_text()

    plain = merge(MergeRequest(base=str(planted["base"]), experts=(str(planted["e1"]), str(planted["e2"])),
                               operator="task_arithmetic", weights=(best["weight e1"], best["weight e2"]),
                               model_id="plain"), db, tmp_path / "plain")
    assert plain.snapshot_id == out["published"]["snapshot_id"]  # the same merge: the same snapshot
    explained = invoke(runner, ["explain", "--db", db, "best"])
    assert "search planted" in explained and f"trial {out['best']['number']} of 30" in explained
    lineage = invoke(runner, ["lineage", "--db", db, "best"])
    assert f"[best of search planted: trial {out['best']['number']} of 30]" in lineage


def test_with_another_final_budget_the_best_trials_are_ranked_again_in_full(planted, tmp_path, runner):
    spec = _search_file(planted, tmp_path, trials=8, study="rerank")
    spec.write_text(spec.read_text().replace("budget: 100%", "budget: 50%\nfinal_budget: 100%"))
    out = _stdout(runner, ["search", "--db", tmp_path / "c.db", spec, "--json", "--no-progress"])
    complete = sorted((t for t in out["trials"] if t["state"] == "complete"), key=lambda t: t["objective"])
    finalists = {int(k): v for k, v in out["finalists"].items()}
    assert sorted(finalists) == sorted(t["number"] for t in complete[:3])
    assert out["best"]["number"] == min(finalists, key=finalists.get)


def test_a_killed_search_resumes_to_the_same_study(planted, tmp_path, runner, capsys):
    """Killed at whatever point it reached, resumed: the killed trials are marked failed, the study goes on."""
    db, spec = tmp_path / "c.db", _resume_file(planted, tmp_path, "killed")
    invoke(runner, ["init-db", "--db", db])  # before this test's own reads of the study open the file
    command = [sys.executable, "-m", "mergepipe", "search", "--db", str(db), str(spec), "--threads", "1",
               "--no-progress"]
    log = tmp_path / "search.log"
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=sink, env={**os.environ, "MERGEPIPE_DB": str(db)})
    storage = f"sqlite:///{db}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
        try:
            study = optuna.load_study(study_name="killed", storage=storage)
        except KeyError:
            continue
        if len([t for t in study.trials if t.state.is_finished()]) >= 3:
            break
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, log.read_text()
    before = _ran(db, "killed")
    assert 3 <= len(before) < TRIALS

    refused(["search", "--db", db, spec], capsys, "study 'killed' exists", "--resume")
    out = _stdout(runner, ["search", "--db", db, spec, "--resume", "--threads", "1", "--json", "--no-progress"])
    assert [t["number"] for t in out["trials"]] == list(range(len(out["trials"])))
    _resumed(db, "killed", before)


@pytest.mark.parametrize(("sampler", "workers", "stop"), [("tpe", 1, 3), ("tpe", 2, 4), ("cmaes", 2, 4)])
def test_a_search_stopped_and_resumed_goes_on_to_its_trials(planted, tmp_path, runner, sampler, workers, stop):
    """`--trials` short of the file's, then `--resume`: the study goes on to the file's trials."""
    db, spec = tmp_path / "c.db", _resume_file(planted, tmp_path, "stopped", sampler)
    common = ["--workers", workers, "--threads", "1", "--json", "--no-progress"]
    first = _stdout(runner, ["search", "--db", db, spec, "--trials", stop, *common])
    assert len(first["trials"]) == stop
    before = _ran(db, "stopped")
    resumed = _stdout(runner, ["search", "--db", db, spec, "--resume", *common])
    assert [t["number"] for t in resumed["trials"]] == list(range(TRIALS))
    _resumed(db, "stopped", before)


@pytest.mark.parametrize(("sampler", "where"), [
    ("tpe", "proposing"), ("tpe", "running"), ("tpe", "recording"), ("cmaes", "recording")])
def test_an_interrupted_search_resumes_to_its_trials(planted, tmp_path, monkeypatch, sampler, where):
    """Ctrl-C in a round of 2 while its second trial is half proposed, while the round runs, or while its
    second trial is recorded (the first one told): the round's trials not told are marked failed, and the
    resumed search goes on to the file's trials."""
    at = 5
    db, spec = tmp_path / "c.db", _resume_file(planted, tmp_path, "interrupted", sampler)
    with monkeypatch.context() as patch:
        if where == "proposing":
            def propose(trial, spec):
                if trial.number == at:
                    trial.suggest_float("weight e1", 0.0, 1.0)
                    raise KeyboardInterrupt
                return real_propose(trial, spec)

            real_propose = searching.propose
            patch.setattr(searching, "propose", propose)
        elif where == "running":
            calls = []

            def run(self, works):
                calls.append(works)
                if len(calls) == 3:  # the round of trials 4 and 5
                    raise KeyboardInterrupt
                return real_run(self, works)

            real_run = LocalRunner.run
            patch.setattr(LocalRunner, "run", run)
        else:
            def tell(self, trial, *args, **kwargs):
                number = trial if isinstance(trial, int) else trial.number
                if number == at and kwargs.get("state") != optuna.trial.TrialState.FAIL:
                    raise KeyboardInterrupt
                return real_tell(self, trial, *args, **kwargs)

            real_tell = optuna.study.Study.tell
            patch.setattr(optuna.study.Study, "tell", tell)
        with pytest.raises(KeyboardInterrupt):
            searching.search(db, spec, workers=2, threads=1)
    study = optuna.load_study(study_name="interrupted", storage=f"sqlite:///{db}")
    failed = [t.number for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    before = _ran(db, "interrupted")
    assert failed == ([at] if where == "recording" else [at - 1, at])
    searching.search(db, spec, resume=True, workers=2, threads=1)
    _resumed(db, "interrupted", before)


def _stdout(runner, args) -> dict:
    from mergepipe.cli import cli

    result = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_search_on_a_server_catalog_keeps_its_study_there_and_resumes(planted, tmp_path, runner,
                                                                       postgres_url):  # noqa: F811
    """On a PostgreSQL catalog the study lives in the server (a team's machines share it), its trials are
    the file catalog's bit for bit, and a second run with --resume continues it there."""
    spec = _search_file(planted, tmp_path, trials=4, study="shared")
    on_file = _stdout(runner, ["search", "--db", tmp_path / "c.db", spec, "--json", "--no-progress"])
    invoke(runner, ["init-db", "--db", postgres_url])
    on_server = _stdout(runner, ["search", "--db", postgres_url, spec, "--json", "--no-progress"])
    assert [(t["params"], t["objective"]) for t in on_server["trials"]] == \
        [(t["params"], t["objective"]) for t in on_file["trials"]]
    storage = postgres_url.replace("postgresql://", "postgresql+psycopg://", 1)
    assert len(optuna.load_study(study_name="shared", storage=storage).trials) == 4
    resumed = _stdout(runner, ["search", "--db", postgres_url, spec, "--trials", "6", "--resume", "--json",
                               "--no-progress"])
    assert [t["number"] for t in resumed["trials"]] == list(range(6))
    assert len(optuna.load_study(study_name="shared", storage=storage).trials) == 6


def test_catalog_export_takes_the_search_studies_along(planted, tmp_path, runner):
    spec = _search_file(planted, tmp_path, trials=3, study="moved")
    _stdout(runner, ["search", "--db", tmp_path / "c.db", spec, "--json", "--no-progress"])
    out = invoke(runner, ["catalog", "export", "--db", tmp_path / "c.db", "--to", tmp_path / "team.db"])
    assert "and 1 search studies" in out

    def trials(db: Path) -> list[tuple]:
        study = optuna.load_study(study_name="moved", storage=f"sqlite:///{db}")
        return [(t.number, t.state, t.params, t.value, t.user_attrs) for t in study.trials]

    assert trials(tmp_path / "team.db") == trials(tmp_path / "c.db")
    resumed = _stdout(runner, ["search", "--db", tmp_path / "team.db", spec, "--trials", "4", "--resume", "--json",
                               "--no-progress"])
    assert [t["number"] for t in resumed["trials"]] == [0, 1, 2, 3]
    # a catalog that never ran a search gets no Optuna tables from an export
    invoke(runner, ["init-db", "--db", tmp_path / "plain.db"])
    invoke(runner, ["catalog", "export", "--db", tmp_path / "plain.db", "--to", tmp_path / "copy.db"])
    with sqlite3.connect(tmp_path / "plain.db") as conn:
        assert "studies" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


@pytest.mark.filterwarnings("error:The reported value is ignored")  # each trial prunes on a mirror trial of its own
def test_serial_and_ray_runs_agree_trial_by_trial(planted, tmp_path, runner):
    """Rounds of 2 trials proposed together, run one after another here and at once on two Ray workers:
    the same parameters, the same objective bits and the same pruned trials, trial by trial."""
    ray = pytest.importorskip("ray", reason="--executor ray needs the `ray` extra")
    spec = _search_file(planted, tmp_path, trials=10, study="rounds")
    spec.write_text(spec.read_text().replace("budget: 100%", "budget: 60%"))
    common = ["--workers", "2", "--threads", "1", "--json", "--no-progress"]
    serial = _stdout(runner, ["search", "--db", tmp_path / "serial.db", spec, *common])
    with ray_instance(ray):
        far = _stdout(runner, ["search", "--db", tmp_path / "ray.db", spec, "--executor", "ray", *common])

    def trials(out: dict) -> list[tuple]:
        return [(t["number"], t["state"], t["params"], t["objective"], t["plan_digest"]) for t in out["trials"]]

    assert trials(far) == trials(serial)
    assert len(serial["trials"]) == 10 and any(t["state"] == "complete" for t in serial["trials"])


def test_layer_groups_search_gradients_and_publish_the_plain_gradient_merge(planted, tmp_path, runner):
    db, spec = tmp_path / "c.db", _search_file(planted, tmp_path, trials=4, study="gradients")
    spec.write_text(spec.read_text() + "layer_groups: 2\n")
    out = _stdout(runner, ["search", "--db", db, spec, "--out", tmp_path / "best", "--json", "--no-progress"])
    best = out["best"]["params"]
    assert set(best) == {"weight e1 group 0", "weight e1 group 1", "weight e2 group 0", "weight e2 group 1"}
    gradients = {str(planted[e]): {"weight": [best[f"weight {e} group 0"], best[f"weight {e} group 1"]]}
                 for e in ("e1", "e2")}
    plain = merge(MergeRequest(base=str(planted["base"]), experts=(str(planted["e1"]), str(planted["e2"])),
                               operator="task_arithmetic", expert_params=gradients, model_id="plain"),
                  db, tmp_path / "plain")
    assert plain.snapshot_id == out["published"]["snapshot_id"]
    # a gradient's ends differ: the two layers were merged with other weights than the embeddings' (t = 0)
    assert best["weight e1 group 0"] != best["weight e1 group 1"]


@pytest.mark.parametrize(("change", "needles"), [
    ("operators: [nope]\n", ("operators:", "nope")),
    ("weight: [0.8, 0.2]\n", ("weight of", "is empty")),
    ("density: [0.0, 0.5]\n", ("density must lie in (0, 1]",)),
    ("objective:\n  - data: missing.txt\n", ("objective data missing.txt: no such file",)),
    ("objective:\n  - {data: held.txt, task: arc_easy}\n", ("each term names either data", "or task")),
    ("objective:\n  - {task: arc_easy, include: nowhere}\n", ("objective include nowhere: no such folder",)),
    ("weight: [0, .inf]\n", ("weight of", "[0.0, inf]", "finite")),
    ("lambda: [-1.0e+308, 1.0e+308]\n", ("lambda:", "[-1e+308, 1e+308]", "finite")),
    ("layer_groups: 0\n", ("layer_groups",)),
    ("sampler: random\n", ("sampler",)),
    ("colour: blue\n", ("colour",)),
])
def test_a_bad_search_file_is_one_line(planted, tmp_path, capsys, change, needles):
    spec = _search_file(planted, tmp_path, trials=2)
    key = change.split(":")[0]
    kept = [line for line in spec.read_text().splitlines(keepends=True)
            if not line.startswith(f"{key}:") and not (key == "objective" and line.startswith("  - data"))]
    spec.write_text("".join(kept) + change)
    refused(["search", "--db", tmp_path / "c.db", spec], capsys, "search file", *needles)


#: Rows of a study's trial edited in Optuna's tables: its value's objective index out of range (IndexError when
#: read), its parameter's distribution no longer JSON.
DAMAGES = {"value": "UPDATE trial_values SET objective = 1", "param": "UPDATE trial_params SET distribution_json = '{'"}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_study_is_refused_by_name_and_the_others_still_run(planted, tmp_path, runner, capsys, damage):
    """Resuming a damaged study is one line naming it; the catalog's other studies still run and resume."""
    db = tmp_path / "c.db"
    for study in ("damaged", "intact"):
        invoke(runner, ["search", "--db", db, _search_file(planted, tmp_path, trials=1, study=study), "--no-progress"])
    with sqlite3.connect(db) as connection:
        connection.execute(f"{DAMAGES[damage]} WHERE trial_id IN (SELECT trial_id FROM trials JOIN studies "
                           "USING (study_id) WHERE study_name = 'damaged')")
    resumed = _stdout(runner, ["search", "--db", db, _search_file(planted, tmp_path, 2, "intact"), "--resume",
                               "--json", "--no-progress"])
    assert [t["number"] for t in resumed["trials"]] == [0, 1]
    invoke(runner, ["search", "--db", db, _search_file(planted, tmp_path, 1, "new"), "--no-progress"])
    refused(["search", "--db", db, _search_file(planted, tmp_path, 2, "damaged"), "--resume", "--no-progress"],
            capsys, "study 'damaged'", "is damaged", "cannot be read")


def test_the_search_file_of_the_docs_runs_as_written(tmp_path, runner):
    """docs/CONCEPTS.md's search file, as it is, in a folder like the demo's (its models and held-out.txt)."""
    [example] = [body for lang, body in fenced_blocks(DOCS / "CONCEPTS.md") if lang == "yaml"]
    make_demo_models(tmp_path / "models")
    (tmp_path / "held-out.txt").write_text(HELD_OUT)
    (tmp_path / "search.yml").write_text(example)
    out = _stdout(runner, ["search", "--db", tmp_path / "c.db", tmp_path / "search.yml", "--trials", 3,
                           "--out", tmp_path / "best", "--json", "--no-progress"])
    assert out["study"] == "demo-search" and len(out["trials"]) == 3
    assert {"weight math", "weight code"} <= set(out["best"]["params"])  # the experts by name
    assert (tmp_path / "best" / "manifest.json").is_file()


def test_trial_lines_name_the_experts_and_pruned_trials_show_no_objective(planted, tmp_path, runner):
    """A pruned trial's value is its running loss where it stopped (Optuna's intermediate value): shown as its
    partial_loss, never as an objective."""
    from mergepipe.cli import cli

    db, spec = tmp_path / "c.db", _resume_file(planted, tmp_path, "pruning", "tpe")
    result = runner.invoke(cli, ["search", "--db", str(db), str(spec), "--json", "--no-progress", "--html",
                                 str(tmp_path / "search.html")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    trials = json.loads(result.stdout)["trials"]
    study = optuna.load_study(study_name="pruning", storage=f"sqlite:///{db}")
    steps = {t.number: t.intermediate_values for t in study.trials}
    lines = {int(line.split(":")[0].split()[1]): line for line in result.stderr.splitlines()
             if line.startswith("trial ")}
    pruned = [t for t in trials if t["state"] == "pruned"]
    assert pruned and len(pruned) < len(trials)
    for trial in trials:
        line = lines[trial["number"]]
        assert "(weight e1=" in line and ", weight e2=" in line and "weight 0" not in line
        if trial["state"] == "pruned":
            partial = steps[trial["number"]][max(steps[trial["number"]])]
            assert trial["objective"] is None and trial["partial_loss"] == partial
            assert line.startswith(f"trial {trial['number']}: pruned (partial loss {partial:.4f}) (")
        else:
            assert trial["partial_loss"] is None
            assert line.startswith(f"trial {trial['number']}: {trial['objective']:.4f} (")
    complete = len(trials) - len(pruned)
    assert f"{len(trials)}: {complete} complete, {len(pruned)} pruned" in (tmp_path / "search.html").read_text()


@pytest.mark.parametrize("how", ["flag", "file"])
def test_a_search_over_models_without_tokenizer_files_takes_tokenizer(planted, tmp_path, runner, capsys, how):
    """The planted models without their tokenizer files: refused in one line naming --tokenizer (no study left
    behind); with it (or the file's tokenizer:), the trials of the search over the models with their files, bit
    for bit."""
    for name in ("base", "e1", "e2"):
        (tmp_path / name).mkdir()
        for side in ("model.safetensors", "config.json"):
            (tmp_path / name / side).write_bytes((planted[name] / side).read_bytes())
    bare = {**planted, "base": tmp_path / "base", "e1": tmp_path / "e1", "e2": tmp_path / "e2"}
    spec = _search_file(bare, tmp_path, trials=2, study="bare")
    refused(["search", "--db", tmp_path / "c.db", spec], capsys, "no tokenizer files", "--tokenizer PATH_OR_HUB_ID")
    write_tokenizer(tmp_path / "tokenizer")
    if how == "file":
        spec.write_text(spec.read_text() + "tokenizer: tokenizer\n")  # relative to the file
    named = _stdout(runner, ["search", "--db", tmp_path / "c.db", spec, "--json", "--no-progress",  # as typed again
                             *(["--tokenizer", tmp_path / "tokenizer"] if how == "flag" else [])])
    own = _stdout(runner, ["search", "--db", tmp_path / "own.db", _search_file(planted, tmp_path / "tokenizer",
                                                                              trials=2, study="bare"),
                           "--json", "--no-progress"])
    assert [(t["params"], t["objective"]) for t in named["trials"]] == \
        [(t["params"], t["objective"]) for t in own["trials"]]


@pytest.mark.parametrize(("module", "sampler"), [("optuna", "tpe"), ("cmaes", "cmaes")])
def test_without_optuna_search_names_its_extra(planted, tmp_path, capsys, monkeypatch, module, sampler):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    spec = _search_file(planted, tmp_path, trials=2, sampler=sampler)
    refused(["search", "--db", tmp_path / "c.db", spec], capsys, f"search needs {module}, which is not installed",
            "pip install 'mergepipe[search]'")
