"""Every process nbtrain starts, signals or reaps, and every signal handler it touches.

The topology (docs/architecture.md draws it):

    kernel ──socketpair──> launcher (own session; imports torch once, stays warm)
                              ├── fork ──> rank 0 (own process group)
                              └── fork ──> rank 1 ...

    (or: template ──fork──> launcher, the template imported torch once for all the user's
    kernels; see nbtrain.messages.templatesocket)

Why each rule:
- The launcher is started from a fresh interpreter in its own session. Ranks fork from it,
  never from the kernel: the kernel may hold a CUDA context, OpenMP pools or threads, and
  a fork of that dies ("Cannot re-initialize CUDA in forked subprocess") or deadlocks.
  Its own session keeps Jupyter's "interrupt kernel" (SIGINT to the kernel's whole
  process group) away from it; the kernel relays interrupts as a StopRun request.
- The launcher has no threads when it forks (checked), so a child never inherits a lock
  some other thread held.
- Each rank leads its own process group, so a stop also reaches its DataLoader workers.
- Ranks get SIGKILL when the launcher dies (PR_SET_PDEATHSIG); the launcher exits when
  the kernel's end of its socket closes. So killing the kernel leaves no orphans.
- Stopping is SIGTERM to each rank's group, then SIGKILL after a grace period, tolerating
  processes that are already gone.
- A process that leaves its rank's group (``os.setsid()``, a double fork) is out of reach
  of a group signal. So the launcher and every rank are child subreapers: such a process,
  orphaned, becomes the rank's child while its rank lives, and the launcher's when the
  rank is gone. The launcher's only children are its ranks; any other is left over from
  a rank that ended, and is killed with everything below it (:func:`kill_strays`).
- Interrupts: until a cell launches, an interrupt raises where it lands (nothing started);
  from the launch on the cell holds interrupts (:func:`interrupts_held`: a SIGINT handler that
  only notes them) and acts on them where it is safe (between events, at most a quarter of a
  second later; after the result is in), so none lands half way through a frame sent to the
  launcher or between a run's start and the handle that stops it. The cell then ends with
  ``RunInterrupted`` (a KeyboardInterrupt, never an ``Exception`` that ``except Exception``
  swallows). An interrupted run keeps nothing of its result: a ``StopRun`` while rank 0's
  result waits gives it up, and one already copied is dropped from the run's handle at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import select
import signal
import site
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from subprocess import Popen
from typing import IO, Any, NoReturn, Protocol

LAUNCHER_MODULE = "nbtrain.launch_server"
CONTROL_FD_VARIABLE = "NBTRAIN_CONTROL_FD"
ROLE_VARIABLE = "NBTRAIN_ROLE"
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PTRACER = 0x59616D61
TEMPLATE_MODULE = "nbtrain.launch_server.template"
UNKNOWN_EXIT = -255  # a launcher forked by the template: not our child, its status unknown
# The signal that asks a rank for its stack dump (nbtrain.messages.stacktext reads the dump). A real-time
# signal: nothing a training script or a library commonly uses, queued rather than merged, and
# (unlike SIGUSR1/2) not what job schedulers send to ask for a checkpoint.
DUMP_SIGNAL = signal.SIGRTMIN + 6
# A launcher forked by the warm template is not a descendant of its kernel; its ranks let
# the kernel read their memory (Yama's ptrace rule) by naming it their tracer.
_result_reader: int | None = None


def inherited_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What of a process's environment its ranks get: not nbtrain's own wiring, nor Ray's hook.

    Ray sets ``PYTHONBREAKPOINT`` to its remote debugger in its workers and, once connected,
    in its driver (the kernel); outside a Ray worker that hook raises, so ``breakpoint()`` in
    a rank would fail instead of stopping as pdb does.

    >>> inherited_environment({"A": "1", ROLE_VARIABLE: "launcher", "PYTHONBREAKPOINT": "ray.util.rpdb.set_trace"})
    {'A': '1'}
    """
    return {
        key: value
        for key, value in environ.items()
        if key not in (CONTROL_FD_VARIABLE, ROLE_VARIABLE)
        and not (key == "PYTHONBREAKPOINT" and value.startswith("ray."))
    }


