"""The server extension's stop endpoint keeps what the run learned, like the kernel's own stop.

A real kernel trains (tests/test_graceful_stop.py's seeded loop) with its run registry where a
real Jupyter server (jupyter_server's pytest plugin, the nbtrain extension on) reads it; the
test POSTs the stop the sidebar's Stop button sends. The launcher ends every rank at one
optimizer step, the cell raises RunStoppedError naming it, and the kernel's objects hold it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import time

import pytest

if importlib.util.find_spec("pytest_jupyter") is None:  # pragma: no cover - the browser extra is missing
    if os.environ.get("NBTRAIN_SKIP_BROWSER_TESTS") != "1":
        raise ImportError("pytest-jupyter is missing: run `bash .ci/browser-setup` (pip install -e '.[browser]')")
    pytest.skip("NBTRAIN_SKIP_BROWSER_TESTS=1 and pytest-jupyter is missing", allow_module_level=True)

from kernel_helpers import NotebookKernel
from nbtrain.system import registry
from test_graceful_stop import LOOP, SETUP

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"nbtrain.serverext": True}}}


@pytest.fixture
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.DIRECTORY_VARIABLE, str(tmp_path / "registry"))
    return tmp_path / "registry"


_KERNEL_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="graceful-stop-kernel")


async def _in_kernel_thread(fn, *args, **kwargs):
    """Run a kernel call on one thread of its own: its client runs event loops, which this test's loop would block."""
    return await asyncio.wrap_future(_KERNEL_THREAD.submit(fn, *args, **kwargs))


async def _running_record(deadline: float) -> registry.RunRecord:
    while time.monotonic() < deadline:
        running = [r for r in registry.read_all() if r.state == "running" and r.step]
        if running:
            return running[0]
        await asyncio.sleep(0.1)  # polling the registry: what the sidebar does
    raise AssertionError("no running run with a step appeared in the registry")


async def test_the_sidebars_stop_brings_back_the_state_at_the_step_every_rank_reached(jp_fetch, registry_dir):
    # The kernel's client runs event loops of its own: it is driven from a thread.
    kernel = await _in_kernel_thread(NotebookKernel, env={registry.DIRECTORY_VARIABLE: str(registry_dir)})
    try:
        await _in_kernel_thread(kernel.run_ok, SETUP)
        msg_id = await _in_kernel_thread(kernel.start_cell, LOOP.format(flags=""))
        record = await _running_record(time.monotonic() + 120)
        assert record.stop_at_step
        response = await jp_fetch("nbtrain", "api", "runs", record.id, "stop", method="POST", body=b"")
        outcome = json.loads(response.body)
        assert outcome["signalled"] == [] and "stop every rank at the last optimizer step" in outcome["message"]
        reply, out = await _in_kernel_thread(kernel.wait_for_reply, msg_id, 120)
        assert reply["ename"] == "RunStoppedError", out.text
        step = await _in_kernel_thread(kernel.value, "nbtrain.last_run().stopped_at")
        assert f"the run was stopped at step {step} on every rank; model, opt and sched hold step {step}" in out.text
        found = await _in_kernel_thread(kernel.value, f"compare({step})")
        assert found["weights"] < 1e-6 and found["momentum"] < 1e-6, found
        assert found["last_epoch"] == found["ref_last_epoch"] == step, found
    finally:
        await _in_kernel_thread(kernel.shutdown)
