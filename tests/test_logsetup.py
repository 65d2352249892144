"""The kernel's logging set-up on its ranks (nbtrain.logsetup): in a real kernel, and between fresh interpreters."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from kernel_helpers import NotebookKernel

pytestmark = pytest.mark.timeout(240)

CONFIGURE = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="{levelname}|{name}|{message}", style="{")
logging.getLogger("quiet").setLevel(logging.ERROR)
to_stdout = logging.StreamHandler(sys.stdout)
to_stdout.setFormatter(logging.Formatter("%(name)s says %(message)s"))
logging.getLogger("loud").addHandler(to_stdout)
logging.getLogger("loud").propagate = False
logging.getLogger("loud").setLevel(logging.INFO)
logging.getLogger().addHandler(logging.FileHandler(sys.argv[1]))
"""

LOG_LINES = """
import logging
logging.getLogger("train").info("an info line")
logging.getLogger("quiet").warning("not shown")
logging.getLogger("loud").info("on stdout only")
"""


def _python(code: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, check=False, input=stdin, capture_output=True, timeout=60, env=env)


def test_a_fresh_process_logs_as_the_one_it_was_captured_in(tmp_path):
    logfile = str(tmp_path / "kernel.log")
    captured = _python(CONFIGURE + "import pickle\nfrom nbtrain import logsetup\n"
                       "sys.stdout.buffer.write(pickle.dumps(logsetup.capture()))\n", logfile)
    setup = pickle.loads(captured.stdout)
    assert ("quiet", 40, True) in setup.levels and ("loud", 20, False) in setup.levels
    assert len(setup.handlers) == 2  # the file handler stays where it was
    applied = _python("import pickle, sys\nfrom nbtrain import logsetup\n"
                      "logsetup.set_up(pickle.loads(sys.stdin.buffer.read()))\n" + LOG_LINES, stdin=captured.stdout)
    assert applied.stderr.decode() == "INFO|train|an info line\n"
    assert applied.stdout.decode() == "loud says on stdout only\n"
    assert os.path.getsize(logfile) == 0


def test_an_empty_setup_leaves_a_process_as_python_starts_it():
    applied = _python("from nbtrain import logsetup\nlogsetup.set_up(logsetup.LoggingSetup())\n" + LOG_LINES)
    assert applied.stderr.decode() == "not shown\n" and applied.stdout == b""  # logging's last resort: WARNING up


def test_a_cells_log_lines_show_on_each_rank_as_the_kernel_configured_them_and_follow_its_changes(tmp_path):
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport sys\nsys.argv[1:] = [" + repr(str(tmp_path / "kernel.log")) + "]\n"
                      + CONFIGURE)
        cell = "%%distributed --devices 2 --accelerator cpu\n" + LOG_LINES
        out = kernel.run_ok(cell)
        for rank in (0, 1):
            assert f"[rank {rank}] INFO|train|an info line\n" in out.stderr, out.stderr
            assert f"[rank {rank}] loud says on stdout only\n" in out.stdout, out.stdout
        assert "not shown" not in out.text and os.path.getsize(tmp_path / "kernel.log") == 0
        kernel.run_ok("logging.getLogger().setLevel(logging.WARNING)")
        again = kernel.run_ok(cell)  # on standby ranks forked before the change
        assert "an info line" not in again.text and "[rank 1] loud says on stdout only\n" in again.stdout
