"""Names and environments people did not mean as attacks, and attackers did: rich markup in paths and tensor
names (`[/x]` raised, `[red]` vanished), a right-to-left override in a tensor name on an HTML page, huge
weights whose error bound overflows, and a disk too full for the staging marker. Each as a user types it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog

MARKUP = "[/x][red]"
RLO = "\u202e"
#: Tensor names a person could write: rich markup, and an RLO that turns "gnp.exe" around on a page.
NAMES = {f"layer{MARKUP}.weight": (64, 16), f"head{RLO}gnp.exe": (32, 16), "norm.weight": (16,)}


def write_model(directory: Path, seed: int, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if base is None:
        tensors = {n: torch.randn(shape, generator=gen) for n, shape in NAMES.items()}
    else:
        tensors = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({"model_type": "custom"}))
    return tensors


@pytest.fixture
def odd(tmp_path):
    """A base and two experts with markup and RLO in tensor names, in folders with markup in their names."""
    root = tmp_path / f"models{MARKUP}"
    base = write_model(root / "base", 0)
    write_model(root / "e1", 1, base)
    write_model(root / "e2", 2, base)
    return root


def test_markup_in_paths_and_tensor_names_is_printed_as_it_is(odd, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    db = tmp_path / "c.db"
    invoke(runner, ["init-db", "--db", db, "--block-bytes", "1KiB"])
    for name in ("base", "e1", "e2"):
        invoke(runner, ["register", "--db", db, "--model-id", name, "--uri", odd / name])
    out = tmp_path / f"merged{MARKUP}"
    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5"]
    merged = invoke(runner, ["merge", *args, "--out", out, "--model-id", "m", "--no-progress"])
    assert f"merged{MARKUP}" in merged
    invoke(runner, ["merge", *args, "--budget", "50%", "--out", tmp_path / "m2", "--model-id", "m", "--no-progress"])
    assert str(odd / "e1") in invoke(runner, ["show", "--db", db, "e1"])
    assert "e2" in invoke(runner, ["models", "--db", db])
    assert f"merged{MARKUP}" in invoke(runner, ["snapshots", "--db", db])
    assert f"layer{MARKUP}.weight" in invoke(runner, ["explain", "--db", db, "m@1"])
    assert f"layer{MARKUP}.weight" in invoke(runner, ["diff", "--db", db, "m@1", "m@2"])
    assert "m@1" in invoke(runner, ["lineage", "--db", db, "m"])


def test_a_right_to_left_override_never_reaches_a_page(odd, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    db = build_catalog(tmp_path / "c.db", 1024, {n: odd / n for n in ("base", "e1", "e2")})
    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "task_arithmetic", "--no-progress"]
    invoke(runner, ["merge", *args, "--out", tmp_path / "a", "--model-id", "m"])
    invoke(runner, ["merge", *args, "--budget", "40%", "--out", tmp_path / "b", "--model-id", "m"])
    for command in (["explain", "--db", db, "m@2"], ["diff", "--db", db, "m@1", "m@2"]):
        page = tmp_path / f"{command[0]}.html"
        invoke(runner, [*command, "--html", page])
        text = page.read_text(encoding="utf-8")
        assert RLO not in text and "head&lt;U+202E&gt;gnp.exe" in text


@pytest.mark.parametrize("case", ["exploded expert", "huge weight"])
def test_overflowing_numbers_are_one_line_and_no_numpy_warning(odd, tmp_path, case):
    """An expert with weights near float32's largest (its block norms overflow: refused at analysis), and a
    weight that makes the error bound overflow float64 (refused at planning): one line each, and nothing
    else on stderr (in a new process: Python shows each warning once per process)."""
    big = {n: torch.full(shape, 3e38) for n, shape in NAMES.items()}
    (tmp_path / "big").mkdir()
    save_file(big, str(tmp_path / "big" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "big" / "config.json").write_text("{}")
    db = build_catalog(tmp_path / "c.db", 1024, {"base": odd / "base", "e1": odd / "e1", "big": tmp_path / "big"})
    experts, extra = (["e1", "big"], []) if case == "exploded expert" else (["e1"], ["--weights", "1e300"])
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "merge", "--db", str(db), "--base", "base",
                           "--experts", *experts, *extra, "--operator", "ties", "--density", "0.5", "--budget", "40%",
                           "--out", str(tmp_path / "out"), "--model-id", "m", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("analysed ")]
    assert proc.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: "), proc.stderr
    assert "Warning" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if case == "exploded expert":
        assert "too large to merge in float32" in errors[0]
    else:  # the kernel's check of what it merged, or the planner's of the bound, whichever sees it first
        assert "contains NaN or Inf" in errors[0] or "error bound overflows" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A mounted tmpfs of 64 KiB, filled but for a few bytes; a skip where mounting is not allowed."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        with open(path / "filler", "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 512)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.mark.parametrize("command", ["merge", "merge --from", "integrate"])
def test_a_disk_too_full_for_the_staging_marker_is_one_line(tiny_family, tmp_path, tiny_disk, capsys, monkeypatch,
                                                             command):
    db = build_catalog(tmp_path / "c.db", 4096, dict(tiny_family), base="base", experts=["e1", "e2"])
    args = ["--db", str(db), "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5",
            "--quiet"]
    if command == "merge --from":
        invoke(wide_runner(monkeypatch), ["merge", *args, "--out", tmp_path / "v1", "--model-id", "m"])
        argv = ["merge", *args, "--from", "m", "--budget", "50%", "--out", str(tiny_disk / "out"), "--model-id", "m"]
    elif command == "merge":
        argv = ["merge", *args, "--out", str(tiny_disk / "out"), "--model-id", "m"]
    else:
        recipe = tmp_path / "recipe.yml"
        recipe.write_text(yaml.safe_dump({"base": str(tiny_family["base"]),
                                          "experts": {"e1": str(tiny_family["e1"])}, "operator": "ties",
                                          "params": {"density": 0.5},
                                          "output": {"root": str(tiny_disk), "model_id": "m"}}))
        argv = ["integrate", "--db", str(db), str(recipe), "--no-progress"]
    code, _, err = run_main(argv, capsys)
    assert code not in (0, None) and err.count("\n") == 1 and "Traceback" not in err, err
    assert "No space left on device" in err and "nothing was published" in err
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler"]


#: What an `--out` may hold that a terminal would act on: a window-title change, a screen clear, a bell.
ESCAPES = "\x1b]0;owned\x07\x1b[2J"


def test_control_characters_in_paths_are_printed_spelled_out(tiny_family, tmp_path, monkeypatch):
    """Paths were printed raw by `merge` and `snapshots` (on every teammate's terminal, with a shared catalog):
    every control character is spelled as its code point, as pages show bidirectional controls."""
    runner = wide_runner(monkeypatch)
    db = build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1")})
    out = tmp_path / f"out{ESCAPES}{RLO}gnp.exe"
    merged = invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "--operator",
                             "task_arithmetic", "--out", out, "--model-id", "m", "--no-progress"])
    spelled = "out<U+001B>]0;owned<U+0007><U+001B>[2J<U+202E>gnp.exe"
    for text in (merged, invoke(runner, ["snapshots", "--db", db]), invoke(runner, ["rm", "--db", db, "m"])):
        assert spelled in text and not any(c in text for c in ("\x1b", "\x07", RLO)), text
