"""The process group's sockets in a network of the user's own; the rank's own network unchanged.

gloo's listener (one per rank, open for the process group's life: for standby ranks up to
their idle limit and then the whole run) accepts anyone's connection on loopback, and
loopback is shared by every user of the machine. Here each launcher makes, once, a user
namespace of its user's own and a network namespace in it (only a loopback, brought up),
through a short-lived fresh interpreter (~130 ms, off a run's way): this user needs no
privilege for that where the OS allows unprivileged user namespaces. Each rank of a run it
covers joins the user namespace when it is forked (still one thread), and joins its process
group from a thread that enters the private network: every socket gloo makes there (its
listener, its pairs) lives in that namespace, where no other user's process is, while the
rank's main thread, and so the cell's code, stays in the host's network (the internet, the
host's 127.0.0.1 services, trackers). A socket keeps the namespace it was made in, so the
group's pairs keep working from any thread.

Covered: single-machine CPU runs on gloo forked by the launcher (``fork`` start method).
Not covered, and said so (nbtrain.system.sharedhost): NCCL (its communicators may be built later,
from the rank's main thread, and no GPU was at hand to prove a split namespace there),
``ddp_spawn`` (a fresh interpreter), cluster runs (nodes must reach each other), groups the
cell makes itself (``dist.new_group``: made from its own thread, in the host's network),
and any machine whose OS refuses unprivileged user namespaces. What it costs a covered rank:
inside its user namespace, files of users outside it (root's among them) show as owned by
``nobody``, which some tools mind, and set-uid programs do not raise privileges;
``NBTRAIN_PRIVATE_NETWORK=0`` in the caller's environment switches it off.

>>> import dataclasses
>>> from nbtrain.messages.events import RankSpec, StartRun
>>> gloo = StartRun(1, b"", (RankSpec(0, 0, 2, "cpu", None),), "fork", {}, "/", (), {}, None)
>>> uncovered(gloo, available=None) is None
True
>>> uncovered(gloo, available="the OS refuses")
'the OS refuses'
>>> uncovered(dataclasses.replace(gloo, environ={"NBTRAIN_PRIVATE_NETWORK": "0"}), available=None)
'NBTRAIN_PRIVATE_NETWORK=0 is set'
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

MAKER_SECONDS = 10.0  # a fresh interpreter answers in ~50 ms; past this it is taken for refused
SWITCH_VARIABLE = "NBTRAIN_PRIVATE_NETWORK"  # "0": the process group in the host's network, as before
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
T = TypeVar("T")


class StartFacts(Protocol):
    """What :func:`uncovered` reads of a run's start: a :class:`nbtrain.messages.events.StartRun`
    has it all (the messages are a layer above this one, so it is named here by what is read)."""

    @property
    def ranks(self) -> Sequence[Any]:
        """Each rank's spec: its ``device_type`` is read."""

    @property
    def start_method(self) -> str:
        """``"fork"`` or ``"spawn"``."""

    @property
    def rank_settings(self) -> Any:
        """What the ranks are told: its ``backend`` (the process group's) is read."""

    @property
    def environ(self) -> Mapping[str, str]:
        """The caller's environment."""

    @property
    def node(self) -> object:
        """None where every rank is on this machine."""


@dataclass(frozen=True)
class Namespaces:
    """Descriptors of the launcher's private user and network namespaces (ranks inherit them)."""

    user: int
    net: int


