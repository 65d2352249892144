"""A private launcher forked from the user's warm template (``nbtrain.messages.templatesocket``).

The kernel connects to the template's socket (starting the template if there is none),
sends it the launcher's end of a fresh socketpair and a stderr pipe (SCM_RIGHTS), and gets
back a launcher that has torch imported already. Wherever that cannot be (the template is
switched off, the runtime directory is not private or not writable, no Unix sockets),
:func:`forked_launcher` returns None and the kernel starts its own launcher as before.
Nothing here waits for the template's answer: a launcher it forks is not used until it said
it is ready (``LauncherClient`` waits at most :data:`READY_SECONDS`), and one that cannot be
used (refused, dead before it was ready, too late) is abandoned (:func:`abandon`) for the
kernel's own. Never in silence: each time, :func:`note_fallback` writes why in the kernel's
log (its own stderr, which Jupyter shows in the server's log, not in a cell), and
:func:`fallbacks` lists the reasons so far.

A first run that must wait for the template (none ran: this kernel starts it; it is still
starting) or for the kernel's own launcher says why in one line in its cell and in the log
(:func:`cold_note`): no template yet, the last one left idle or was killed, a rebuild for a
changed nbtrain, only another environment's template there. The template keeps a note
beside its socket for this (:func:`write_note`): who it is and whether it is ready, or why
it left.

    >>> note_fallback("an example: $NBTRAIN_TEMPLATE=0 switches it off (unset it to use it)", log=False)
    >>> fallbacks()[-1]
    'an example: $NBTRAIN_TEMPLATE=0 switches it off (unset it to use it)'
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from nbtrain.messages import templatesocket as naming
from nbtrain.messages import wire
from nbtrain.system import processes

CONNECT_SECONDS = 10.0  # a template just started binds its socket within this
# From the kernel's request to its launcher's LauncherReady. A template that is there answers
# in milliseconds; one still importing torch (just started) answers when done, which is what
# the kernel's own launcher would need too, so waiting for it costs nothing, and starting a
# second import beside it would slow both on a small machine. Past this (about twice the
# slowest first cell measured on a loaded 2-core machine) the template is taken for stuck.
READY_SECONDS = 30.0
GONE_SECONDS = 5.0  # an abandoned launcher, SIGKILLed, is gone within this


def forked_launcher() -> processes.LauncherProcess | None:
    """This kernel's private launcher, forked by the template; None where there is none.

    The template is started first if none runs. None (the caller then starts its own
    launcher) wherever a template cannot be used, and the kernel's log says why.

        >>> import os
        >>> saved = dict(os.environ)
        >>> os.environ["NBTRAIN_TEMPLATE"] = "0"
        >>> forked_launcher() is None
        True
        >>> os.environ.clear(); os.environ.update(saved)  # as it was, whatever it held
    """
    folder, why = _socket_folder()
    if folder is None:
        note_fallback(why)
        return None
    me = naming.identity()
    path = naming.socket_path(folder, me)
    try:
        # Held only to connect: once connected, our request is in the template's backlog,
        # which it looks at (under this lock) before it retires.
        with _locked(naming.lock_path(path)):
            connection = _reach(path, me)
        if connection is None:
            note_fallback(f"the template started for {path} did not listen there within {CONNECT_SECONDS:g} s")
            return None
        return _ask(connection, me)
    except Exception as error:  # noqa: BLE001 - anything here means: start our own launcher, as before
        note_fallback(f"reaching the template at {path} failed: {error!r}")
        return None


def _socket_folder() -> tuple[str | None, str]:
    """The template's folder, or None and why none can be used."""
    if not naming.enabled():
        value = os.environ.get(naming.ENABLED_VARIABLE, "")
        return None, f"${naming.ENABLED_VARIABLE}={value!r} switches it off (unset it to use the template)"
    folder = naming.socket_directory()
    if folder is None:
        return None, (
            f"{naming.candidate_directory()} is not a directory of uid {os.getuid()}'s own that only it may enter "
            f"and write (set ${naming.DIRECTORY_VARIABLE} to one, mode 0700)"
        )
    return folder, ""


