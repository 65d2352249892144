"""Every example in nbtrain's docstrings runs and prints what it says.

The modules are found by reading the package's sources, not listed here, so a new module's
examples are run as soon as it has any. Examples that start a run use the warm launcher the
suite shares; a process an example starts beyond that is a leak and fails the test.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import os
import pathlib
import types

import psutil
import pytest

import nbtrain
from helpers import procs

PACKAGE = pathlib.Path(nbtrain.__file__).parent
PROCESS_GONE_SECONDS = 5.0


def modules_with_examples() -> list[str]:
    """The dotted names of nbtrain's modules whose source has a ``>>>`` example."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" not in path.read_text(encoding="utf-8"):
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def run_examples(module: object) -> tuple[doctest.TestResults, str]:
    """Runs ``module``'s examples as ``doctest.testmod`` would; returns the counts and the report."""
    report = io.StringIO()
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=report.write)
    return runner.summarize(verbose=False), report.getvalue()


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def launcher_pid() -> int | None:
    launcher = procs.current_launcher()
    return None if launcher is None else launcher.pid


def test_the_examples_are_found_in_every_package():
    names = modules_with_examples()
    assert {
        "nbtrain",
        "nbtrain.messages.wire",
        "nbtrain.kernel.defaults",
        "nbtrain.rank.api",
        "nbtrain.launch_server.rankpipes",
    } <= set(names)
    assert all(importlib.util.find_spec(name) is not None for name in names)


def nbtrain_settings() -> dict[str, str]:
    """This process's ``NBTRAIN_*`` variables (torch sets others of its own when first used)."""
    return {key: value for key, value in os.environ.items() if key.startswith("NBTRAIN_")}


@pytest.mark.parametrize("name", modules_with_examples())
def test_module_examples_run(name: str):
    before = children()
    environment = nbtrain_settings()  # kernels and launchers started by later tests inherit them
    module = importlib.import_module(name)
    results, report = run_examples(module)
    assert results.attempted > 0, f"{name} has '>>>' in its source, but doctest found no example there"
    assert results.failed == 0, f"{results.failed} of {name}'s {results.attempted} examples failed:\n{report}"
    assert nbtrain_settings() == environment, f"{name}'s examples left nbtrain's settings in os.environ changed"
    started = children() - before - {launcher_pid()}
    left = procs.wait_gone(started, PROCESS_GONE_SECONDS)
    assert not left, f"{name}'s examples left processes running: {left}"


def test_a_failing_example_is_reported():
    # The runner above must be able to fail: a wrong expected output is counted and shown.
    module = types.ModuleType("example_module")
    module.__doc__ = ">>> 6 * 7\n41\n"
    results, report = run_examples(module)
    assert (results.attempted, results.failed) == (1, 1)
    assert "Expected:\n    41\nGot:\n    42" in report