class LauncherHandle(Protocol):
    """What the kernel asks of its launcher's process: a Popen, or a :class:`ForkedLauncher`."""

    @property
    def pid(self) -> int:
        """The launcher's process id."""

    @property
    def stderr(self) -> IO[bytes] | None:
        """The launcher's standard error, where the kernel reads why it ended (None where not piped)."""

    def poll(self) -> int | None:
        """The exit status if the launcher has ended, else None (as ``Popen.poll``)."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait at most ``timeout`` seconds for the launcher to end; its exit status (as ``Popen.wait``)."""

    def kill(self) -> None:
        """Send the launcher SIGKILL (as ``Popen.kill``)."""


@dataclass
class LauncherProcess:
    """The kernel's handle on its launcher: the process and the kernel's end of the socket."""

    popen: LauncherHandle
    channel: socket.socket

    @property
    def pid(self) -> int:
        """The launcher's process id."""
        return self.popen.pid


def start_launcher() -> LauncherProcess:
    """Start the warm launcher from a clean interpreter, in a session of its own."""
    kernel_end, launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = launcher_end.fileno()
    try:
        env = {**os.environ, CONTROL_FD_VARIABLE: str(fd)}
        popen = _start_python([LAUNCHER_MODULE], "launcher", env, subprocess.PIPE, pass_fds=[fd])
    finally:
        launcher_end.close()
    return LauncherProcess(popen, kernel_end)


def _start_python(args: list[str], role: str, env: Mapping[str, str], stderr: int, **options: Any) -> Popen[bytes]:
    """A fresh interpreter running ``-m *args`` as ``role``, in a session of its own, with no stdin or stdout.

    numpy's OpenBLAS starts a thread pool at import; a launcher (and the template that forks
    launchers) must stay thread-free to fork safely. Ranks then run numpy's BLAS on one
    thread (they share the cores).
    """
    env = {**env, ROLE_VARIABLE: role, "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", *args], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=stderr, env=env, close_fds=True, **options)


def stop_launcher(launcher: LauncherProcess, grace: float = 2.0) -> None:
    """Close the channel (the launcher then stops its ranks and exits); kill it if it lingers."""
    with contextlib.suppress(OSError):  # already closed or never connected
        # shutdown first: close() alone does not end the socket while the kernel's reader
        # thread is blocked in recv on it, so the launcher would never see EOF and would
        # only go when killed after the grace period.
        launcher.channel.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        launcher.channel.close()
    try:
        launcher.popen.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        launcher.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILLed: it is going
            launcher.popen.wait(timeout=grace)
    if launcher.popen.stderr is not None:
        launcher.popen.stderr.close()


def thread_count() -> int:
    """OS-level threads of this process (C++ and OpenMP threads included)."""
    return len(os.listdir("/proc/self/task"))


def fork_rank(child_main: Callable[[], None]) -> int:
    """Fork a rank from the (thread-free) launcher. The child never returns from here."""
    parent = os.getpid()
    return _fork(lambda: _become_rank(parent), child_main)


