"""Keep the caller's garbage collector out of a launch's first moments.

A kernel that imported torch holds millions of objects; a full collection there takes
~60 ms of one core. When the pickling of a run's payload happens to trigger one, every
rank waits for it; when it falls while the ranks start, it takes a core from them (on a
2-core machine, the first step came 0.03-0.06 s later). So a launch holds the collector
from the call until its ranks have had time to start (:data:`HOLD_SECONDS`) or its run
ends, whichever comes first; the collection the held allocations owe runs then.

Holds nest (runs started together share one pause) and a caller that turned the
collector off itself keeps it off.

Example:
    >>> import gc
    >>> hold = hold_collections()
    >>> gc.isenabled()
    False
    >>> hold.release()
    >>> hold.release()  # a second release changes nothing
    >>> gc.isenabled()
    True
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator

HOLD_SECONDS = 1.0  # a cold launch's ranks take their first step in ~0.06 s here

_lock = threading.Lock()
_holders = 0
_fork_hook = False
_deadlines: dict[Hold, float] = {}  # holds released by the releasing thread at a monotonic time
_wake = threading.Event()  # a deadline was added
_releaser: threading.Thread | None = None


class Hold:
    """One launch's hold on the collector; released once, by whichever comes first."""

    def __init__(self, owns: bool) -> None:
        self._owns = owns  # False: the collector was already off, by the caller's choice
        self.released = threading.Event()

    def release_later(self, seconds: float = HOLD_SECONDS) -> None:
        """Release after ``seconds`` unless :meth:`release` came first.

        One thread serves every hold of the process: starting a thread per launch cost about
        a millisecond of the kernel's CPU just as its ranks start.
        """
        global _releaser
        started = None
        with _lock:
            if not self._owns:
                return
            _deadlines[self] = time.monotonic() + seconds
            if _releaser is None:
                _releaser = started = threading.Thread(target=_release_when_due, name="nbtrain-gc-hold", daemon=True)
        if started is not None:
            started.start()
        _wake.set()

    def release(self) -> None:
        """Give the collector back (once the last hold is released); idempotent."""
        global _holders
        with _lock:
            _deadlines.pop(self, None)
            if not self._owns:
                return
            self._owns = False
            _holders -= 1
            if _holders == 0:
                gc.enable()
        self.released.set()


def _release_when_due() -> None:
    """The releasing thread: each hold at its deadline, waking when a deadline is added."""
    while True:
        _wake.clear()  # before reading the deadlines: one added meanwhile wakes the wait below
        with _lock:
            now = time.monotonic()
            due = [hold for hold, at in _deadlines.items() if at <= now]
            later = [at - now for at in _deadlines.values() if at > now]
        for hold in due:
            hold.release()
        _wake.wait(min(later) if later else None)


def hold_collections() -> Hold:
    """Turn the collector off until the returned hold is released (see the module's doc)."""
    global _holders, _fork_hook
    with _lock:
        if not _fork_hook:  # registered on first use: importing this module changes nothing
            os.register_at_fork(after_in_child=_forget_holds_in_child)
            _fork_hook = True
        if _holders == 0 and not gc.isenabled():
            return Hold(owns=False)
        _holders += 1
        gc.disable()
        return Hold(owns=True)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold the collector for a section (planning a run); a launch's own hold inside outlives it."""
    hold = hold_collections()
    try:
        yield
    finally:
        hold.release()


def _forget_holds_in_child() -> None:
    """A process forked meanwhile (a DataLoader worker) has no releasing thread to release its holds."""
    global _holders, _lock, _releaser, _wake
    _lock = threading.Lock()  # the parent's may have been held by another thread at the fork
    _releaser, _wake = None, threading.Event()
    _deadlines.clear()
    if _holders:
        _holders = 0
        gc.enable()
