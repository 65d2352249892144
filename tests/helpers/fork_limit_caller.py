"""Run as __main__ by tests/test_guardrails.py: a run whose second fork fails with EAGAIN.

It starts its launcher and limits it so that exactly one more process fits: with a lower
RLIMIT_NPROC (prlimit) for an unprivileged user or, as root (for whom Linux ignores
RLIMIT_NPROC), with the pids.max of a pids cgroup the test created (the directory is the
argument). Then a 3-rank run: rank 0 forks, rank 1 cannot. It prints one JSON line: the
run's failure, how long it took, the launcher's descriptors before and after, and
whether a normal run works once the limit is lifted.
"""

import json
import os
import resource
import sys
import time

import nbtrain
from nbtrain.kernel.launcher_connection import get_client


def tasks_of(uid: int) -> int:
    """Threads of every process of ``uid``: what RLIMIT_NPROC counts."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid:
            count += int(status["Threads"])
    return count


def fds(pid: int) -> dict[str, str]:
    """The launcher's pipes and sockets: what a failed rank could leave open.

    Files are left out: the launcher's samplers open /proc/<pid>/stat for a moment, and
    a snapshot taken during such a read is no leak.
    """
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if not target.startswith("/"):
            found[name] = target
    return found


def limit_to_one_more_process(launcher: int, cgroup: str | None):
    """Limit the launcher to one more process; return the function that lifts the limit."""
    if cgroup is None:
        original = resource.prlimit(launcher, resource.RLIMIT_NPROC)
        resource.prlimit(launcher, resource.RLIMIT_NPROC, (tasks_of(os.getuid()) + 1, original[1]))
        return lambda: resource.prlimit(launcher, resource.RLIMIT_NPROC, original)
    write(os.path.join(cgroup, "cgroup.procs"), launcher)
    write(os.path.join(cgroup, "pids.max"), 2)  # the launcher (one thread) and rank 0

    def lift() -> None:
        write(os.path.join(cgroup, "pids.max"), "max")
        write(os.path.join(os.path.dirname(cgroup), "cgroup.procs"), launcher)

    return lift


def write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def main() -> int:
    # Standby ranks, forked after a run, hold pipes of their own: none here, so that what is
    # compared is what the failed rank could leave open.
    nbtrain.set_defaults(standby_idle=None)
    client = get_client()
    assert client.ready.wait(180), client.exit_detail()
    launcher = client.process.pid
    # One run first: "ready" can come before the launcher has opened its own descriptors
    # (its event loop's epoll), which are no leak of the failed rank.
    assert nbtrain.launch(lambda: 1, devices=1, accelerator="cpu") == 1
    before = fds(launcher)
    lift = limit_to_one_more_process(launcher, sys.argv[1] if len(sys.argv) > 1 else None)
    started = time.monotonic()
    run = nbtrain.start(lambda: 1, devices=3, accelerator="cpu")
    try:
        run.wait()
        failure = None
    except nbtrain.RunFailedError as error:
        failure = [type(error).__name__, str(error)]
    seconds = time.monotonic() - started
    lift()
    after = fds(launcher)
    with open(f"/proc/{launcher}/task/{launcher}/children") as f:
        children = f.read().split()  # its ranks, reaped or not
    again = nbtrain.launch(lambda: nbtrain.world_size(), devices=2, accelerator="cpu")
    report = {
        "failure": failure,
        "seconds": seconds,
        "before": before,
        "after": after,
        "children": children,
        "again": again,
        "pids": list(run.pids.values()),
        "launcher": launcher,
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