def _fork(setup: Callable[[], None], child_main: Callable[[], None]) -> int:
    """Fork a child that runs ``setup``, then ``child_main``, and leaves by ``os._exit`` (0, or
    71 if it raised); returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            setup()
            child_main()
            code = 0
        # A forked child must reach os._exit whatever it raised: never unwind into the
        # parent's code. The runtime reports its own errors.
        except BaseException:  # noqa: BLE001  # pragma: no cover
            code = 71
        finally:
            os._exit(code)
    return pid


def spawn_rank(argv: Sequence[str], env: dict[str, str], inherit_fds: Sequence[int]) -> int:
    """Start a rank as a fresh interpreter (ddp_spawn), leading its own process group."""
    for fd in inherit_fds:
        os.set_inheritable(fd, True)
    try:
        return os.posix_spawn(argv[0], list(argv), env, setpgroup=0)
    finally:
        for fd in inherit_fds:
            os.set_inheritable(fd, False)


def _become_rank(launcher_pid: int) -> None:
    os.setpgid(0, 0)
    die_with_parent(launcher_pid)
    if _result_reader is not None:
        _prctl(_PR_SET_PTRACER, _result_reader)
    # The launcher ignores SIGINT and SIGTERM's default is what a rank needs.
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(number, signal.SIG_DFL)
    keep_freed_memory()


# glibc's mallopt parameters (malloc.h), and the values a long-lived process's malloc settles
# on by itself: its largest dynamic mmap threshold (32 MiB on 64 bits) and twice that to trim.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_BYTES, _MMAP_BYTES = 64 << 20, 32 << 20


def keep_freed_memory() -> None:
    """Have this process's malloc keep what a step frees for the next step, as the kernel's does.

    A fresh process's glibc maps blocks over 128 KiB on their own and returns the heap's free
    top over 128 KiB to the system; both thresholds rise only as it frees such blocks, so in a
    rank a training step's buffers (activations, gradients, a batch) were mapped afresh, or
    the heap regrown, step after step: 100-350 page faults a step in the loop's thread on
    some runs of a CPU ResNet cell (the kernel, whose malloc had settled long before: 0.3),
    and the same on a GPU's host side (82-800). Fixed at the settled values, the freed memory
    is reused: at most 64 MiB of free heap stays with the rank. Never raises.

        >>> keep_freed_memory()
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already did."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def become_subreaper() -> None:
    """Adopt this process's orphaned descendants instead of init (or the nearest subreaper).

    The setting is not inherited by children, so the launcher and each rank set it.
    """
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def children(pid: int | None = None) -> list[int]:
    """The pids whose parent is ``pid`` (this process by default), zombies included."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found  # gone meanwhile
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), as far as /proc shows them now."""
    found: list[int] = []
    level = children(pid)
    while level:
        found.extend(level)
        level = [grandchild for child in level for grandchild in children(child)]
    return found


def kill_strays(keep: set[int]) -> list[int]:
    """SIGKILL this process's children not in ``keep``, and everything below them; reap them.

    A subreaper's unknown children are orphans adopted from a subtree whose owner ended.
    Their own descendants are killed in the same pass; those adopted later (a parent killed
    before its child) are found by the next call. Returns the pids killed.
    """
    strays = [pid for pid in children() if pid not in keep]
    victims = [pid for stray in strays for pid in (stray, *descendants(stray))]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in strays:
        reap(pid)
    return victims


def open_pidfd(pid: int) -> int:
    """A descriptor that becomes readable when ``pid`` exits: a bounded wait, no SIGCHLD."""
    return os.pidfd_open(pid)


def reap(pid: int) -> tuple[int | None, int | None] | None:
    """(exit_code, signal_number) of a finished child, or None if it is still running."""
    try:
        waited, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return (None, None)
    if waited == 0:
        return None
    return (None, os.WTERMSIG(status)) if os.WIFSIGNALED(status) else (os.WEXITSTATUS(status), None)


def reap_now(pid: int, timeout: float = 2.0) -> None:
    """Wait (bounded) for a child that was just sent SIGKILL, so that it leaves no zombie."""
    deadline = time.monotonic() + timeout
    while reap(pid) is None and time.monotonic() < deadline:
        time.sleep(0.01)


def signal_group(pgid: int, number: int) -> None:
    """Send a signal to a rank's process group; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, number)


def process_groups() -> dict[int, list[int]]:
    """Process group id -> the pids in it, for every process visible in /proc."""
    groups: dict[int, list[int]] = {}
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        fields = _stat_fields(pid)
        if fields is not None:  # else gone meanwhile
            groups.setdefault(int(fields[2]), []).append(pid)
    return groups


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None once it is gone (or a zombie).

    A pid alone may be reused by an unrelated process; a pid with its start time cannot,
    so the run registry keeps both and nothing is signalled unless both still match.
    """
    fields = _stat_fields(pid)
    # Field 22 of /proc/<pid>/stat; the list starts at field 3.
    return None if fields is None or fields[0] in (b"Z", b"X") else int(fields[19])


def signal_ranks(ranks: Iterable[tuple[int, int]], number: int) -> list[int]:
    """Signal the process group of each rank given as (pid, start time); the pids signalled.

    A rank is signalled only if a live process still has that pid AND that start time AND
    leads its own process group (every rank does), so a stale or forged registry record
    can never reach another process. The identity is checked through a pidfd opened
    first: the process the pidfd holds is the one whose start time was read. The leader
    gets the signal through the pidfd (no pid reuse possible), then its group (its
    DataLoader workers) through killpg, as the launcher's own stop does.
    """
    signalled = []
    for pid, started in ranks:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # gone already
        try:
            fields = _stat_fields(pid)
            if fields is None or fields[0] in (b"Z", b"X") or int(fields[19]) != started or int(fields[2]) != pid:
                continue
            signal.pidfd_send_signal(pidfd, number)
            signal_group(pid, number)
            signalled.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
        finally:
            os.close(pidfd)
    return signalled


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat from field 3 (state) on (the command name before it may hold spaces
    or parentheses); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields if len(fields) > 19 else None


