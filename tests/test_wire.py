"""Framed records and file descriptors over a Unix socket pair (nbtrain.messages.wire)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import struct
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from nbtrain.messages import wire

SEND_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Record:
    run_id: int
    text: str


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def send_in_thread(sock: socket.socket, message: object) -> threading.Thread:
    """Send from another thread: a frame bigger than the socket's buffer blocks until read."""
    thread = threading.Thread(target=wire.send, args=(sock, message), daemon=True)
    thread.start()
    return thread


def test_records_arrive_whole_and_in_order(pair):
    a, b = pair
    records = [Record(1, "first"), {"nested": [1, 2.5, None]}, b"", Record(2, "é ∑")]
    for record in records:
        wire.send(a, record)
    assert [wire.receive(b) for _ in records] == [(record, []) for record in records]


def test_a_frame_is_an_8_byte_big_endian_length_then_the_pickle(pair):
    a, b = pair
    wire.send(a, Record(7, "x"))
    (length,) = struct.unpack("!Q", b.recv(8))
    body = b.recv(length, socket.MSG_WAITALL)
    assert len(body) == length and pickle.loads(body) == Record(7, "x")


def test_a_record_larger_than_the_socket_buffer_arrives_whole(pair):
    a, b = pair
    big = os.urandom(12 << 20)  # several of _receive_exactly's 4 MiB reads
    thread = send_in_thread(a, big)
    message, fds = wire.receive(b)
    thread.join(SEND_SECONDS)
    assert not thread.is_alive()
    assert message == big and fds == []


def test_descriptors_travel_with_the_record_and_outlive_the_senders_copy(pair):
    a, b = pair
    read_end, write_end = os.pipe()
    try:
        wire.send(a, "a pipe", fds=[write_end])
        os.close(write_end)  # the kernel keeps the in-flight descriptor alive
        message, fds = wire.receive(b)
        assert message == "a pipe" and len(fds) == 1
        os.write(fds[0], b"through the received descriptor")
        os.close(fds[0])
        assert os.read(read_end, 100) == b"through the received descriptor"
    finally:
        os.close(read_end)


def test_one_frame_goes_to_several_channels_each_with_its_descriptor():
    """The launcher pickles a run once and hands it to every standby rank."""
    data = wire.frame(Record(3, "the run"))
    pairs = [socket.socketpair() for _ in range(2)]
    read_end, write_end = os.pipe()
    try:
        for a, _ in pairs:
            wire.send_frame(a, data, fds=[write_end])
        for i, (_, b) in enumerate(pairs):
            message, fds = wire.receive(b)
            assert message == Record(3, "the run") and len(fds) == 1
            os.write(fds[0], bytes([i]))
            os.close(fds[0])
        assert os.read(read_end, 2) == b"\x00\x01"
    finally:
        os.close(read_end)
        os.close(write_end)
        for a, b in pairs:
            a.close()
            b.close()


def test_a_record_larger_than_the_socket_buffer_arrives_whole_with_its_descriptor(pair):
    a, b = pair
    big = os.urandom(12 << 20)  # the first write takes only part of the frame
    read_end, write_end = os.pipe()
    try:
        thread = threading.Thread(target=wire.send, args=(a, big, [write_end]), daemon=True)
        thread.start()
        message, fds = wire.receive(b)
        thread.join(SEND_SECONDS)
        assert not thread.is_alive()
        assert message == big and len(fds) == 1
        os.close(fds[0])
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_large_record_is_framed_without_a_second_copy():
    """A payload shipping a big array is pickled once; its length goes in front without copying it again."""
    big = os.urandom(64 << 20)
    tracemalloc.start()
    try:
        data = wire.frame(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data) > len(big) and peak < 1.5 * len(big)
    assert struct.unpack("!Q", data[:8])[0] == len(data) - 8 and pickle.loads(data[8:]) == big


def test_several_descriptors_keep_their_order(pair):
    a, b = pair
    pipes = [os.pipe() for _ in range(3)]
    try:
        wire.send(a, None, fds=[w for _, w in pipes])
        _, fds = wire.receive(b)
        for i, fd in enumerate(fds):
            os.write(fd, bytes([i]))
            os.close(fd)
        assert [os.read(r, 1) for r, _ in pipes] == [b"\x00", b"\x01", b"\x02"]
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_a_closed_channel_raises_channel_closed(pair):
    a, b = pair
    a.close()
    with pytest.raises(wire.ChannelClosed, match="channel closed"):
        wire.receive(b)
    assert issubclass(wire.ChannelClosed, EOFError)  # readers that stop on EOFError stop here too


def test_the_records_sent_before_the_close_are_still_read(pair):
    a, b = pair
    wire.send(a, 1)
    wire.send(a, 2)
    a.close()
    assert wire.receive(b) == (1, []) and wire.receive(b) == (2, [])
    with pytest.raises(wire.ChannelClosed):
        wire.receive(b)


def test_a_close_inside_the_header_raises_channel_closed(pair):
    a, b = pair
    a.sendall(b"\x00\x00\x00")
    a.close()
    with pytest.raises(wire.ChannelClosed, match="^channel closed$"):
        wire.receive(b)


def test_a_close_inside_the_body_says_so(pair):
    a, b = pair
    a.sendall(struct.pack("!Q", 100) + b"only ten b")
    a.close()
    with pytest.raises(wire.ChannelClosed, match="in the middle of a message"):
        wire.receive(b)


def test_descriptors_of_a_frame_cut_short_are_closed(pair):
    a, b = pair
    read_end, write_end = os.pipe()
    try:
        socket.send_fds(a, [b"\x00\x00"], [write_end])  # two header bytes, then the sender dies
        os.close(write_end)
        a.close()
        with pytest.raises(wire.ChannelClosed):
            wire.receive(b)
        # Had the received copy of write_end stayed open, this read would block instead of EOF.
        os.set_blocking(read_end, False)
        assert os.read(read_end, 1) == b""
    finally:
        os.close(read_end)
