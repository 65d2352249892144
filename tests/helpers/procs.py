"""What the tests share: bounded waits on runs and processes, and leak snapshots.

Every wait here has a deadline; nothing sleeps to let something happen. Polling loops
poll a condition and end at their deadline.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from nbtrain.kernel import launcher_connection
from nbtrain.messages import events
from nbtrain.system import processes

RUN_TIMEOUT = 60.0  # a run that takes longer than this is a hang, not a slow machine
POLL = 0.02
SHM = "/dev/shm"
_PR_SET_CHILD_SUBREAPER = 36


class RunHung(AssertionError):
    pass


def finish(run: Any, timeout: float = RUN_TIMEOUT, on_event: Callable[[Any], None] | None = None) -> Any:
    """``run.wait()`` with a deadline: rank 0's result, or the run's failure raised.

    On the deadline the run is stopped (every rank gone) and the test fails.
    """
    deadline = time.monotonic() + timeout
    for event in run.events(poll=0.1):
        if event is not None and on_event is not None:
            on_event(event)
        if time.monotonic() > deadline and run.state == "running":
            run.stop("the test gave up")
            raise RunHung(f"run {run.run_id} did not end within {timeout} s (pids {run.pids})")
    return run.result()


def collect(run: Any, timeout: float = RUN_TIMEOUT) -> tuple[Any, BaseException | None, list[Any]]:
    """Run to the end; (result or None, failure or None, every event in order)."""
    seen: list[Any] = []
    try:
        return finish(run, timeout, seen.append), None, seen
    except RunHung:
        raise
    except Exception as error:  # noqa: BLE001 - the caller asserts on it
        return None, error, seen


def shm_entries() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_targets() -> dict[int, str]:
    """What each open descriptor of this process points at (for failure messages)."""
    targets = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            targets[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return targets


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def current_launcher() -> psutil.Process | None:
    """The test process's warm launcher, if one is running (never starts one)."""
    client = launcher_connection._client
    if client is None or not client.alive:
        return None
    try:
        return psutil.Process(client.process.pid)
    except psutil.NoSuchProcess:
        return None


def launcher_children() -> list[psutil.Process]:
    launcher = current_launcher()
    if launcher is None:
        return []
    try:
        return launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(pid: int) -> bool:
    """Whether ``pid`` still exists: running, or exited but not yet reaped (a zombie)."""
    return os.path.exists(f"/proc/{pid}")


def wait_gone(pids: Iterable[int], timeout: float, *, reaped: bool = True) -> list[int]:
    """Wait until every pid has exited and been reaped; return those still present.

    Those that are (or became, through a subreaper) this process's children are reaped here.
    ``reaped=False``: an exited process awaiting its (foreign) parent counts as gone.
    """
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        for pid in pids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass  # not ours: its parent reaps it
        left = [p for p in pids if alive(p) and (reaped or not is_zombie(p))]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL)


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it is true (returned), failing with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} (waited {timeout} s)")
        time.sleep(POLL)
    return value


def is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def dying(pid: int) -> bool:
    """Whether ``pid`` has a SIGKILL pending or is already exiting (its files may be closed, it is not a zombie yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, IndexError, ValueError):
        return not alive(pid)
    return bool(flags & _PF_EXITING) or any(mask & _SIGKILL_BIT for mask in pending)


def kill_pids(pids: Iterable[int]) -> None:
    """Cleanup: SIGKILL each pid still present (by pid, never by name)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_and_wait(pids: Iterable[int], timeout: float, *, reaped: bool = True) -> list[int]:
    """Give ``pids`` ``timeout`` seconds to go by themselves, SIGKILL the rest; those still present."""
    left = wait_gone(pids, timeout, reaped=reaped)
    kill_pids(left)
    return wait_gone(left, timeout, reaped=reaped)