def remove_torch_shared_memory(pids: Iterable[int], directory: str = "/dev/shm") -> None:
    """Unlink the /dev/shm entries torch named after these processes, once they are dead.

    torch names a shared block ``torch_<creator pid>_<random>_<counter>`` and unlinks it
    right after mapping it; a process killed in between (a DataLoader worker when a run
    is stopped) leaves the entry behind for good. Only dead creators' entries are removed.
    """
    prefixes = tuple(f"torch_{pid}_" for pid in set(pids) if not _running(pid))
    if not prefixes:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(prefixes):
            with contextlib.suppress(OSError):  # removed meanwhile
                os.unlink(os.path.join(directory, name))


def _running(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")  # a zombie has exited; only its wait is missing


def resident_bytes(pid: int) -> int | None:
    """Resident memory of a process, read from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    # An exited but unreaped process (a zombie) reads as 0 pages: that is no sample.
    return pages * os.sysconf("SC_PAGE_SIZE") or None


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def read_memory(pid: int, local_address: int, remote_address: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``remote_address`` in process ``pid`` to ``local_address`` here.

    One copy, from the other process's pages straight into ours (``process_vm_readv``),
    with no shared file in between. The caller must be allowed to trace ``pid`` (same
    user and, under Yama's default, an ancestor of it, as the kernel is of every rank).
    Raises OSError: EPERM or ENOSYS where a sandbox forbids it, ESRCH once ``pid`` is gone.
    """
    vec, ulong = ctypes.POINTER(_IoVec), ctypes.c_ulong
    readv = libc_function("process_vm_readv", (ctypes.c_int, vec, ulong, vec, ulong, ulong), ctypes.c_ssize_t)
    done = 0
    while done < nbytes:  # a read may stop short, e.g. at a mapping's end
        local = _IoVec(local_address + done, nbytes - done)
        remote = _IoVec(remote_address + done, nbytes - done)
        count = readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if count < 0:
            number = ctypes.get_errno()
            raise OSError(number, f"cannot read the memory of process {pid}: {os.strerror(number)}")
        if count == 0:
            raise OSError(errno.EFAULT, f"process {pid} has no memory at {remote_address + done:#x}")
        done += count


class HeldInterrupts:
    """What :func:`interrupts_held` saw: ``received`` turns True when SIGINT came meanwhile."""

    def __init__(self) -> None:
        self.received = False

    def note(self, number: int, frame: object) -> None:
        """The SIGINT handler while interrupts are held: remember that one came."""
        self.received = True


_holding: HeldInterrupts | None = None


@contextlib.contextmanager
def interrupts_held() -> Iterator[HeldInterrupts]:
    """Note SIGINT instead of raising KeyboardInterrupt, for code that must not be cut short.

    A KeyboardInterrupt can land between any two bytecodes: half way through sending a
    frame to the launcher, or after a run started but before anyone holds its handle. Held,
    an interrupt is a flag that the code checks where acting on it is safe (its waits poll).
    Only the main thread receives signals; in another thread, or inside a section that
    already holds them, the holder yielded never turns True: the outermost section acts.
    """
    global _holding
    if _holding is not None or threading.current_thread() is not threading.main_thread():
        yield HeldInterrupts()
        return
    held = _holding = HeldInterrupts()
    previous = signal.signal(signal.SIGINT, held.note)
    try:
        yield held
    finally:
        # A handler installed from C (None) cannot be put back: Python's default is the closest.
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        _holding = None


@contextlib.contextmanager
def interrupts_raised() -> Iterator[None]:
    """Inside :func:`interrupts_held`, let SIGINT raise KeyboardInterrupt again for a while.

    For a wait on the user (a debugger prompt), which an interrupt must be able to cut
    short; the caller turns the KeyboardInterrupt into its held flag. Elsewhere a no-op.
    """
    if _holding is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def ignore_interrupts() -> None:
    """The launcher hears about interrupts only through the kernel's StopRun requests.

    It also ignores the stack-dump signal, and so does every rank it forks or spawns until
    the rank registers its dump: a request that reaches a rank too early is lost, not fatal.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(DUMP_SIGNAL, signal.SIG_IGN)


def request_stack(pid: int) -> bool:
    """Ask a rank for its stack dump; False if it cannot answer (not registered, or gone)."""
    if not catches(pid, DUMP_SIGNAL):
        return False
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    return True


def catches(pid: int, number: int) -> bool:
    """Whether process ``pid`` has a handler for signal ``number`` (its SigCgt mask in /proc)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"SigCgt:"):
                return bool(int(line.split()[1], 16) >> (number - 1) & 1)
    return False


