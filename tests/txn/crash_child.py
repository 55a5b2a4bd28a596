"""Run one publish against a catalog and die at a named step (used by test_crash.py).

    python -m tests.txn.crash_child DB OUT MODEL_ID STEP exit|sigkill
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from mergepipe.catalog.db import Catalog
from tests.txn.conftest import catalog_parents
from tests.txn.helpers import publish_snapshot


def main(db: str, out: str, model_id: str, step: str, mode: str) -> None:
    def die_at(name: str) -> None:
        if name != step:
            return
        if mode == "exit":
            os._exit(9)  # no cleanup handlers, no finally blocks
        os.kill(os.getpid(), signal.SIGKILL)

    catalog = Catalog.open(db)
    publish_snapshot(catalog, Path(out), model_id, catalog_parents(catalog), on_step=die_at)
    sys.exit(0)  # only reached if the step never fired


if __name__ == "__main__":
    main(*sys.argv[1:])
