"""The kernel's side of the warm template (nbtrain.kernel.warm): where it answers None.

The kernel then starts its own launcher, as before the template. Real templates and
kernels are in tests/test_template.py.
"""

from __future__ import annotations

import linecache
import os
import socket
import sys
import threading
import time

from nbtrain.kernel import warm
from nbtrain.messages import templatesocket as naming
from nbtrain.messages import wire
from nbtrain.system import processes


def test_where_no_template_can_be_used_the_kernel_starts_its_own_launcher(tmp_path, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "1")
    monkeypatch.setenv(naming.DIRECTORY_VARIABLE, str(folder / "runtime"))
    if os.getuid() == 0:  # root writes anywhere: a directory not private to the user stands in
        folder.chmod(0o755)
        monkeypatch.setenv(naming.DIRECTORY_VARIABLE, str(folder))
    assert warm.forked_launcher() is None
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "0")
    assert warm.forked_launcher() is None


def test_switched_off_nothing_is_started(tmp_path, monkeypatch):
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "off")
    monkeypatch.setenv(naming.DIRECTORY_VARIABLE, str(tmp_path / "runtime"))
    warm.ensure_template()
    assert not (tmp_path / "runtime").exists()  # not even its directory


def test_two_threads_asking_a_forked_launchers_pid_at_once_both_get_it():
    """The kernel's check of its launcher and a caller (a test, ``get_client().process.pid``) asked at
    once: both read the template's one reply, one of them got none (or a torn frame), and the
    kernel then gave up a good launcher for its own, its first run waiting seconds for it."""
    kernel_end, template_end = socket.socketpair()
    launcher = processes.ForkedLauncher(warm._Answer(kernel_end), stderr=None)  # type: ignore[arg-type]
    seen: list[int] = []
    threads = [threading.Thread(target=lambda: seen.append(launcher.pid), daemon=True) for _ in range(2)]
    for thread in threads:  # each waits (in the reply's read, or for the other to finish it) before the next
        thread.start()
        wait_asleep(thread)
    wire.send(template_end, naming.Reply(os.getpid()))
    for thread in threads:
        thread.join(10.0)
    assert seen == [os.getpid(), os.getpid()]
    assert launcher.why_none == ""
    template_end.close()


def wait_asleep(thread: threading.Thread) -> None:
    """Until the thread waits for the reply (blocked in its read, or on the lock of whoever reads it), at most 10 s."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident or -1)
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno) if frame is not None else ""
        waiting = frame is not None and (frame.f_code.co_name == "recv_fds" or "acquire" in line)
        with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
            if waiting and stat.read().rsplit(")", 1)[1].split()[0] == "S":
                return
        time.sleep(0.001)
    raise AssertionError(f"thread {thread.name} never waited for the reply")


def test_a_template_that_forks_nothing_says_why():
    kernel_end, template_end = socket.socketpair()
    refused = "the template was started for another environment"
    wire.send(template_end, naming.Reply(None, refused))
    launcher = processes.ForkedLauncher(warm._Answer(kernel_end), stderr=None)  # type: ignore[arg-type]
    assert launcher.answered_pid() is None and launcher.pid == -1
    assert launcher.why_none == f"the template forked no launcher: {refused}"
    kernel_end, template_end = socket.socketpair()
    template_end.close()  # gone without a word
    launcher = processes.ForkedLauncher(warm._Answer(kernel_end), stderr=None)  # type: ignore[arg-type]
    assert launcher.pid == -1 and "without an answer" in launcher.why_none


def test_each_reason_is_said_in_the_log_and_listed(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "0")
    before = len(warm.fallbacks())
    assert warm.forked_launcher() is None
    reason = "$NBTRAIN_TEMPLATE='0' switches it off (unset it to use the template)"
    assert warm.fallbacks()[before:] == [reason]
    assert f"nbtrain: the warm template is not used: {reason}." in capfd.readouterr().err
