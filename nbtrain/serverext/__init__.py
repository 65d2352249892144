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
kernel's launcher is forked from a process that has imported torch already.

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


def _start_template() -> None:
    """Start the warm template now (in the background), so the first kernel's first run finds
    torch imported; kernels of the server's Python environment use it (nbtrain.messages.templatesocket)."""

    threading.Thread(target=warm.ensure_template, name="nbtrain-template", daemon=True).start()
