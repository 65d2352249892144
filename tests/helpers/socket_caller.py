"""Run as __main__ by tests/test_isolation.py, inside a private network and mount namespace.

A real 2-rank gloo run in which every rank, once the process group is connected (an
all_reduce went through), lists its own TCP sockets. Prints one JSON line: for each
rank, its pid and each socket's status and local address; then the launcher's.
"""

import json
import socket

import psutil
import torch
import torch.distributed as dist

import nbtrain
from nbtrain.kernel.launcher_connection import get_client


def sockets() -> dict:
    total = torch.ones(1)
    dist.all_reduce(total)  # every pair of ranks is connected by now
    mine = {
        "pid": psutil.Process().pid,
        "sum": total.item(),
        "sockets": [(c.status, c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")],
    }
    everyone = [None] * nbtrain.world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def main() -> None:
    ranks = nbtrain.launch(sockets, devices=2, accelerator="cpu", timeout=120)
    launcher = psutil.Process(get_client().process.pid)
    print(json.dumps({
        "hostname": socket.gethostname(),
        "resolves_to": socket.gethostbyname(socket.gethostname()),
        "ranks": ranks,
        "launcher_pid": launcher.pid,
        "launcher": [(c.status, c.laddr.ip, c.laddr.port) for c in launcher.net_connections("inet")],
    }), flush=True)


if __name__ == "__main__":
    main()