def roundtrip(obj: Any, transport: str = "file") -> Any:
    """``obj`` after the engine's trip between processes.

    ``file``: tensors through a shared-memory file (kernel -> ranks, and rank 0's fallback);
    ``read``: tensors left in place and read back with process_vm_readv (rank 0 -> kernel),
    here from this very process, which takes the same system call.
    """
    from nbtrain.messages import sharedtensors

    if transport == "read":
        pickled = sharedtensors.dumps_in_place(obj)
        mapping = sharedtensors.read_from_process(os.getpid(), pickled.regions, pickled.total_bytes)
        return sharedtensors.loads_mapped(pickled.data, mapping)
    data, fd = sharedtensors.dumps_to_shared_memory(obj)
    try:
        return sharedtensors.loads(data, fd)
    finally:
        if fd is not None:
            os.close(fd)


def set_child_subreaper(on: bool) -> None:
    """Orphans of our subtree become our children (so a test can reap them), or stop doing so."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The first stdout line of ``proc`` that is a JSON object, within ``timeout`` seconds.

    Reads the pipe's raw descriptor without blocking past the deadline; what was read
    after that line stays in ``proc.extra_stdout``.
    """
    fd = proc.stdout.fileno()
    buffer = getattr(proc, "extra_stdout", b"")
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.startswith(b"{"):
                    proc.extra_stdout = buffer
                    return json.loads(line)
                proc.skipped_stdout = getattr(proc, "skipped_stdout", b"") + line + b"\n"
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise AssertionError(
                    f"no JSON line from pid {proc.pid} within {timeout} s; stdout so far: "
                    f"{getattr(proc, 'skipped_stdout', b'') + buffer!r}"
                )
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(
                    f"pid {proc.pid} closed stdout (exit code {proc.poll()}) before a JSON line; "
                    f"stdout: {getattr(proc, 'skipped_stdout', b'') + buffer!r}"
                )
            buffer += chunk


def rest_of_output(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Wait (bounded) for ``proc`` to exit; its remaining stdout and its stderr as text."""
    out, err = proc.communicate(timeout=timeout)
    out = getattr(proc, "skipped_stdout", b"") + getattr(proc, "extra_stdout", b"") + (out or b"")
    return out.decode(errors="replace"), (err or b"").decode(errors="replace")


def cleanup_caller(proc: subprocess.Popen, others: Iterable[int | None]) -> None:
    """After a test's caller script: kill (by pid) whatever of it is still there, reap, close pipes.

    ``others`` are the pids the script reported (its launcher, its ranks); None is skipped.
    """
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    others = [pid for pid in others if pid]
    kill_pids([pid for pid in others if alive(pid)])
    wait_gone(others, 10)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def pss_bytes(pid: int) -> int:
    """Proportional set size of a live process, from /proc/PID/smaps_rollup."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no Pss line in /proc/{pid}/smaps_rollup")


@dataclass
class Snapshot:
    shm: set[str]
    fds: int
    threads: int
    launcher_children: int
    launcher_fds: int | None


def snapshot() -> Snapshot:
    launcher = current_launcher()
    launcher_fds = None
    if launcher is not None:
        try:
            launcher_fds = launcher.num_fds()
        except psutil.NoSuchProcess:
            pass
    return Snapshot(shm_entries(), fd_count(), thread_count(), len(launcher_children()), launcher_fds)


def rank_exits(seen: list[Any]) -> dict[int, events.RankExited]:
    return {e.rank: e for e in seen if isinstance(e, events.RankExited)}


def template_pids(folder: str) -> list[int]:
    """The warm templates serving a socket in ``folder`` (found by their command line)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if processes.TEMPLATE_MODULE in cmdline and any(arg.startswith(folder) for arg in cmdline):
            found.append(process.pid)
    return found


def python_output(code: str, cwd: Any = None, timeout: float = 120.0) -> str:
    """The stdout of ``code`` run by a fresh ``python -c`` (this venv's); its stderr fails the test if it fails."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