_made: Namespaces | None = None
_refused: str | None = None  # why none could be made, once tried
_joined: int | None = None  # in a rank: the network namespace its group joins from


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _call(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def make_namespaces() -> Namespaces:
    """The one boundary with the OS: a user namespace of this user's and a network namespace in it.

    A child unshares both, maps this user's uid and gid to themselves, brings its loopback up
    and waits; the caller opens the two namespaces (they live while a descriptor does) and
    lets it go. The child is a fresh interpreter, never a fork of the caller: the kernel asks
    too, and a fork of a process with threads (a kernel's) can hang on a lock another thread
    held. Raises OSError where the OS refuses (no unprivileged user namespaces, a container's
    seccomp, ``max_user_namespaces`` 0).
    """
    code = "import sys, nbtrain.system.privatenet as p; print(p._unshare_here(), flush=True); sys.stdin.read(1)"
    pipe = subprocess.PIPE
    child = subprocess.Popen([sys.executable, "-c", code], stdin=pipe, stdout=pipe, stderr=subprocess.DEVNULL)
    try:
        said = _said_by(child)
        if not said:  # it died before a word (a failed import, a crash): not the OS refusing
            raise OSError(errno.ECHILD, f"the namespace maker exited without answering (exit {_exit_of(child)})")
        if said != "y":
            raise OSError(errno.EPERM, said)
        user = os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        net = os.open(f"/proc/{child.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return Namespaces(user, net)
    finally:
        with contextlib.suppress(OSError):
            child.communicate(b"g", timeout=MAKER_SECONDS)
        if child.poll() is None:
            child.kill()
            child.wait()


def _exit_of(child: subprocess.Popen[bytes]) -> int | None:
    """The maker's exit status once its output ended (None if it lingers past :data:`MAKER_SECONDS`)."""
    try:
        return child.wait(MAKER_SECONDS)
    except subprocess.TimeoutExpired:
        return None


def _said_by(child: subprocess.Popen[bytes]) -> str:
    """The namespace maker's first line ("y", or why not; "" if it died first), within :data:`MAKER_SECONDS`."""
    assert child.stdout is not None
    if not select.select([child.stdout], [], [], MAKER_SECONDS)[0]:
        raise OSError(errno.ETIMEDOUT, f"the namespace maker did not answer within {MAKER_SECONDS:.0f} s")
    return child.stdout.readline().decode(errors="replace").strip()[:500]


def _unshare_here() -> str:
    """In the namespace maker: make them and map this user to itself; "y", or why not."""
    uid, gid = os.getuid(), os.getgid()
    try:
        _call(_libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        _loopback_up()
    except OSError as error:
        return str(error)
    return "y"


def _loopback_up() -> None:
    """Bring this network namespace's loopback up (a new one starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(probe, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def namespaces() -> Namespaces | None:
    """The launcher's namespaces, made on the first call; None where the OS refuses (see :func:`refused`)."""
    global _made, _refused
    if _made is None and _refused is None:
        try:
            _made = make_namespaces()
        except OSError as error:
            _refused = f"this machine refuses unprivileged user namespaces ({error.strerror or error})"
    return _made


def refused() -> str | None:
    """Why this process could make no namespaces (None: it could, or has not tried)."""
    return _refused


_probed: list[str | None] = []


def probe() -> str | None:
    """Whether this user may make the namespaces here (None) or why not; tried once, nothing kept.

    The kernel asks, to say what a run leaves reachable; the launcher, which makes them, knows.
    """
    if not _probed:
        try:
            made = make_namespaces()
        except OSError as error:
            if error.errno == errno.EPERM:
                _probed.append(f"this machine refuses unprivileged user namespaces ({error.strerror or error})")
            else:
                _probed.append(f"nbtrain could not make its private network here ({error.strerror or error})")
        else:
            os.close(made.user)
            os.close(made.net)
            _probed.append(None)
    return _probed[0]


def uncovered(start: StartFacts, available: str | None) -> str | None:
    """Why ``start``'s process group stays in the host's network, or None: it goes in the private one.

    ``available``: None where the namespaces can be made, else why not.
    """
    devices = {spec.device_type for spec in start.ranks}
    backend = start.rank_settings.backend
    return uncovered_by(backend, devices, start.start_method, start.node is not None, start.environ, available)


def uncovered_by(
    backend: str, device_types: set[str], start_method: str, on_cluster: bool, environ: Mapping[str, str],
    available: str | None,
) -> str | None:
    """:func:`uncovered` from a run's facts (the kernel knows these, not the launcher's StartRun)."""
    if environ.get(SWITCH_VARIABLE, "1") == "0":
        return f"{SWITCH_VARIABLE}=0 is set"
    if on_cluster:
        return "a cluster's nodes must reach each other"
    if start_method != "fork":
        return "ddp_spawn's ranks are fresh interpreters"
    if backend != "gloo" or device_types - {"cpu"}:
        return f"the {backend} backend is not covered (only CPU runs on gloo are)"
    if environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0"):
        return "TORCH_GLOO_LAZY_INIT connects gloo's pairs later, from the cell's own thread"
    return available


def inherited_fds() -> set[int]:
    """The descriptors a forked rank keeps open for its namespaces."""
    return set() if _made is None else {_made.user, _made.net}


def enter(start: StartFacts) -> None:
    """In a rank just forked (one thread): join the user namespace if its run is covered.

    Its process group is then joined in the private network (:func:`in_private_network`).
    """
    global _joined, _made
    made = _made
    if made is None:
        return
    _made = None  # the rank's copies are closed below or kept only as _joined
    if uncovered(start, None) is None:
        _call(_libc().setns(made.user, _CLONE_NEWUSER), "setns(user)")
        _joined = made.net
    else:
        os.close(made.net)
    os.close(made.user)


def in_private_network(join: Callable[[], T]) -> T:
    """``join()`` (the process group's set-up) from a thread in the private network, if this rank joined one."""
    if _joined is None:
        return join()
    results: list[Any] = []

    def inside() -> None:
        try:
            _call(_libc().setns(_joined, _CLONE_NEWNET), "setns(net)")
            results.append((True, join()))
        except BaseException as error:  # noqa: BLE001 - raised again in the rank's own thread
            results.append((False, error))

    thread = threading.Thread(target=inside, name="nbtrain-join-group")
    thread.start()
    thread.join()
    done, value = results[0]
    if not done:
        raise value
    return value  # type: ignore[no-any-return]
