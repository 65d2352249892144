"""The kernel's logging set-up on its ranks (nbtrain.messages.logsetup): in a real kernel, and between fresh
interpreters."""

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
logging.getLogger("library").warning("a library's own line")
"""

# A library that sets up its own handler when imported, in the kernel and in a rank alike.
LIBRARY = """
import logging, sys
logging.getLogger("library").addHandler(logging.StreamHandler(sys.stderr))
"""


# The loggers a run sends the levels of, in the kernel.
SENT = (
    "[name for name, *_ in __import__('nbtrain.messages.logsetup').messages.logsetup.capture("
    "__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).get_client().libraries_logging).levels]"
)


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, env=env)


def test_a_fresh_process_logs_as_the_one_it_was_captured_in(tmp_path):
    logfile, setup_file = str(tmp_path / "kernel.log"), str(tmp_path / "setup.pickle")
    kernel = _python(LIBRARY + CONFIGURE + "import pickle\nfrom nbtrain.messages import logsetup\n"
                     "with open(sys.argv[2], 'wb') as f: pickle.dump(logsetup.capture(), f)\n" + LOG_LINES,
                     logfile, setup_file)
    with open(setup_file, "rb") as f:
        setup = pickle.load(f)
    assert ("quiet", 40, True) in setup.levels and ("loud", 20, False) in setup.levels
    assert len(setup.handlers) == 3  # the file handler stays where it was
    kernel_file = os.path.getsize(logfile)
    rank = _python(LIBRARY + "import pickle, sys\nfrom nbtrain.messages import logsetup\n"
                   "with open(sys.argv[1], 'rb') as f: logsetup.follow(pickle.load(f))\n" + LOG_LINES, setup_file)
    assert (rank.stdout, rank.stderr) == (kernel.stdout, kernel.stderr)
    assert "INFO|train|an info line\n" in rank.stderr and rank.stdout == "loud says on stdout only\n"
    assert rank.stderr.count("a library's own line") == 2  # its handler, and the root's: not a third
    assert os.path.getsize(logfile) == kernel_file > 0


def test_a_library_imported_after_the_setup_was_followed_prints_each_line_once(tmp_path):
    """A rank follows the kernel's logging (from its launcher) before it imports the notebook's libraries: a
    library that gives its logger a handler of its own on import, as it did in the kernel, prints each line once."""
    setup_file = str(tmp_path / "setup.pickle")
    kernel = _python(LIBRARY + "import pickle, sys\nfrom nbtrain.messages import logsetup\n"
                     "with open(sys.argv[1], 'wb') as f: pickle.dump(logsetup.capture(), f)\n" + LOG_LINES, setup_file)
    rank = _python("import pickle, sys\nfrom nbtrain.messages import logsetup\n"
                   "with open(sys.argv[1], 'rb') as f: logsetup.follow(pickle.load(f))\n" + LIBRARY + LOG_LINES,
                   setup_file)
    assert kernel.stderr.count("a library's own line") == rank.stderr.count("a library's own line") == 1, rank.stderr


def test_an_empty_setup_leaves_a_process_as_python_starts_it():
    applied = _python("from nbtrain.messages import logsetup\nlogsetup.follow(logsetup.LoggingSetup())\n" + LOG_LINES)
    assert applied.stderr == "not shown\na library's own line\n" and applied.stdout == ""  # WARNING up, plainly


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
        sent = kernel.value(SENT)  # what the launcher's libraries (torch) set up, its ranks have: not sent
        assert "quiet" in sent and not any(name.startswith("torch") for name in sent), sent
        same = kernel.run_ok(cell)  # standby ranks, set up for the last run while they waited
        assert same.stderr.count("INFO|train|an info line\n") == 2, same.stderr
        kernel.run_ok("logging.getLogger().handlers[0].setFormatter(logging.Formatter('new: %(message)s'))")
        changed = kernel.run_ok(cell)  # standby ranks set up as the kernel was: they take that back first
        assert changed.stderr.count("new: an info line\n") == 2 and "INFO|" not in changed.stderr, changed.stderr
        kernel.run_ok("logging.getLogger().setLevel(logging.WARNING)")
        again = kernel.run_ok(cell)
        assert "an info line" not in again.text and "[rank 1] loud says on stdout only\n" in again.stdout
