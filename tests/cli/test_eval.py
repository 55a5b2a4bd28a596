"""`mergepipe eval`: a loss computed as a hand computation does it, equal in memory and on disk, stored once.

The reference loss is computed in the test with transformers' own loading of
the snapshot folder (``from_pretrained``) and plain torch: log-softmax of the
logits in float32, the completion's tokens only.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mergepipe.app.planning import plan as make_plan
from examples import demo
from examples.demo_models import write_tokenizer
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_base, make_expert
from tests.fixtures.cli import invoke, refused, wide_runner

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama with a real (character) tokenizer, and two experts."""
    root = tmp_path_factory.mktemp("eval-family")
    base = make_base(root / "base", arch="llama", dtype="bf16")
    write_tokenizer(base)
    return {"base": base, "e1": make_expert(base, root / "e1", seed=1), "e2": make_expert(base, root / "e2", seed=2)}


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "held-out.jsonl"
    rows = [{"prompt": "Q: two plus two?\nA:", "completion": " four"},
            {"text": "The quick brown fox jumps over the lazy dog. " * 3},
            {"prompt": "def add(a, b):", "completion": "\n    return a + b"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _eval(runner, db, target, data, *extra) -> dict:
    out = invoke(runner, ["eval", "--db", db, target, "--data", data, "--max-tokens", MAX_TOKENS, "--json",
                          "--no-progress", *extra])
    return json.loads(out)


def _reference_loss(folder: Path, data: Path, tokenizer: Path | None = None) -> tuple[float, int]:
    """Mean NLL of the scored tokens, computed independently of MergePipe's evaluation code: ``folder``'s
    model, its own tokenizer or ``tokenizer``'s; ``data`` JSONL, or plain text (a paragraph an example)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer or folder)
    rows = ([json.loads(line) for line in data.read_text().splitlines()] if data.suffix == ".jsonl" else
            [{"text": p.strip()} for p in data.read_text().split("\n\n") if p.strip()])
    total, count = 0.0, 0
    for row in rows:
        prompt, completion = row.get("prompt", ""), row.get("completion", row.get("text"))
        ids = tokenizer(prompt + completion)["input_ids"]
        first = len(tokenizer(prompt)["input_ids"]) if prompt else 1
        windows = [(ids, first)] if prompt else [(ids[s:s + MAX_TOKENS], 1) for s in range(0, len(ids), MAX_TOKENS)]
        for window, start in windows:
            with torch.no_grad():
                logits = model(torch.tensor([window])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            for position in range(max(start, 1), len(window)):
                total -= float(logp[position - 1, window[position]])
                count += 1
    return total / count, count


def test_a_plan_evaluated_in_memory_equals_its_snapshot_and_a_hand_computation(family, data, tmp_path, runner):
    db = tmp_path / "c.db"
    made = make_plan(MergeRequest(base=str(family["base"]), experts=(str(family["e1"]), str(family["e2"])),
                                  operator="ties", params={"density": 0.5}, budget="50%"), db, save=True)
    in_memory = _eval(runner, db, made.digest[:12], data)
    assert in_memory["in_memory"] and not in_memory["stored"]
    assert not list(tmp_path.glob("*/manifest.json"))  # nothing published

    out = tmp_path / "merged"
    invoke(runner, ["execute", "--db", db, "--plan", made.digest[:12], "--out", out, "--model-id", "merged",
                    "--no-progress"])
    stored = _eval(runner, db, "merged", data)
    assert stored["stored"] and stored["loss"] == in_memory["loss"]  # one plan, one result
    on_disk = _eval(runner, db, str(out), data, "--again")
    assert not on_disk["in_memory"] and not on_disk["stored"]
    assert on_disk["loss"] == in_memory["loss"]  # to the last bit
    assert on_disk["tokens"] == in_memory["tokens"]

    loss, tokens = _reference_loss(out, data)
    assert in_memory["tokens"] == tokens
    assert in_memory["loss"] == pytest.approx(loss, rel=1e-5)
    assert in_memory["perplexity"] == pytest.approx(math.exp(in_memory["loss"]), rel=1e-12)
    assert in_memory["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)  # batched and padded vs one by one


def test_a_result_is_stored_once_per_data_and_a_changed_dataset_is_a_new_result(family, data, tmp_path, runner):
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", family["base"]])
    first = _eval(runner, db, "base", data)
    again = _eval(runner, db, "base", data)
    assert not first["stored"] and again["stored"] and again["loss"] == first["loss"]
    assert again["data_digest"] == first["data_digest"]
    by_folder = _eval(runner, db, str(family["base"]), data)  # the registered folder is the same model
    assert by_folder["stored"] and by_folder["subject"] == first["subject"]

    data.write_text(data.read_text() + json.dumps({"text": "One more line of held-out text."}) + "\n")
    changed = _eval(runner, db, "base", data)
    assert not changed["stored"] and changed["data_digest"] != first["data_digest"]
    assert changed["tokens"] > first["tokens"]
    other_window = _eval(runner, db, "base", data, "--max-tokens", 32)  # a setting that changes the value
    assert not other_window["stored"]

    text = invoke(runner, ["eval", "--db", db, "base", "--data", data, "--max-tokens", MAX_TOKENS, "--no-progress"])
    assert text.startswith("base: loss ") and "stored result" in text


def test_plain_text_paragraphs_are_examples(family, tmp_path, runner):
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", family["base"]])
    text, jsonl = tmp_path / "a.txt", tmp_path / "a.jsonl"
    paragraphs = ["First paragraph of prose.", "Second one,\nover two lines."]
    text.write_text("\n\n".join(paragraphs) + "\n")
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    assert _eval(runner, db, "base", text)["loss"] == _eval(runner, db, "base", jsonl)["loss"]


@pytest.mark.parametrize(("content", "needles"), [
    ('{"prompt": "x"}\n', ("a.jsonl:1", '"text", or "prompt" and "completion"')),
    ("not json\n", ("a.jsonl:1", "not JSON")),
    ("", ("no text to evaluate",)),
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", ("a.jsonl:1", "nested too deeply")),
    ('{"text": "ok"}\n{"prompt": "a", "completion": "\\ud800"}\n', ("a.jsonl:2", "lone surrogate")),
    ('{"text": "ok", "n": ' + "9" * 10_000 + "}\n", ("a.jsonl:1", "cannot be read", "10000 digits")),
])
def test_bad_data_is_one_line(family, tmp_path, runner, capsys, content, needles):
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", family["base"]])  # a tokenizer to reach
    path = tmp_path / "a.jsonl"
    path.write_text(content)
    refused(["eval", "--db", db, "base", "--data", path], capsys, *needles)


@pytest.mark.parametrize("kind", ["/dev/zero", "FIFO", "pipe"])
def test_an_endless_stream_is_refused_at_the_size_limit(family, tmp_path, capsys, kind):
    """stat() says 0 bytes for a stream: the limit is counted as bytes arrive."""
    path, feeder = Path("/dev/zero"), None
    if kind == "FIFO":
        path = tmp_path / "fifo"
        os.mkfifo(path)
        feeder = subprocess.Popen(["sh", "-c", 'exec yes > "$0"', str(path)])
    elif kind == "pipe":  # what `--data <(yes)` gives
        feeder = subprocess.Popen(["yes"], stdout=subprocess.PIPE)
        path = Path(f"/dev/fd/{feeder.stdout.fileno()}")
    refused(["eval", "--db", tmp_path / "c.db", family["base"], "--data", path], capsys, "more than 256 MiB")
    if feeder is not None:
        if feeder.stdout:
            feeder.stdout.close()
        assert feeder.wait(timeout=30) != 0  # yes ends at the closed pipe


def test_unknown_targets_and_files_are_one_line(family, data, tmp_path, runner, capsys):
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", family["base"]])
    refused(["eval", "--db", db, "nope", "--data", data], capsys, "'nope' is not a snapshot, model, plan or folder")
    refused(["eval", "--db", db, "base", "--data", tmp_path / "missing.txt"], capsys, "no such data file")
    loose = tmp_path / "loose"
    shutil.copytree(family["e1"], loose)
    refused(["eval", "--db", db, str(loose), "--data", data], capsys, "register it first")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # transformers refuses the one, makes an empty one of the other
def test_a_model_without_tokenizer_files_is_one_line_and_evaluates_with_tokenizer(family, data, tmp_path, runner,
                                                                                   capsys, arch):
    db = tmp_path / "c.db"
    bare = make_base(tmp_path / "bare", arch=arch)  # weights, config.json and a tokenizer_config.json: no tokenizer
    invoke(runner, ["register", "--db", db, "--model-id", "bare", "--uri", bare])
    refused(["eval", "--db", db, "bare", "--data", data], capsys, f"{bare}: no tokenizer files",
            "name one with --tokenizer PATH_OR_HUB_ID")
    refused(["eval", "--db", db, "bare", "--data", data, "--tokenizer", tmp_path], capsys,
            f"--tokenizer {tmp_path}: no tokenizer there (it holds no tokenizer files)")
    named = _eval(runner, db, "bare", data, "--tokenizer", family["base"])
    loss, tokens = _reference_loss(bare, data, tokenizer=family["base"])
    assert named["tokens"] == tokens and named["loss"] == pytest.approx(loss, rel=1e-5)

    # a tokenizer named is part of the data's digest: the model's own one, once it has it, is another result
    write_tokenizer(bare)
    own = _eval(runner, db, "bare", data)
    assert not own["stored"] and own["data_digest"] != named["data_digest"] and own["loss"] == named["loss"]


def test_a_merge_without_tokenizer_files_is_evaluated_with_its_bases(tmp_path, data, runner):
    """A snapshot holds the tokenizer files its base had when it was merged; one merged from a base without
    them is tokenised with the base's once it has them."""
    db, base = tmp_path / "c.db", make_base(tmp_path / "base", arch="llama")
    expert = make_expert(base, tmp_path / "e1", seed=1)
    invoke(runner, ["merge", "--db", db, "--base", base, "--experts", expert, "--operator", "task_arithmetic",
                    "--out", tmp_path / "merged", "--model-id", "merged", "--no-progress"])
    write_tokenizer(base)
    scored = _eval(runner, db, "merged", data)
    loss, tokens = _reference_loss(tmp_path / "merged", data, tokenizer=base)
    assert scored["tokens"] == tokens and scored["loss"] == pytest.approx(loss, rel=1e-5)


def test_the_demo_ends_with_an_evaluation_of_its_merges(tmp_path, runner):
    """`make demo` (examples/demo.py): its models have a tokenizer, and its last step evaluates its merges."""
    workdir = tmp_path / "demo"
    result = runner.invoke(demo.main, ["--workdir", str(workdir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = result.stdout
    last = output.split("11. evaluate the merges")[1]
    lines = [line for line in last.splitlines() if line.startswith("merged-")]
    assert [line.split(":")[0] for line in lines] == ["merged-25", "merged-full"]
    stored = json.loads(invoke(runner, ["eval", "--db", workdir / "catalog.db", "merged-full", "--data",
                                        workdir / "held-out.txt", "--json"]))
    assert stored["stored"] and lines[1].startswith(f"merged-full: loss {stored['loss']:.4f}, ")
    loss, tokens = _reference_loss(workdir / "merged-full-v2", workdir / "held-out.txt")  # merged-full@2's folder
    assert stored["tokens"] == tokens and stored["loss"] == pytest.approx(loss, rel=1e-5)
