"""Ctrl-C during a Ray run is noticed by the executor's own SIGINT handler, whatever Ray does with the
KeyboardInterrupt (no Ray needed here)."""

from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest

from mergepipe.engine.ray_executor import interrupts_noticed


def _interrupt_and_swallow() -> None:
    """What a library that consumes a KeyboardInterrupt does: the interrupt arrives, nothing propagates."""
    try:
        _thread.interrupt_main()
        time.sleep(0.5)  # the handler runs at the main thread's next check, well within this
    except KeyboardInterrupt:
        pass


def test_a_swallowed_ctrl_c_is_still_noticed_and_the_handler_restored():
    before = signal.getsignal(signal.SIGINT)
    with interrupts_noticed() as interrupted:
        assert not interrupted()
        _interrupt_and_swallow()
        assert interrupted()
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_still_raises_keyboard_interrupt():
    with interrupts_noticed() as interrupted, pytest.raises(KeyboardInterrupt):
        _thread.interrupt_main()
        time.sleep(0.5)
    assert interrupted()


def test_outside_the_main_thread_nothing_changes():
    seen: list = []

    def run() -> None:
        with interrupts_noticed() as interrupted:
            seen.append((signal.getsignal(signal.SIGINT), interrupted()))

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(before, False)]


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts_noticed() as interrupted:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            _thread.interrupt_main()  # does nothing: Python does not handle the signal
            time.sleep(0.1)
            assert not interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)
