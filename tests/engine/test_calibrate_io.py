"""What `mergepipe calibrate` times as a merge's start-up (engine/calibrate_io.py)."""

from __future__ import annotations

import subprocess
import sys

from mergepipe.engine.calibrate_io import CLIENT_PROBE, STARTUP_PROBE, measure_served_startup, measure_startup


def test_the_startup_probe_loads_what_a_merge_loads_before_its_first_read():
    """`merge` imports torch and the engine only once it has a plan (cli/merge_cmds.py): a probe that
    stopped at the command's module would time a start-up a second too short."""
    check = STARTUP_PROBE + "\nimport sys\nprint(sorted({'torch', 'mergepipe.engine.engine'} - set(sys.modules)))\n"
    probe = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    age, missing = probe.stdout.strip().splitlines()
    assert missing == "[]"
    assert float(age) > 0  # Linux: the process's age from /proc


def test_measure_startup_returns_the_probe_seconds_and_an_exit_share():
    startup, exit_share = measure_startup(runs=1)
    assert 0 < startup < 60
    assert 0 < exit_share < 10


def test_the_client_probe_loads_what_the_mergepipe_command_loads_before_asking_a_server():
    """Neither torch nor click: asking a server must cost milliseconds (launch.py)."""
    heavy = "('torch', 'click', 'rich', 'numpy', 'mergepipe.cli')"
    check = CLIENT_PROBE + f"\nimport sys\nprint(sorted(m for m in {heavy} if m in sys.modules))\n"
    probe = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]"


def test_measure_served_startup_times_a_client_and_a_fork():
    seconds = measure_served_startup(runs=1)
    assert seconds is not None and 0 < seconds < 60
