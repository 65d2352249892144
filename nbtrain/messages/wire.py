"""Framed messages (with optional file descriptors) over a private Unix socket.

Every channel nbtrain uses is one end of a ``socketpair`` created by the process at the
other end, so only our own processes can write to it: that is why unpickling what arrives
is safe. No channel is ever a TCP port.

A frame is an 8-byte length, then a pickled record. File descriptors (shared-memory files)
ride as SCM_RIGHTS ancillary data on the frame's first bytes, so a sender may exit as soon
as its frame is written: the kernel keeps in-flight descriptors alive.

Example:
    >>> import socket
    >>> a, b = socket.socketpair()
    >>> send(a, {"hello": 1})
    >>> receive(b)
    ({'hello': 1}, [])
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import struct
from collections.abc import Sequence
from typing import Any

_HEADER = struct.Struct("!Q")
_MAX_FDS = 8


class ChannelClosed(EOFError):
    """The other end closed the channel (it exited or was killed)."""


def send(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    """Send one record, and ``fds`` with it. Blocks until the whole frame is written."""
    send_frame(sock, frame(message), fds)


def frame(message: Any) -> memoryview:
    """One record's frame (its length, then its pickle): made once for a record sent on several channels.

    The pickle is written after room for its length, which is filled in after: a large
    record (a payload shipping a big array) is not copied once more to put the two together.
    """
    buffer = io.BytesIO()
    buffer.write(bytes(_HEADER.size))
    pickle.dump(message, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    data = buffer.getbuffer()
    _HEADER.pack_into(data, 0, len(data) - _HEADER.size)
    return data


def send_frame(sock: socket.socket, data: bytes | memoryview, fds: Sequence[int] = ()) -> None:
    """Send a :func:`frame`, and ``fds`` with it, in one write where it fits: the reader wakes once."""
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """Receive one record and the descriptors sent with it. Raises ChannelClosed on EOF."""
    header, fds = _receive_header(sock)
    (length,) = _HEADER.unpack(header)
    body = _receive_exactly(sock, length)
    return pickle.loads(body), fds


def _receive_header(sock: socket.socket) -> tuple[bytes, list[int]]:
    header = b""
    fds: list[int] = []
    while len(header) < _HEADER.size:
        data, new_fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size - len(header), _MAX_FDS)
        fds.extend(new_fds)
        if not data:
            for fd in fds:
                os.close(fd)
            raise ChannelClosed("channel closed")
        header += data
    return header, fds


def _receive_exactly(sock: socket.socket, length: int) -> bytes:
    buffer = bytearray(length)
    view = memoryview(buffer)
    received = 0
    while received < length:
        n = sock.recv_into(view[received:], min(length - received, 1 << 22))
        if n == 0:
            raise ChannelClosed("channel closed in the middle of a message")
        received += n
    return bytes(buffer)
