"""The tornado handlers of nbtrain's REST API (routes listed in :mod:`nbtrain.serverext`).

Each derives from jupyter_server's APIHandler and is ``@tornado.web.authenticated``: a
request without the server's token (or login cookie plus XSRF token, for POST) gets 403.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import tornado.ioloop
import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from nbtrain.serverext import runs, usage
from nbtrain.system import registry

_RUN_ID = r"(?P<run_id>[A-Za-z0-9_-]{1,64})"


class RunsHandler(APIHandler):
    """``GET nbtrain/api/runs``: every run of this user's run registry, as the sidebar shows it."""

    @tornado.web.authenticated
    def get(self) -> None:
        """Answer the list of runs (:func:`nbtrain.serverext.runs.list_runs`) as JSON."""
        self.finish(json.dumps(runs.list_runs(self.settings.get("server_root_dir"))))


class RunActionHandler(APIHandler):
    """``POST nbtrain/api/runs/<id>/stop`` and ``.../clean``: stop a run, or forget an ended one."""

    @tornado.web.authenticated
    def post(self, run_id: str, action: str) -> None:
        """Stop or clean run ``run_id``; 404 for an unknown run, 409 where nothing could be signalled."""
        try:
            if action == "stop":
                outcome = runs.stop(run_id, signal.SIGTERM)
                if outcome.signalled or outcome.refused:
                    # What SIGTERM leaves after the grace period gets SIGKILL, as the launcher does
                    # (and would do itself; a launcher that died with its kernel cannot).
                    tornado.ioloop.IOLoop.current().call_later(runs.STOP_GRACE_SECONDS, runs.kill_rest, run_id)
                else:  # left to the launcher (a stop at a step): signalled only if it does not answer
                    _follow_stop(run_id, runs.ANSWER_SECONDS)
            else:
                outcome = runs.clean(run_id)
        except runs.RunNotFound as error:
            raise tornado.web.HTTPError(404, str(error)) from None
        except ValueError as error:
            raise tornado.web.HTTPError(409, str(error)) from None
        except registry.RegistryError as error:
            raise tornado.web.HTTPError(500, str(error)) from None
        if outcome.refused and not outcome.signalled:
            self.set_status(409)
        self.finish(json.dumps(outcome.as_json()))


def _follow_stop(run_id: str, delay: float) -> None:
    def look() -> None:
        later = runs.follow_up(run_id)
        if later is None:
            tornado.ioloop.IOLoop.current().call_later(runs.STOP_GRACE_SECONDS, runs.kill_rest, run_id)
        else:
            _follow_stop(run_id, later)

    tornado.ioloop.IOLoop.current().call_later(delay, look)


class DevicesHandler(APIHandler):
    """``GET nbtrain/api/devices``: each GPU (NVML), the host's CPU and memory, each rank's memory."""

    def initialize(self, host: usage.HostSampler) -> None:
        """Keep the server's one host sampler (its CPU share is measured between requests)."""
        self.host = host

    @tornado.web.authenticated
    def get(self) -> None:
        """Answer the devices (:func:`nbtrain.serverext.usage.snapshot`) as JSON."""
        self.finish(json.dumps(usage.snapshot(self.host)))


def setup(web_app: Any) -> None:
    """Add nbtrain's API routes under ``{base_url}nbtrain/api/`` to the server's web application."""
    base = url_path_join(web_app.settings["base_url"], "nbtrain", "api")
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "runs"), RunsHandler),
            (url_path_join(base, "runs", _RUN_ID, r"(?P<action>stop|clean)"), RunActionHandler),
            (url_path_join(base, "devices"), DevicesHandler, {"host": usage.HostSampler()}),
        ],
    )
