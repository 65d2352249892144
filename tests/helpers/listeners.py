"""Every listening socket of a set of processes, read from the kernel's own tables in /proc.

For each process: the inodes of its socket descriptors (``/proc/<pid>/fd``), matched against
the listening rows of ``/proc/<pid>/net/tcp``, ``tcp6`` and ``unix`` (each read in that
process's own network namespace). Nothing nbtrain keeps is consulted: a test finds what
an attacker could aim at, whether nbtrain knows of it or not.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from dataclasses import dataclass

_TCP_LISTEN = "0A"
_UNIX_ACCEPTING = 0x10000  # __SO_ACCEPTCON: a listening Unix socket


@dataclass(frozen=True)
class Listener:
    """One listening socket: its process, kind (tcp, tcp6, unix) and address (host, port) or path."""

    pid: int
    kind: str
    address: str
    port: int = 0

    def label(self) -> str:
        if self.kind == "unix":
            return f"unix {self.address!r} (pid {self.pid})"
        return f"{self.kind} {self.address}:{self.port} (pid {self.pid})"


def socket_inodes(pid: int) -> set[str]:
    """The inodes of ``pid``'s socket descriptors (empty if it is gone)."""
    found = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:[") : -1])
    return found


def _hex_address(kind: str, text: str) -> tuple[str, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if kind == "tcp":
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def _read(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return []


def _net_directories(pid: int) -> list[str]:
    """The process's own net directory and each of its threads' (a thread may be in another namespace)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    return [f"/proc/{pid}/net", *(f"/proc/{pid}/task/{tid}/net" for tid in tasks)]


def listeners_of(pid: int) -> list[Listener]:
    """The listening TCP (v4, v6) and Unix sockets ``pid`` holds, in whichever network namespace."""
    inodes = socket_inodes(pid)
    found: dict[str, Listener] = {}
    for net in _net_directories(pid):
        for kind in ("tcp", "tcp6"):
            for row in _read(f"{net}/{kind}"):
                if row[3] == _TCP_LISTEN and row[9] in inodes:
                    host, port = _hex_address(kind, row[1])
                    found[row[9]] = Listener(pid, kind, host, port)
        for row in _read(f"{net}/unix"):
            if len(row) >= 7 and int(row[3], 16) & _UNIX_ACCEPTING and row[6] in inodes:
                found[row[6]] = Listener(pid, "unix", row[7] if len(row) > 7 else "")
    return list(found.values())


# Run as the attacker with the system's python (standard library only: the attacker need not
# read this checkout). One JSON list of targets in, one JSON list of (label, outcome) out.
ATTACK = r"""
import json, socket, sys
results = []
for kind, address, port in json.loads(sys.argv[1]):
    family = {"tcp": socket.AF_INET, "tcp6": socket.AF_INET6, "unix": socket.AF_UNIX}[kind]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5)
    target = (address, port) if kind != "unix" else ("\0" + address[1:] if address.startswith("@") else address)
    if kind == "tcp6" and address == "::":
        target = ("::1", port)
    if kind == "tcp" and address == "0.0.0.0":
        target = ("127.0.0.1", port)
    try:
        sock.connect(target)
        outcome = "reached"
    except OSError as error:
        outcome = type(error).__name__
    finally:
        sock.close()
    results.append([kind, address, port, outcome])
print(json.dumps(results))
"""


def attempts(prefix: list[str], targets: list[Listener]) -> list[tuple[Listener, str]]:
    """Try to connect to each of ``targets`` as the user ``prefix`` runs as; (target, outcome) each."""
    wanted = [[t.kind, t.address, t.port] for t in targets]
    done = subprocess.run(
        [*prefix, "/usr/bin/python3", "-c", ATTACK, json.dumps(wanted)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    outcomes = json.loads(done.stdout)
    return [(target, outcome[3]) for target, outcome in zip(targets, outcomes, strict=True)]
