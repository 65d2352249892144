"""nbtrain's Jupyter server extension: the REST API behind the JupyterLab sidebar.

Enabled by ``etc/jupyter/jupyter_server_config.d/nbtrain.json``, which the wheel installs.
It adds routes to the server's own web application (no port or socket of its own), every
one behind Jupyter's authentication (token or cookie, and XSRF for POST):

- ``GET  {base_url}nbtrain/api/runs``: every run in this user's run registry
  (:mod:`nbtrain.system.registry`), each with ``id``, ``state``, ``world_size``, ``kernel_id``,
  ``pids``, ``notebook`` (its file), ``path`` (the same, as the contents API names it: what
  the sidebar opens), ``step``, ``loss``, ``losses``, ``steps_per_second``, ``elapsed``;
- ``GET  {base_url}nbtrain/api/devices``: each GPU (NVML), the host's CPU and memory, each rank's memory;
- ``POST {base_url}nbtrain/api/runs/<id>/stop``: stop a run by signalling its ranks directly;
- ``POST {base_url}nbtrain/api/runs/<id>/clean``: forget an ended or orphaned run, killing what is left of it.

It also starts the user's warm template (``nbtrain.messages.templatesocket``) as the server starts, so a
kernel's launcher is forked from a process that has imported torch already, and again each time the
server starts or restarts a kernel of its own Python (jupyter_server's kernel action events), so a
notebook opened after the template left idle (``$NBTRAIN_TEMPLATE_IDLE_SECONDS``) finds it warming.

The sidebar (``labextension/src/``) loads in JupyterLab 4 and Notebook 7 (its right area, under
View > Right Sidebar; ``IStatusBar`` and ``ILabShell`` optional). It polls ``runs`` and ``devices``
every 2 s while visible, the status bar polls ``runs`` every 5 s while the tab is visible, and its
insert command asks the kernel for ``nbtrain.get_defaults().magic_line()`` in a silent request's
``user_expressions`` (3 s bound). Its pure pieces (``model.ts``) have unit tests under Node's test
runner. ``hatch_build.py`` builds it (npm against package-lock.json, ``jupyter labextension
build``) only when ``nbtrain/labextension/`` is missing; the wheel installs it into
``share/jupyter/labextensions/nbtrain/``.

Example (from a shell, with the server's token)::

    curl -H "Authorization: token $TOKEN" http://127.0.0.1:8888/nbtrain/api/runs
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from nbtrain.kernel import warm


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "nbtrain.serverext"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    # deferred: start-up time (jupyter_server)
    from nbtrain.serverext import handlers

    handlers.setup(serverapp.web_app)
    serverapp.log.info("nbtrain: run and device API at %snbtrain/api/", serverapp.web_app.settings["base_url"])
    _start_template()
    _warm_on_kernel_start(serverapp)


KERNEL_ACTIONS = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"  # emitted by ServerKernelManager
WARMING_ACTIONS = ("start", "restart")  # each makes a fresh kernel process, whose first run wants a launcher


def _warm_on_kernel_start(serverapp: Any) -> None:
    """Ensure the template each time the server starts (or restarts) a kernel of its own interpreter.

    Through jupyter_server's event system (a listener on its ``event_logger``), not by replacing
    anything of jupyter_server's (nbtrain.patches). The listener runs on the server's loop, so
    the template is started from a thread: ensure_template blocks while it starts one.
    """
    logger = getattr(serverapp, "event_logger", None)
    if logger is None or not hasattr(logger, "add_listener"):  # too old a jupyter_server or jupyter_events
        serverapp.log.info("nbtrain: no kernel events here; the template is started only as the server starts")
        return

    async def on_kernel_action(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        if data.get("status") != "success" or data.get("action") not in WARMING_ACTIONS:
            return
        if _runs_servers_python(serverapp, data.get("kernel_id")):
            _start_template()

    logger.add_listener(schema_id=KERNEL_ACTIONS, listener=on_kernel_action)


def _runs_servers_python(serverapp: Any, kernel_id: Any) -> bool:
    """Whether kernel ``kernel_id`` runs the server's own interpreter (``sys.executable``).

    ensure_template can start only the template of the server's identity (its ``sys.prefix`` and
    ``sys.executable`` among it: nbtrain.messages.templatesocket), and a kernel uses only a template
    of its own identity; a kernel of another environment (or language) starts its own template
    at its first run, so starting the server's for it would import torch for nobody.
    """
    try:
        command = serverapp.kernel_manager.get_kernel(kernel_id).format_kernel_cmd()
    except Exception:  # noqa: BLE001 - gone meanwhile, or not started from a local command (a gateway's)
        return False
    # format_kernel_cmd puts sys.executable for a bare "python" (the native kernel), as the launch did.
    return bool(command) and command[0] == sys.executable


def _start_template() -> None:
    """Start the warm template now (in the background), so the first kernel's first run finds
    torch imported; kernels of the server's Python environment use it (nbtrain.messages.templatesocket)."""

    threading.Thread(target=warm.ensure_template, name="nbtrain-template", daemon=True).start()