def exit_now(code: int = 0) -> NoReturn:
    """Leave without running interpreter teardown.

    A rank's results are already safe when it gets here, and teardown can hang: a gloo
    group destroyed while DDP still holds it can block forever in its destructor.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def end_multiprocessing(seconds: float) -> None:
    """What the interpreter's exit does for multiprocessing, which :func:`exit_now` skips, given at
    most ``seconds``: end the daemonic children (DataLoader workers, pools) and run its finalizers.

    A child started by spawn or forkserver (Python 3.14's default) opens its queues' semaphores by
    name, so they stay in /dev/shm until a finalizer unlinks them: a rank that left with persistent
    workers alive left 14 there for good. On a thread, bounded: a finalizer joining a queue's feeder
    can wait for ever, and an exit must not. Nothing registered (no child started), nothing to do.
    """
    util = sys.modules.get("multiprocessing.util")
    if util is None or not (util._finalizer_registry or sys.modules["multiprocessing"].active_children()):
        return
    if threading.current_thread() is threading.main_thread():
        # torch's DataLoader handler would raise "worker exited unexpectedly" here as each worker ends.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ending = threading.Thread(target=util._exit_function, name="nbtrain: multiprocessing's exit", daemon=True)
    ending.start()
    ending.join(seconds)


@functools.cache
def libc_function(name: str, argtypes: tuple[Any, ...], restype: Any = ctypes.c_int) -> Any:
    """The C library's function ``name`` (errno kept), loaded once with its argument and result types."""
    function = getattr(ctypes.CDLL(None, use_errno=True), name)
    function.argtypes, function.restype = list(argtypes), restype
    return function


def _prctl(option: int, argument: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(option, argument, 0, 0, 0)


def return_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim), so that the warm
    template holds only what its launchers share."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def allow_result_reader(kernel_pid: int) -> None:
    """Ranks forked from now on let ``kernel_pid`` read their memory (rank 0's result)."""
    global _result_reader
    _result_reader = kernel_pid


def start_template(path: str) -> None:
    """Start the warm template for the socket ``path``; it detaches, so it is nobody's child.

    The process started here forks the template and exits at once (we reap it now), so the
    template outlives this kernel without ever being its zombie.
    """
    env = {**os.environ, **importing_this_nbtrain(os.environ)}
    # Not the kernel's working directory: `-m` puts it first on sys.path, and a checkout
    # there would be the nbtrain the template imports, not the kernel's (it would then
    # refuse every kernel). Each launcher it forks takes its kernel's directory.
    starter = _start_python([TEMPLATE_MODULE, path], "template", env, subprocess.DEVNULL, cwd=os.path.dirname(path))
    starter.wait(timeout=30.0)


def importing_this_nbtrain(env: Mapping[str, str]) -> dict[str, str]:
    """What a child interpreter's environment needs so that it imports this process's nbtrain:
    ``PYTHONPATH`` led by the folder that holds it, unless that is a site directory (an
    installed nbtrain, found there anyway; put first, it would come before the standard library).

        >>> env = importing_this_nbtrain({"PYTHONPATH": "/opt/lib"})
        >>> env == {} or env["PYTHONPATH"] == _nbtrain_root() + os.pathsep + "/opt/lib"
        True
    """

    root = _nbtrain_root()
    # getsitepackages: missing in some virtual environments of old virtualenv versions.
    folders = [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    sites = {os.path.realpath(folder) for folder in folders}
    if os.path.realpath(root) in sites:
        return {}
    rest = env.get("PYTHONPATH", "")
    return {"PYTHONPATH": root + (os.pathsep + rest if rest else "")}


def _nbtrain_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # nbtrain/system/


def detach() -> None:
    """The template's first act: fork, let the starter exit, lead a session of its own."""
    if os.fork() != 0:
        os._exit(0)
    os.setsid()


def fork_launcher(child_main: Callable[[], None]) -> int:
    """Fork a kernel's private launcher from the (thread-free) template, in its own session.

    It does not die with the template (no PDEATHSIG): it lives as long as its kernel.
    """
    return _fork(os.setsid, child_main)


class ForkedLauncher:
    """A kernel's launcher forked by the template: watched through a pidfd, not waitpid.

    ``resolve(timeout)`` answers the template's reply: (answered, the launcher's pid or None
    if it made none, why it made none); it is asked on first need, by one thread at a time,
    and a wait is never longer than asked for. The launcher's exit status is the template's
    to reap, so it reads as :data:`UNKNOWN_EXIT`.
    """

    REPLY_SECONDS = 60.0  # the template answers once it has imported torch

    def __init__(self, resolve: Callable[[float], tuple[bool, int | None, str]], stderr: IO[bytes]):
        self._resolve = resolve
        self._answered = False
        self._pid: int | None = None
        self._pidfd: int | None = None
        self._closing = threading.Lock()
        # The reply is read once: two threads reading it at once (the kernel's check of the
        # launcher and a caller asking its pid) left one of them with no pid, and the kernel
        # then gave up a good launcher for its own.
        self._asking = threading.Lock()
        self.why_none = ""  # the template's words where it forked no launcher
        self.stderr: IO[bytes] | None = stderr

    @property
    def pid(self) -> int:
        """The launcher's process id, once the template said it forked one (-1 if it made none)."""
        self._answer(self.REPLY_SECONDS)
        return -1 if self._pid is None else self._pid

    def answered_pid(self) -> int | None:
        """The launcher's pid if the template has answered by now (never waits); None otherwise."""
        self._answer(0.0)
        return self._pid

    def _answer(self, timeout: float) -> bool:
        if self._answered:
            return True
        started = time.monotonic()
        taken = self._asking.acquire(timeout=timeout) if timeout > 0 else self._asking.acquire(blocking=False)
        if not taken:
            return self._answered  # another thread is reading the reply: not within our time
        try:
            if not self._answered:
                answered, pid, self.why_none = self._resolve(max(0.0, timeout - (time.monotonic() - started)))
                if pid is not None:
                    with contextlib.suppress(OSError):
                        self._pidfd = os.pidfd_open(pid)
                self._pid = pid
                self._answered = answered  # last: a thread that reads it unlocked finds the pid set
        finally:
            self._asking.release()
        return self._answered

    def poll(self) -> int | None:
        """None while the launcher lives (or the template has not forked it yet), else UNKNOWN_EXIT."""
        if not self._answer(0.0):
            return None  # not forked yet: the template is still importing
        return None if self._alive(0.0) else UNKNOWN_EXIT

    def wait(self, timeout: float | None = None) -> int:
        """Wait at most ``timeout`` seconds for the launcher to end (``subprocess.TimeoutExpired`` if it does not).

        Returns UNKNOWN_EXIT: the launcher is not this process's child, so its status is not known.
        """
        started = time.monotonic()
        answered = self._answer(self.REPLY_SECONDS if timeout is None else timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        if not answered or self._alive(left):
            raise subprocess.TimeoutExpired("nbtrain launcher", timeout or 0.0)
        return UNKNOWN_EXIT

    def kill(self) -> None:
        """Send the launcher SIGKILL through its pidfd (nothing if it was never forked or has gone)."""
        if self._answer(0.0) and self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def __del__(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)

    def _alive(self, timeout: float | None) -> bool:
        # Asked from more than one thread (the kernel's watcher, its exit): each reads the
        # descriptor once, and only the thread that still finds it in place closes it.
        pidfd = self._pidfd
        if pidfd is None:
            return False
        try:
            readable, _, _ = select.select([pidfd], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile by a thread that saw the launcher end
            return False
        if readable:  # gone for good: the descriptor is not needed any more
            with self._closing:
                if self._pidfd == pidfd:
                    self._pidfd = None
                    os.close(pidfd)
        return not readable