def note_fallback(reason: str, log: bool = True) -> None:
    """Say, in the kernel's log, why this kernel's launcher is not the template's (``reason``, with what to do).

    The line goes to the kernel's own stderr: under Jupyter, the server's log, never a cell
    (nothing went wrong that the user must act on: the first run only waits longer).
    """
    _said.append(reason)
    if log:
        line = (
            f"nbtrain: the warm template is not used: {reason}. This kernel starts its own launcher, "
            "so its first run waits for that launcher to import torch (seconds).\n"
        )
        with contextlib.suppress(OSError, ValueError):
            os.write(_log_fd(), line.encode(errors="replace"))


def fallbacks() -> list[str]:
    """Why this kernel's launchers were not the template's, oldest first (empty: every one was)."""
    return list(_said)


_said: list[str] = []


def _log_fd() -> int:
    # ipykernel forwards fd 2 to the cell; its stderr's fileno() is the kernel's own stderr.
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return 2


def ensure_template() -> None:
    """Start the template now if none runs (the Jupyter server does, as it starts).

    Does nothing where kernels would not use a template; never raises.

        >>> import os
        >>> saved = dict(os.environ)
        >>> os.environ["NBTRAIN_TEMPLATE"] = "0"
        >>> ensure_template()
        >>> os.environ.clear(); os.environ.update(saved)  # as it was, whatever it held
    """
    folder, _ = _socket_folder()
    if folder is None:
        return
    me = naming.identity()
    path = naming.socket_path(folder, me)
    with contextlib.suppress(Exception), _locked(naming.lock_path(path)):
        connection = _reach(path, me)  # a new one listening: no kernel takes its name for a dead one's
        if connection is not None:
            connection.close()


def _reach(path: str, me: naming.Identity) -> socket.socket | None:
    """A connection to the template at ``path``, started first where none listens (the caller holds the lock).

    Why its launcher will not be warm at once is kept for :func:`cold_note` ("" where the template is ready).
    """
    global _cold
    connection = _connect(path)
    if connection is not None:
        note = naming.read_note(path, "who")  # started by another kernel or the Jupyter server, maybe not ready yet
        started = note.get("started") if note.get("ready") is False else None
        starting = "the worker template for this environment is still starting (started {:.1f} s ago)"
        _cold = starting.format(time.time() - started) if isinstance(started, (int, float)) else ""
        return connection
    _cold = f"starting the worker template (none was running for this environment: {_why_none(path, me)})"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead template's name (we hold the lock)
    processes.start_template(path)
    return _connect_when_listening(path)


def _why_none(path: str, me: naming.Identity) -> str:
    """Why no template of identity ``me`` listens at ``path``, from the notes templates left beside it."""
    if os.path.exists(path):
        return "the last one ended without cleaning up (killed, or it crashed)"
    ended = naming.read_note(path, "ended")
    if ended:
        return f"the last one left after {ended.get('idle', 0):g} s without a kernel"
    others = [note for note in _live_notes(os.path.dirname(path)) if note.get("key") != me.key()]
    mine = [note for note in others if (note.get("prefix"), note.get("executable")) == (me.prefix, me.executable)]
    if mine:
        fields = ("nbtrain", "code", "torch", "python", "tag")
        changed = [name for name in fields if mine[0].get(name) != getattr(me, name)]
        return f"a rebuild: the running one is of another build ({', '.join(changed) or 'identity'} changed)"
    if others:
        return f"only another environment's template runs ({others[0].get('prefix')})"
    return "the first since this machine started, or since its notes were removed"


def _live_notes(folder: str) -> list[dict[str, Any]]:
    """The "who" notes of templates still alive in ``folder`` (a killed one's note stays: its pid is gone)."""
    found = []
    for name in sorted(os.listdir(folder)):
        socket_file = os.path.join(folder, name[: -len(".who")] + ".sock")
        note = naming.read_note(socket_file, "who") if name.endswith(".who") else {}
        with contextlib.suppress(OSError, LookupError, TypeError, ValueError):  # not a note, or of a dead template
            os.kill(int(note["pid"]), 0)
            found.append(note)
    return found


