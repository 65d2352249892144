"""The server extension warms the template again as the server starts a kernel (a real server, in process).

The template the server started at its own start leaves idle (``$NBTRAIN_TEMPLATE_IDLE_SECONDS``
small); a kernel then started through the REST API (``POST /api/kernels``), as JupyterLab starts
one, must find a template listening again, without the kernel asking for it (it never imports
nbtrain here). Every template and kernel this test starts is killed by its pid at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

if importlib.util.find_spec("pytest_jupyter") is None:  # pragma: no cover - the browser extra is missing
    if os.environ.get("NBTRAIN_SKIP_BROWSER_TESTS") != "1":
        raise ImportError("pytest-jupyter is missing: run `bash .ci/browser-setup` (pip install -e '.[browser]')")
    pytest.skip("NBTRAIN_SKIP_BROWSER_TESTS=1 and pytest-jupyter is missing", allow_module_level=True)

from helpers import procs
from nbtrain import serverext
from nbtrain.messages import templatesocket as naming

pytest_plugins = ["pytest_jupyter.jupyter_server"]

IDLE_SECONDS = "1"  # the server's first template leaves soon, as one does after 10 min in real use
START_SECONDS = 60.0  # a template's torch import on a loaded 2-core machine, and its idle time
GONE_SECONDS = 10.0


@pytest.fixture
def template_dir(tmp_path, monkeypatch):
    """The warm template switched on, in a directory of this test's; every template seen there killed after."""
    folder = tmp_path / "template"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "1")
    monkeypatch.setenv(naming.DIRECTORY_VARIABLE, str(folder))
    monkeypatch.setenv(naming.IDLE_VARIABLE, IDLE_SECONDS)
    seen: set[int] = set()
    yield str(folder), seen
    found = seen | set(procs.template_pids(str(folder)))
    procs.kill_pids(found)
    assert procs.wait_gone(found, GONE_SECONDS, reaped=False) == []


@pytest.fixture
def jp_server_config(template_dir):  # the template's environment first: the server starts one as it starts
    return {"ServerApp": {"jpserver_extensions": {"nbtrain.serverext": True}}}


async def _until(condition: Callable[[], Any], what: str) -> Any:
    """Poll ``condition`` on the server's own loop (its listeners run there) until true, or fail at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_SECONDS
    while not (value := condition()):
        assert loop.time() < deadline, f"{what} (waited {START_SECONDS:g} s)"
        await asyncio.sleep(0.05)
    return value


def _sockets(folder: str) -> list[str]:
    return [os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".sock")]


def _listening(folder: str) -> bool:
    for path in _sockets(folder):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.closing(probe), contextlib.suppress(OSError):
            probe.connect(path)
            return True
    return False


def _gone(pid: int) -> bool:
    return not procs.alive(pid) or procs.is_zombie(pid)  # detached: its exit is reaped by init, not us


async def test_a_kernel_started_after_the_template_left_idle_finds_it_warming(template_dir, jp_serverapp, jp_fetch):
    folder, seen = template_dir
    first = await _until(lambda: procs.template_pids(folder), "the server started no template as it started")
    seen.update(first)
    await _until(lambda: not _sockets(folder) and all(_gone(pid) for pid in first), "the first template never left")
    reply = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel_id = json.loads(reply.body)["id"]
    kernel_pid = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.pid
    try:
        await _until(lambda: _listening(folder), "no template listens after a kernel started")
        again = procs.template_pids(folder)
        seen.update(again)
        assert again and not set(again) & set(first)
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
        procs.kill_pids([kernel_pid])
        assert procs.wait_gone([kernel_pid], GONE_SECONDS) == []


def _server(argv: list[str]) -> Any:
    """A stand-in server with one kernel, ``k``, whose command line is ``argv`` (as jupyter_client formats it)."""
    kernel = SimpleNamespace(format_kernel_cmd=lambda: list(argv))
    return SimpleNamespace(kernel_manager=SimpleNamespace(get_kernel=lambda kernel_id: {"k": kernel}[kernel_id]))


def test_only_kernels_of_the_servers_own_interpreter_are_warmed_for():
    assert serverext._runs_servers_python(_server([sys.executable, "-m", "ipykernel_launcher"]), "k")
    assert not serverext._runs_servers_python(_server(["/opt/other/bin/python", "-m", "ipykernel_launcher"]), "k")
    assert not serverext._runs_servers_python(_server(["R", "--slave"]), "k")
    assert not serverext._runs_servers_python(_server([sys.executable]), "gone")  # shut down meanwhile
