"""``python -m nbtrain.rank CHANNEL_FD LISTEN_FD TENSOR_FD STACK_FD``: a rank in a fresh interpreter.

Used by the ``ddp_spawn`` strategy. The launcher starts it with stdout/stderr on its pipes
and sends the RankAssignment as the first message on the channel.
"""

import socket
import sys

from nbtrain.messages import wire
from nbtrain.rank.machinery import runtime
from nbtrain.system import processes


def main() -> None:
    """A rank process the launcher started (spawned): its fds from argv, its assignment over the channel."""
    channel_fd, listen_fd, tensor_fd, stack_fd = (int(arg) for arg in sys.argv[1:5])
    channel = socket.socket(fileno=channel_fd)
    assignment, _ = wire.receive(channel)
    processes.die_with_parent(assignment.launcher_pid)
    runtime.run_rank(
        assignment,
        channel,
        None if listen_fd < 0 else listen_fd,
        None if tensor_fd < 0 else tensor_fd,
        None if stack_fd < 0 else stack_fd,
    )


main()