def cold_note(own_launcher: bool) -> str:
    """The line a first run that must wait shows in its cell ("" where it need not: the template was ready).

    ``own_launcher``: the kernel started its own (the template could not be used; :func:`fallbacks` says why).
    """
    if own_launcher:
        if not naming.enabled() or not _said:
            return ""  # switched off on purpose: said in the log once, not in every first cell
        waits = "this first run waits for the kernel's own launcher to import torch"
        return f"nbtrain: the warm template is not used ({_said[-1]}); {waits}."
    return f"nbtrain: {_cold}; this first run waits for it to import torch." if _cold else ""


def say_cold(line: str) -> None:
    """Show ``line`` in the running cell and write it in the kernel's log."""
    # deferred: start-up time
    from nbtrain.kernel.display import owntext

    owntext.print_line(line)
    with contextlib.suppress(OSError, ValueError):
        os.write(_log_fd(), (line + "\n").encode(errors="replace"))


_cold = ""  # why the template's launcher was not ready when asked for ("" where it was): set by _reach


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _connect(path: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        return None
    return connection


def _connect_when_listening(path: str) -> socket.socket | None:
    deadline = time.monotonic() + CONNECT_SECONDS
    while time.monotonic() < deadline:
        connection = _connect(path)
        if connection is not None:
            return connection
        time.sleep(0.005)  # polling a socket name that appears in tens of milliseconds
    return None


def abandon(launcher: processes.LauncherProcess) -> None:
    """Give up a launcher the template forked (or was asked to fork) for us, before any run was sent.

    Its channel is closed (a template that has not forked it yet then does not, and one
    forked meanwhile ends at its first word); one the template said it forked is SIGKILLed
    by its pid and waited for (the template, its parent, reaps it).
    """
    with contextlib.suppress(OSError):
        launcher.channel.shutdown(socket.SHUT_RDWR)
    launcher.channel.close()
    handle = launcher.popen
    if isinstance(handle, processes.ForkedLauncher) and handle.answered_pid() is not None:
        handle.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            handle.wait(timeout=GONE_SECONDS)


def _ask(connection: socket.socket, me: naming.Identity) -> processes.LauncherProcess | None:
    """Send the request; the answer is read when the launcher is first needed."""
    kernel_end, launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    try:
        request = naming.Request(me, dict(os.environ), os.getcwd())
        wire.send(connection, request, (launcher_end.fileno(), write_end))
    except OSError as error:
        for end in (kernel_end, connection):
            end.close()
        os.close(read_end)
        note_fallback(f"the request to the template could not be sent: {error}")
        return None
    finally:
        launcher_end.close()
        os.close(write_end)
    stderr = os.fdopen(read_end, "rb")
    answer = _Answer(connection)
    return processes.LauncherProcess(processes.ForkedLauncher(answer, stderr), kernel_end)


class _Answer:
    """The template's reply: the launcher's pid, read once, within the time asked for; or why there is none."""

    def __init__(self, connection: socket.socket):
        self.connection = connection

    def __call__(self, timeout: float) -> tuple[bool, int | None, str]:
        self.connection.settimeout(timeout)
        try:
            reply, fds = wire.receive(self.connection)
        except (TimeoutError, BlockingIOError):  # BlockingIOError: a timeout of 0
            return False, None, ""  # asked again later (a partial frame cannot happen: it is tiny)
        except (OSError, wire.ChannelClosed):
            reply, fds = None, []
        self.connection.close()
        for fd in fds:
            os.close(fd)
        if not isinstance(reply, naming.Reply):
            return True, None, "the template closed the connection without an answer (it ended meanwhile)"
        if reply.launcher_pid is None:
            return True, None, f"the template forked no launcher: {reply.refused or 'the kernel was gone for it'}"
        return True, reply.launcher_pid, ""
