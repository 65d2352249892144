"""The sidebar's side of a post-mortem: a failed run's rank held for ``%nbtrain_debug`` is
listed by the server extension with what it holds, and Dismiss releases it.

A real kernel fails a real 2-rank run (its rank 1 is held), and a real Jupyter server
(jupyter_server's pytest plugin, in process) reads the same run registry. The kernel is
driven from one thread of its own: its client's event loop must not be the server's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

if importlib.util.find_spec("pytest_jupyter") is None:  # pragma: no cover - the browser extra is missing
    if os.environ.get("NBTRAIN_SKIP_BROWSER_TESTS") != "1":
        raise ImportError("pytest-jupyter is missing: run `bash .ci/browser-setup` (pip install -e '.[browser]')")
    pytest.skip("NBTRAIN_SKIP_BROWSER_TESTS=1 and pytest-jupyter is missing", allow_module_level=True)

from kernel_helpers import NotebookKernel, wait_gone
from nbtrain.system import registry

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = pytest.mark.timeout(600)

GONE_SECONDS = 1.0  # issue 30's bound: a released rank's process is gone within it
RELEASED_SECONDS = 10.0  # the launcher reaps it and tells the kernel (a loaded 2-core machine)
_T = TypeVar("_T")

FAIL_CELL = """%%distributed --devices 2 --accelerator cpu
def scale(batch):
    return batch / (1 if nbtrain.rank() == 0 else undefined_name)

out = scale(torch.arange(6.0))
"""


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"nbtrain.serverext": True}}}


@pytest.fixture(autouse=True)
def registry_dir(tmp_path, monkeypatch):
    """The kernel started below inherits it, so its launcher writes where the server reads."""
    monkeypatch.setenv(registry.DIRECTORY_VARIABLE, str(tmp_path / "registry"))
    return tmp_path / "registry"


class KernelThread:
    """A NotebookKernel whose every call runs on one thread of its own."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.kernel: NotebookKernel = self.pool.submit(NotebookKernel).result()

    def call(self, action: Callable[[NotebookKernel], _T]) -> _T:
        return self.pool.submit(action, self.kernel).result()

    async def in_background(self, action: Callable[[NotebookKernel], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, action, self.kernel)

    def close(self) -> None:
        self.pool.submit(self.kernel.shutdown).result()
        self.pool.shutdown()


@pytest.fixture
def held() -> Iterator[tuple[KernelThread, int]]:
    """A kernel whose last run failed on rank 1, held for a post-mortem; that rank's pid."""
    kernel = KernelThread()
    try:
        kernel.call(lambda k: k.run_ok("%load_ext nbtrain\nimport torch, nbtrain\n"))
        out = kernel.call(lambda k: k.run(FAIL_CELL))
        assert out.error is not None and out.error["ename"] == "RankError", out.text
        assert "%nbtrain_debug opens the debugger in rank 1's frames" in out.text, out.text
        pid = kernel.call(lambda k: k.value("nbtrain.kernel.launcher_connection.current_client().held.pid"))
        yield kernel, pid
    finally:
        kernel.close()


def _still_held(kernel: NotebookKernel) -> Any:
    """Whether the kernel still thinks a rank is held, after waiting (bounded) for the release."""
    code = (
        "import time as _t\n_c = nbtrain.kernel.launcher_connection.current_client()\n"
        f"_end = _t.monotonic() + {RELEASED_SECONDS}\n"
        "while _c.held is not None and _t.monotonic() < _end:\n    _t.sleep(0.02)\n"
    )
    kernel.run_ok(code)
    return kernel.value("_c.held is not None")


async def _failed_runs(jp_fetch) -> list[dict[str, Any]]:
    response = await jp_fetch("nbtrain", "api", "runs")
    return [run for run in json.loads(response.body) if run["state"] == "failed"]


async def test_dismiss_releases_the_rank_a_failed_run_holds(jp_fetch, held):
    kernel, pid = held
    (run,) = await _failed_runs(jp_fetch)
    assert run["held"].startswith(f"rank 1 (pid {pid}) kept for %nbtrain_debug, holding "), run
    assert "MiB of host memory" in run["held"] and pid in run["live_pids"], run

    response = await jp_fetch("nbtrain", "api", "runs", run["id"], "clean", method="POST", body=b"")
    assert pid in json.loads(response.body)["signalled"]
    assert wait_gone([pid], GONE_SECONDS) == [], "the held rank outlived its Dismiss"
    # The launcher has taken the release in (it told the kernel) and did not write the record back.
    assert await kernel.in_background(_still_held) is False
    assert registry.read(run["id"]) is None
    assert await _failed_runs(jp_fetch) == []
    missing = await kernel.in_background(lambda k: k.run("%nbtrain_debug"))
    assert "no rank is held for a post-mortem" in missing.text, missing.text
