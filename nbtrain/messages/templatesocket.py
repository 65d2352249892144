"""The warm template's socket: where it lives, who may use it, what is said on it.

Shared by the kernel (``nbtrain.kernel.warm``) and the template process
(``nbtrain.launch_server.template``).

One template per user, machine and Python environment imports torch once; every kernel's
private launcher is forked from it (copy-on-write), so a fresh kernel's first run finds
torch imported and idle kernels share one copy of it. Its identity (nbtrain's version and
code, torch's version, ``sys.prefix``, the interpreter, the user) is part of the socket's
name and checked again in the handshake, so a kernel never attaches to a template of
another environment or an older nbtrain. The socket lives in a directory private to the
user (0700, owned by them), and the template serves only its own user (SO_PEERCRED).

No torch here, no processes: the kernel's side connects, the template process serves.

    >>> me = identity()
    >>> me == identity(), me == identity(tag="other")  # a kernel uses a template of its own identity only
    (True, False)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from nbtrain.system import sharedhost

ENABLED_VARIABLE = "NBTRAIN_TEMPLATE"  # "0" (or "off"): every kernel starts its own launcher
DIRECTORY_VARIABLE = "NBTRAIN_TEMPLATE_DIR"  # where the template's socket lives
IDLE_VARIABLE = "NBTRAIN_TEMPLATE_IDLE_SECONDS"  # how long it stays once no kernel uses it
TAG_VARIABLE = "NBTRAIN_TEMPLATE_TAG"  # part of the identity: tests stand in another version with it
IDLE_SECONDS = 600.0


@dataclass(frozen=True)
class Identity:
    """What must be equal for a kernel to use a template's launchers.

        >>> identity().key() == identity().key()
        True
    """

    nbtrain: str
    code: int  # newest modification time of nbtrain's sources (an editable install changes)
    torch: str
    prefix: str
    executable: str
    python: str
    uid: int
    tag: str

    def key(self) -> str:
        """A short name for this identity: part of the socket's name.

            >>> len(identity().key())
            16
        """
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Request:
    """Kernel -> template, with the launcher's end of its socketpair and a stderr pipe.

        >>> Request(identity(), {"HOME": "/home/me"}, "/home/me").cwd
        '/home/me'
    """

    identity: Identity
    environ: dict[str, str]
    cwd: str


@dataclass(frozen=True)
class Reply:
    """Template -> kernel: the private launcher's pid, or why there is none.

        >>> Reply(None, "the template was started for another environment").launcher_pid is None
        True
    """

    launcher_pid: int | None
    refused: str = ""


def identity(environ: Mapping[str, str] | None = None, tag: str | None = None) -> Identity:
    """This process's identity (``tag`` from ``$NBTRAIN_TEMPLATE_TAG`` unless given).

        >>> identity(tag="x").tag
        'x'
    """
    environ = os.environ if environ is None else environ
    tag = environ.get(TAG_VARIABLE, "") if tag is None else tag
    return Identity(nbtrain=_version("nbtrain"), code=_code_stamp(), torch=_version("torch"), prefix=sys.prefix,
                    executable=sys.executable, python=sys.version, uid=os.getuid(), tag=tag)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether kernels use the template (``$NBTRAIN_TEMPLATE``; "0", "off", "no", "false": not).

        >>> enabled({"NBTRAIN_TEMPLATE": "off"}), enabled({})
        (False, True)
    """
    environ = os.environ if environ is None else environ
    return environ.get(ENABLED_VARIABLE, "1").strip().lower() not in ("0", "off", "no", "false")


def idle_seconds(environ: Mapping[str, str] | None = None) -> float:
    """How long the template stays once no launcher of its own lives (``$NBTRAIN_TEMPLATE_IDLE_SECONDS``).

        >>> idle_seconds({"NBTRAIN_TEMPLATE_IDLE_SECONDS": "5"}), idle_seconds({"NBTRAIN_TEMPLATE_IDLE_SECONDS": "x"})
        (5.0, 600.0)
    """
    environ = os.environ if environ is None else environ
    try:
        return max(0.0, float(environ.get(IDLE_VARIABLE, IDLE_SECONDS)))
    except ValueError:
        return IDLE_SECONDS


