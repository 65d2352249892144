"""A first cell that waits for the warm template says why, in one line in the cell and in the log.

The reasons come from the notes templates leave beside their socket (``nbtrain.kernel.warm``);
the kernel-level test uses real kernels and templates in a directory of its own, every
template it started killed by PID at the end (as ``tests/test_template.py``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator

import pytest

from helpers import procs
from kernel_helpers import NotebookKernel
from nbtrain.kernel import warm
from nbtrain.messages import templatesocket as naming

FIRST_CELL = "%%distributed --devices 2 --accelerator cpu\nvalue = 1 + 1\n"
GONE_SECONDS = 30.0


def _who(me: naming.Identity, **changed: object) -> dict[str, object]:
    return {**dataclasses.asdict(me), "key": me.key(), "pid": os.getpid(), "started": 0.0, "ready": True, **changed}


@pytest.fixture
def folder() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="nbtrain-firstcell-test-")
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        found = procs.template_pids(path)
        procs.kill_pids(found)
        procs.wait_gone(found, GONE_SECONDS, reaped=False)
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("note", "said"),
    [
        (None, "the first since this machine started"),
        ("ended", "the last one left after 3 s without a kernel"),
        ("socket", "the last one ended without cleaning up (killed, or it crashed)"),
        ("rebuild", "a rebuild: the running one is of another build (code changed)"),
        ("other", "only another environment's template runs (/elsewhere/venv)"),
        ("dead", "the first since this machine started"),  # a killed template's note: its pid is gone
    ],
)
def test_why_no_template_runs_is_read_from_the_notes_beside_its_socket(folder, note, said):
    me = naming.identity()
    path = naming.socket_path(folder, me)
    other = os.path.join(folder, "template-0000000000000000.sock")
    if note == "ended":
        naming.write_note(path, "ended", {"idle": 3.0, "at": 0.0})
    elif note == "socket":
        open(path, "w").close()  # a killed template's name, left behind
    elif note == "rebuild":
        naming.write_note(other, "who", _who(me, key="0" * 16, code=me.code + 1))
    elif note == "other":
        naming.write_note(other, "who", _who(me, key="0" * 16, prefix="/elsewhere/venv"))
    elif note == "dead":
        naming.write_note(other, "who", _who(me, key="0" * 16, code=me.code + 1, pid=2**22 + 1))
    assert said in warm._why_none(path, me)


def test_a_template_that_listens_but_is_not_ready_is_said_to_be_still_starting(folder):
    me = naming.identity()
    path = naming.socket_path(folder, me)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:  # stands in for a template importing torch
        listener.bind(path)
        listener.listen(1)
        naming.write_note(path, "who", _who(me, ready=False, started=time.time() - 1.0))
        connection = warm._reach(path, me)
        assert connection is not None
        connection.close()
        line = warm.cold_note(own_launcher=False)
        assert line.startswith("nbtrain: the worker template for this environment is still starting (started 1.")
        naming.write_note(path, "who", _who(me, ready=True))
        connection = warm._reach(path, me)
        assert connection is not None
        connection.close()
        assert warm.cold_note(own_launcher=False) == ""  # ready: the first run is warm, and says nothing


def _template_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("nbtrain:") and "template" in line]


def test_a_first_cell_says_why_it_waits_for_the_template_and_a_warm_one_says_nothing(folder, tmp_path):
    env = {naming.ENABLED_VARIABLE: "1", naming.DIRECTORY_VARIABLE: folder, naming.IDLE_VARIABLE: "60"}
    log = str(tmp_path / "kernel.log")
    with NotebookKernel(env=env, log=log) as kernel:  # no template yet: this kernel starts it
        kernel.run_ok("%load_ext nbtrain")
        said = _template_lines(kernel.run_ok(FIRST_CELL).text)
        assert kernel.value("value") == 2
    assert len(said) == 1, said
    assert said[0].startswith("nbtrain: starting the worker template (none was running for this environment: ")
    assert said[0].endswith("this first run waits for it to import torch.")
    with open(log) as file:
        assert said[0] in file.read()
    with NotebookKernel(env=env) as kernel:  # the template is there, ready: a warm first cell
        kernel.run_ok("%load_ext nbtrain")
        assert _template_lines(kernel.run_ok(FIRST_CELL).text) == []
    found = procs.template_pids(folder)
    assert len(found) == 1
    os.kill(found[0], signal.SIGKILL)  # the template ended between two kernels
    assert procs.wait_gone(found, GONE_SECONDS, reaped=False) == []
    with NotebookKernel(env=env) as kernel:
        kernel.run_ok("%load_ext nbtrain")
        said = _template_lines(kernel.run_ok(FIRST_CELL).text)
    assert said and "the last one ended without cleaning up (killed, or it crashed)" in said[0], said
