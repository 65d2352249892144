"""The warm template: ``python -m nbtrain.launch_server.template <socket>``, started by a kernel.

One per user, machine and environment (``nbtrain.messages.templatesocket`` names it). It imports what a
launcher imports, then only forks: each kernel that asks gets a private launcher, forked
in milliseconds and sharing the template's memory copy-on-write. The template never runs
user code and never forks a rank. Its launchers do not die with it: each watches its own
kernel (its socket, and a pidfd on the kernel), so killing the template changes nothing
for a running run. It leaves once no launcher of its own has lived for
``$NBTRAIN_TEMPLATE_IDLE_SECONDS`` (10 minutes), and its orphaned descendants (a killed
launcher's leftovers, which it adopts as a subreaper) are killed at once.

How a kernel gets its launcher: it takes a lock file beside the socket, connects (starting the
template if nothing listens: the starter forks it and exits, so the template is nobody's child),
and sends a ``Request`` (its identity, environment and cwd) with the launcher's end of a fresh
socketpair and the write end of a stderr pipe. The template forks; the child takes the kernel's
environment, cwd and stderr, closes everything of the template's, and serves exactly as a
launcher the kernel started (``server.Launcher``, given a pidfd on the kernel instead of a parent
to watch). Its ranks name the kernel their tracer (``PR_SET_PTRACER``): the kernel is no longer
their ancestor, and Yama's rule would otherwise forbid reading rank 0's result.

- Identity: taken as the template starts, before its imports, as the kernel that started it
  took it for the name (taken after them, a source file saved meanwhile made it refuse that
  kernel). The reply is read once, under a lock (``processes.ForkedLauncher``), so two threads
  asking at once never leave one without the launcher's pid.
- Which nbtrain: the starter runs in the socket's directory, not the kernel's working directory
  (which ``python -m`` would put first on ``sys.path``: a checkout there would be the copy the
  template imports), with the folder holding the kernel's nbtrain first on ``PYTHONPATH`` when
  it is not a site directory (``processes.importing_this_nbtrain``).
- Memory and warm-up: before it forks, the template runs one tiny training step (forward,
  backward, an SGD and an AdamW step; one thread, random state put back), so torch's lazy
  first-use work is done once for every rank of its launchers, then freezes its heap
  (``gc.freeze()``), so a collection in a launcher never copies the pages they share.
- Notes beside the socket (``template-<key>.who``: its identity, pid, start time, ready or not;
  ``.ended``: it left, idle): from them a kernel's first cell that must wait says why in one
  line (``nbtrain.kernel.warm.cold_note``). No collections while it imports (``gc.disable``).
- The test suite runs with ``NBTRAIN_TEMPLATE=0`` except ``tests/test_template.py``, whose
  tests each use a directory of their own. When the kernel falls back to its own launcher,
  and why, is :mod:`nbtrain.kernel.warm`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import selectors
import socket
import sys
import time
from dataclasses import asdict, dataclass

from nbtrain.launch_server import forking, server
from nbtrain.messages import events, logsetup, wire
from nbtrain.messages import templatesocket as naming
from nbtrain.system import privatenet, processes

HANDSHAKE_SECONDS = 5.0  # a connected kernel that says nothing for this long is dropped


class Template:
    """The template's loop: accept kernels on ``listener``, fork their launchers, reap them, retire when idle."""

    def __init__(self, listener: socket.socket, path: str, loaded: tuple[str, ...], identity: naming.Identity):
        self.listener = listener
        self.path = path
        self.loaded = loaded
        self.identity = identity  # as its kernel saw it when it started us: the socket's name says so
        self.idle = naming.idle_seconds()
        self.launchers: dict[int, int] = {}  # pidfd -> launcher pid
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.last_used = time.monotonic()
        self.inode = os.stat(path).st_ino

    def serve(self) -> None:
        """Serve until no launcher of ours has lived for the idle time (then the socket's name is removed)."""
        while True:
            for key, _ in self.selector.select(1.0):
                if key.data is None:
                    self._accept()
                else:
                    self._reap(key.fd)
            processes.kill_strays(set(self.launchers.values()))
            if self.launchers:
                self.last_used = time.monotonic()
            elif time.monotonic() - self.last_used >= self.idle and self._retire():
                return

    def _accept(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except OSError:
            return
        with connection:
            connection.settimeout(HANDSHAKE_SECONDS)
            with contextlib.suppress(OSError, wire.ChannelClosed, EOFError):
                self._answer(connection)
        self.last_used = time.monotonic()

    def _answer(self, connection: socket.socket) -> None:
        if naming.peer_uid(connection) != os.getuid():
            return  # another user's process: not a word, not a byte unpickled
        request, fds = wire.receive(connection)
        try:
            refused = naming.refusal(connection, self.identity, request)
            if refused or len(fds) != 2:
                wire.send(connection, naming.Reply(None, refused or "expected two descriptors"))
                return
            if _kernel_left(fds[0]):
                return  # it stopped waiting for us (its end closed): a launcher would serve nobody
            kernel_pid = naming.peer_credentials(connection)[0]
            pid = self._fork(request, kernel_pid, fds[0], fds[1])
            wire.send(connection, naming.Reply(pid))
        finally:
            for fd in fds:
                os.close(fd)

    def _fork(self, request: naming.Request, kernel_pid: int, control_fd: int, stderr_fd: int) -> int | None:
        try:
            kernel_pidfd = os.pidfd_open(kernel_pid)
        except OSError:
            return None  # the kernel is gone already
        try:
            child = _Child(request, kernel_pid, kernel_pidfd, control_fd, stderr_fd, self.loaded)
            pid = processes.fork_launcher(child.main)
        finally:
            os.close(kernel_pidfd)
        pidfd = os.pidfd_open(pid)
        self.launchers[pidfd] = pid
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        return pid

    def _reap(self, pidfd: int) -> None:
        self.selector.unregister(pidfd)
        os.close(pidfd)
        processes.reap_now(self.launchers.pop(pidfd))

    def _retire(self) -> bool:
        """Leave, unless a kernel is connecting right now (its kernel holds the start lock)."""
        with open(naming.lock_path(self.path), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
            if self.selector.select(0):
                return False  # a request waits: serve it first
            if _unlink_own(self.path, self.inode):
                # The next kernel's first cell then says why it waits (nbtrain.kernel.warm.cold_note).
                _note(self.path, "ended", {"idle": self.idle, "at": time.time()}, gone="who")
            return True


def _kernel_left(control_fd: int) -> bool:
    """Whether the kernel closed its end of the launcher's socketpair (it says nothing before LauncherReady)."""
    with socket.socket(fileno=os.dup(control_fd)) as control:
        try:
            return control.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # open, and silent: it waits
        except OSError:
            return True


def _unlink_own(path: str, inode: int) -> bool:
    """Remove our socket's name, not that of a template which replaced us meanwhile; whether it was ours."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)
            return True
    return False


def _note(path: str, kind: str, fields: dict[str, object], gone: str) -> None:
    """Leave the note of ``kind`` beside the socket (``nbtrain.kernel.warm`` reads it), and remove that of ``gone``."""
    naming.write_note(path, kind, fields)
    with contextlib.suppress(OSError):
        os.unlink(f"{path[: -len('.sock')]}.{gone}")


@dataclass(frozen=True)
class _Child:
    """What a private launcher starts from: its kernel's request and the descriptors sent."""

    request: naming.Request
    kernel_pid: int
    kernel_pidfd: int
    control_fd: int
    stderr_fd: int
    loaded: tuple[str, ...]

    def main(self) -> None:
        """The private launcher, just forked: the kernel's environment, cwd and stderr; then serve."""
        # The template's private namespaces (made once) are its launchers' too: none waits for its own.
        keep = {0, 1, 2, self.control_fd, self.stderr_fd, self.kernel_pidfd}
        forking.close_all_but(keep | privatenet.inherited_fds())
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(self.stderr_fd, 2)
        for fd in (null, self.stderr_fd):
            os.close(fd)
        os.environ.clear()
        os.environ.update(self.request.environ)
        os.environ[processes.ROLE_VARIABLE] = "launcher"
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        with contextlib.suppress(OSError):
            os.chdir(self.request.cwd)
        processes.become_subreaper()
        processes.allow_result_reader(self.kernel_pid)
        control = socket.socket(fileno=self.control_fd)
        wire.send(control, events.LauncherReady(os.getpid(), self.loaded, logsetup.capture()))
        server.Launcher(control, self.kernel_pid, self.kernel_pidfd).serve()
        processes.exit_now(0)


def warm_up_torch() -> None:
    """Pay once, here, what every rank's first training step pays on first use; its ranks inherit it.

    A first forward, backward and optimizer step in a process initialises torch's lazy
    parts (operator dispatch, CPU kernels' selection, the allocator, autograd, the
    optimizers' first-step paths): 20-40 ms of each rank's first step on a 2-core machine.
    One thread (no pool is started: the template must stay thread-free to fork), and the
    random state is put back, so a rank starts from torch's usual state. Never raises.

        >>> warm_up_torch()
    """
    # deferred: start-up time (torch)
    import torch

    threads = torch.get_num_threads()
    # Whatever fails here only costs speed: the ranks pay it as before.
    with contextlib.suppress(Exception):
        torch.set_num_threads(1)
        with torch.random.fork_rng(devices=[]):
            model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
            for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())):
                loss = torch.nn.functional.cross_entropy(model(torch.randn(3, 8)), torch.tensor([0, 1, 1]))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    torch.set_num_threads(threads)


