"""Several processes share one catalog: writers queue, nobody fails."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mergepipe.catalog import Catalog
from tests.catalog.conftest import SMALL_BLOCK_BYTES
from tests.catalog.helpers import row_count

# Each child registers the shared base and its own expert, then analyses every
# registered checkpoint against the base, racing the other child for the same
# rows. A start file lines both up so their transactions really overlap.
CHILD = """
import sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from mergepipe.analysis.analyze import analyze
from mergepipe.catalog import Catalog
from mergepipe.analysis.register import register_model

db, start, ready, base_dir, model_id, model_dir = sys.argv[1:]
Path(ready).touch()
while not Path(start).exists():
    time.sleep(0.005)
with Catalog.open(db) as catalog:
    register_model(catalog, "base", base_dir)
    register_model(catalog, model_id, model_dir)
    analyze(catalog, [model_id], base_id="base", progress=False)
    analyze(catalog, None, base_id="base", progress=False)
    analyze(catalog, None, progress=False)
print("ok", model_id)
"""


def test_two_processes_register_and_analyse_at_once(tmp_path: Path, tiny_family):
    db = tmp_path / "catalog.db"
    Catalog.create(db, block_bytes=SMALL_BLOCK_BYTES).close()
    start = tmp_path / "start"
    children = []
    for model_id in ("e1", "e2"):
        ready = tmp_path / f"ready-{model_id}"
        args = [str(db), str(start), str(ready), str(tiny_family["base"]), model_id, str(tiny_family[model_id])]
        children.append((ready, subprocess.Popen(
            [sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )))
    deadline = time.monotonic() + 120
    while not all(ready.exists() for ready, _ in children):
        assert time.monotonic() < deadline, "children did not start"
        assert all(p.poll() is None for _, p in children), [p.communicate() for _, p in children]
        time.sleep(0.01)
    start.touch()
    for _, proc in children:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.startswith("ok")

    with Catalog.open(db) as catalog:
        assert {m.id for m in catalog.models.list()} == {"base", "e1", "e2"}
        assert catalog.stats.is_analyzed("e1", "base") and catalog.stats.is_analyzed("e2", "base")
        n_blocks = catalog.models.get("base").n_blocks
        for model_id in ("base", "e1", "e2"):
            assert catalog.model_status(model_id).fully_hashed
    assert row_count(db, "analyses") == 2
    assert row_count(db, "block_deltas") == 2 * n_blocks
