"""The caller's side of a launch (nbtrain.kernel.client): what a run is sent with.

How a run then goes is tests/test_run_handle.py (its handle) and test_launch.py (a real launcher).
"""

from __future__ import annotations

import os
import sys

import pytest

from nbtrain.errors import SerializationError
from nbtrain.kernel import client
from nbtrain.planning import config
from nbtrain.planning.deviceplan import DevicePlan

RUN = 9
CONFIG = config.make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=30)


# --- what a run is sent with -----------------------------------------------------------------


def test_a_start_message_carries_the_callers_state_and_the_config(monkeypatch, tmp_path):
    monkeypatch.setenv(client.LOG_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv("NBTRAIN_ROLE", "should not travel")
    message = client._StartMessage(CONFIG, b"payload", has_tensor_file=False, with_log=True)
    start = message(RUN)
    assert (start.run_id, start.payload, start.timeout, start.strategy, start.rank_settings.backend) == (
        RUN,
        b"payload",
        30.0,
        "ddp_notebook",
        "gloo",
    )
    assert [(s.rank, s.world_size, s.device_type) for s in start.ranks] == [(0, 2, "cpu"), (1, 2, "cpu")]
    assert start.cwd == os.getcwd() and start.sys_path == tuple(sys.path)
    assert "NBTRAIN_ROLE" not in start.environ and start.environ["PATH"] == os.environ["PATH"]
    assert (
        start.log_path is not None and start.log_path.startswith(str(tmp_path)) and message.log_path == start.log_path
    )


def test_a_function_that_cannot_travel_says_what_to_do():
    stream = (i for i in range(3))
    with pytest.raises(
        SerializationError,
        match=r"the function or its arguments cannot be sent to the ranks: .* create them inside the function",
    ):
        client._serialise(lambda: next(stream), (), None)


def test_a_cells_lines_go_to_this_machines_launcher_once(monkeypatch):
    """A long session's cells are not pickled and sent again with every run (the launcher keeps them)."""
    import linecache

    cells = {f"/nonexistent/nbtrain-cell-{i}.py": (f"x = {i}\n",) for i in range(3)}
    for filename, lines in cells.items():
        monkeypatch.setitem(linecache.cache, filename, (len(lines[0]), None, list(lines), filename))
    first = client._notebook_source_lines()
    assert set(cells) <= set(first) and first["/nonexistent/nbtrain-cell-1.py"] == ("x = 1\n",)
    assert set(cells) & set(client._notebook_source_lines(known=set(first))) == set()
