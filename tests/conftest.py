"""Fixtures for the engine's tests: a warm launcher, and a guard that fails a test on leaks.

Every test runs real processes: the launcher is this process's own (``get_client()``), ranks
are real forks, and the failure tests start real caller processes (tests/helpers).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

# Every launcher the tests start (this process's, and those of the kernels and notebooks it
# starts, which inherit the environment) keeps its run registry here, not in the user's
# Jupyter runtime directory: a real JupyterLab's sidebar never lists test runs.
os.environ.setdefault("NBTRAIN_RUNTIME_DIR", tempfile.mkdtemp(prefix="nbtrain-test-registry-"))
# The tests count each kernel's own launcher among its descendants, so their kernels start
# their own (as where no template can be used); tests/test_template.py switches it on, in a
# directory of its own per test, and removes every template it starts.
os.environ.setdefault("NBTRAIN_TEMPLATE", "0")
os.environ.setdefault("NBTRAIN_TEMPLATE_DIR", tempfile.mkdtemp(prefix="nbtrain-test-template-"))

import nbtrain  # noqa: F401 - the package as a notebook imports it (importing starts nothing)
from nbtrain.kernel import launcher_connection

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # for `helpers` (ranks get this sys.path too); pytest's prepend mode adds it
    sys.path.insert(0, _TESTS)

from helpers import procs

# The browser tests' ``session`` fixture (JupyterLab and Chromium, every process checked gone).
pytest_plugins = ["browser_helpers"]

LAUNCHER_READY_SECONDS = 120.0  # importing torch on a loaded 2-core machine
CHILDREN_GONE_SECONDS = 5.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes several seconds or a lot of memory (still run by default)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu; skipped where none exists)")


@pytest.fixture
def launcher() -> launcher_connection.LauncherClient:
    """The warm launcher, ready to fork ranks (a new one if a test killed the last)."""
    client = launcher_connection.get_client()
    assert client.ready.wait(LAUNCHER_READY_SECONDS), f"the launcher was not ready in time: {client.exit_detail()}"
    return client


@pytest.fixture(scope="module")
def kernel() -> Iterator[Any]:
    """A real Jupyter kernel with nbtrain loaded, shared by a module's tests (a module may define its own)."""
    from kernel_helpers import nbtrain_kernel  # nbclient and nbformat: only where a test asks for a kernel

    yield from nbtrain_kernel()


class LeakGuard:
    """What existed before the test: /dev/shm entries and the launcher's children."""

    def __init__(self) -> None:
        self.shm = procs.shm_entries()
        self.children = {p.pid for p in procs.launcher_children()}

    def leaks(self) -> list[str]:
        # Standby ranks (the next run's, waiting) are shown and held on purpose: released here,
        # and then nothing else of the test's may be left.
        if launcher_connection._client is not None and launcher_connection._client.alive:
            launcher_connection._client.release_standby()
        problems = []
        new_shm = procs.shm_entries() - self.shm
        if new_shm:
            problems.append(f"new /dev/shm entries: {sorted(new_shm)}")
        left = [p.pid for p in procs.launcher_children() if p.pid not in self.children]
        left = procs.wait_gone(left, CHILDREN_GONE_SECONDS)
        if left:
            details = []
            for pid in left:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        command = f.read().replace(b"\0", b" ").decode(errors="replace")
                    details.append(f"{pid} {command}")
                except OSError:
                    details.append(str(pid))
            procs.kill_pids(left)  # so one leak does not fail every later test
            problems.append(f"launcher children still alive after the test: {details}")
        return problems

    def check(self) -> None:
        problems = self.leaks()
        assert not problems, "; ".join(problems)


@pytest.fixture(autouse=True)
def leak_guard() -> LeakGuard:
    """Fails the test if it left a rank (or any launcher child) alive or a /dev/shm entry."""
    guard = LeakGuard()
    yield guard
    problems = guard.leaks()
    if problems:
        pytest.fail("leaked: " + "; ".join(problems), pytrace=False)