def _listen(path: str) -> socket.socket | None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
    except OSError:
        listener.close()
        return None  # another template took the name first
    os.chmod(path, 0o600)
    listener.listen(64)
    return listener


def main() -> None:
    """``python -m nbtrain.launch_server.template <socket>``: detach, import, freeze, serve."""
    path = sys.argv[1]
    # Taken before the imports below, as the kernel that starts us took it for the socket's name:
    # taken after them (seconds), a file saved meanwhile made us refuse that very kernel.
    identity = naming.identity()
    processes.detach()
    os.chdir("/")  # hold no kernel's directory for the template's lifetime
    processes.ignore_interrupts()
    processes.become_subreaper()
    listener = _listen(path)
    if listener is None:
        processes.exit_now(0)
    # Who we are, and not ready yet: a kernel connecting meanwhile says its first run waits for us.
    who = {**asdict(identity), "key": identity.key(), "pid": os.getpid(), "started": time.time()}
    _note(path, "who", {**who, "ready": False}, gone="ended")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # numpy's pool would make forking unsafe
    # No collections while torch imports: they were a fifth of the template's start (0.4-0.5 of
    # 2.2 s of CPU on a 2-core machine), which the first kernel's first cell waits for, and
    # freed next to nothing: everything made now lives as long as the template.
    gc.disable()
    loaded = server.preload()
    warm_up_torch()
    # Objects that exist now are never collected: a collection in a launcher would touch
    # (and so copy) every page the template shares with it. No collection first: on torch's
    # heap it costs the first kernel's first run time, and frees next to nothing.
    gc.freeze()
    gc.enable()  # launchers and their ranks collect as usual
    processes.return_free_memory()
    if processes.thread_count() != 1:
        _unlink_own(path, os.stat(path).st_ino)
        processes.exit_now(1)  # forking would be unsafe; kernels then start their own launchers
    privatenet.namespaces()  # once, for every launcher forked from here (nbtrain.system.privatenet)
    _note(path, "who", {**who, "ready": True}, gone="ended")
    Template(listener, path, loaded, identity).serve()
    processes.exit_now(0)


if __name__ == "__main__":
    main()