def socket_directory(environ: Mapping[str, str] | None = None) -> str | None:
    """The user's private directory for the socket (made 0700 if missing), or None if unsafe.

    ``$NBTRAIN_TEMPLATE_DIR``, else ``nbtrain-<uid>`` in ``$XDG_RUNTIME_DIR`` (or the
    temporary directory); None where it is not a directory of this user's that only they
    may enter, or cannot be written.

        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> socket_directory({"NBTRAIN_TEMPLATE_DIR": folder}) == folder
        True
        >>> os.chmod(folder, 0o755)  # others may enter: unsafe
        >>> socket_directory({"NBTRAIN_TEMPLATE_DIR": folder}) is None
        True
        >>> os.rmdir(folder)
    """
    path = sharedhost.private_directory(candidate_directory(environ))
    return path if path is not None and os.access(path, os.W_OK) else None


def candidate_directory(environ: Mapping[str, str] | None = None) -> str:
    """Where the socket's directory is looked for (:func:`socket_directory` checks it is safe).

        >>> candidate_directory({"NBTRAIN_TEMPLATE_DIR": "/run/user/1000/mine"})
        '/run/user/1000/mine'
    """
    environ = os.environ if environ is None else environ
    path = environ.get(DIRECTORY_VARIABLE)
    if not path:
        runtime = environ.get("XDG_RUNTIME_DIR")
        base = runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()
        path = os.path.join(base, f"nbtrain-{os.getuid()}")
    return path


def socket_path(folder: str, of: Identity) -> str:
    """The socket of the template for identity ``of`` in ``folder``.

        >>> socket_path("/run/user/1000/nbtrain-1000", identity()).endswith(".sock")
        True
    """
    return os.path.join(folder, f"template-{of.key()}.sock")


def lock_path(socket_file: str) -> str:
    """Held while a template is started or connected to, and while one retires.

        >>> lock_path("/tmp/nbtrain-0/template-0123456789abcdef.sock")
        '/tmp/nbtrain-0/template-0123456789abcdef.lock'
    """
    return socket_file[: -len(".sock")] + ".lock"


def peer_uid(connection: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED).

        >>> import os, socket
        >>> one, other = socket.socketpair()
        >>> peer_uid(one) == os.getuid()
        True
        >>> one.close(); other.close()
    """
    return peer_credentials(connection)[1]


def peer_credentials(connection: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the other end of a Unix socket, as the kernel recorded them.

        >>> import os, socket
        >>> one, other = socket.socketpair()
        >>> peer_credentials(one)[0] == os.getpid()
        True
        >>> one.close(); other.close()
    """
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def refusal(connection: socket.socket, mine: Identity, asked: object) -> str:
    """Why a template must not serve this request ("" when it may).

        >>> import socket
        >>> one, other = socket.socketpair()
        >>> refusal(one, identity(), "hello")
        'not an nbtrain template request'
        >>> one.close(); other.close()
    """
    uid = peer_uid(connection)
    if uid != os.getuid():
        return f"the nbtrain template of uid {os.getuid()} serves only its own user, not uid {uid}"
    if not isinstance(asked, Request):
        return "not an nbtrain template request"
    if asked.identity != mine:  # a kernel may use this template's launchers only if every field is equal
        return f"the template was started for {mine}, the kernel is {asked.identity}"
    return ""


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _code_stamp() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nbtrain/
    newest = 0
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in ("labextension", "__pycache__")]
        for name in files:
            if name.endswith(".py"):
                with contextlib.suppress(OSError):
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime_ns)
    return newest


def write_note(path: str, kind: str, fields: dict[str, object]) -> None:
    """The template's note of ``kind`` beside its socket ``path``: "who" (its identity, ready or not) or "ended"."""
    note = f"{path[: -len('.sock')]}.{kind}"
    with contextlib.suppress(OSError):
        with open(f"{note}.tmp", "w") as file:
            json.dump(fields, file)
        os.replace(f"{note}.tmp", note)  # whole or absent: a kernel may read it meanwhile


def read_note(path: str, kind: str) -> dict[str, Any]:
    """The note of ``kind`` beside the socket ``path`` ({} where there is none or it cannot be read)."""
    with contextlib.suppress(OSError, ValueError), open(f"{path[: -len('.sock')]}.{kind}") as file:
        found = json.load(file)
        return found if isinstance(found, dict) else {}
    return {}
