"""The warm template: kernels' launchers forked from one process that imported torch once.

Real kernels (``NotebookKernel``) and real templates, each test in a runtime directory of
its own (``$NBTRAIN_TEMPLATE_DIR``), every template it started killed by PID at the end.
The rest of the suite runs with the template switched off (tests/conftest.py), since its
tests count each kernel's launcher among the kernel's descendants.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from helpers import procs
from kernel_helpers import LAUNCHER_PID, NotebookKernel
from nbtrain.kernel import warm
from nbtrain.messages import templatesocket as naming
from nbtrain.messages import wire
from nbtrain.system import processes

GONE_SECONDS = 30.0
READY_SECONDS = 180.0  # the template imports torch: slow on a loaded 2-core machine
IDLE_SECONDS = "3"

pytestmark = pytest.mark.slow

FIRST_RUN = """%%distributed --devices 2 --accelerator cpu
import os, torch
total = torch.ones(1).sum().item() + 1
"""

WAIT_FOR_FILE = """%%distributed --devices 2 --accelerator cpu
import os, time
print("waiting", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists({marker!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
found = os.path.exists({marker!r})
"""

WAIT_READY = "__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).get_client().ready.wait(180)"


@pytest.fixture
def template_env() -> Iterator[dict[str, str]]:
    """The template switched on, in a private directory of this test's; its templates killed after."""
    folder = tempfile.mkdtemp(prefix="nbtrain-template-test-")
    os.chmod(folder, 0o700)
    env = {naming.ENABLED_VARIABLE: "1", naming.DIRECTORY_VARIABLE: folder, naming.IDLE_VARIABLE: IDLE_SECONDS}
    try:
        yield env
    finally:
        found = templates(folder)
        procs.kill_pids(found)
        procs.wait_gone(found, GONE_SECONDS, reaped=False)
        shutil.rmtree(folder, ignore_errors=True)


def templates(folder: str) -> list[int]:
    return procs.template_pids(folder)


def parent_of(pid: int) -> int:
    return psutil.Process(pid).ppid()


def loaded_kernel(env: dict[str, str]) -> tuple[NotebookKernel, int]:
    """A kernel with nbtrain loaded and its launcher ready; (kernel, launcher pid)."""
    kernel = NotebookKernel(env=env)
    kernel.run_ok("%load_ext nbtrain")
    assert kernel.value(WAIT_READY) is True
    return kernel, kernel.value(LAUNCHER_PID)


def timed_first_run(kernel: NotebookKernel) -> float:
    started = time.monotonic()
    kernel.run_ok(FIRST_RUN)
    elapsed = time.monotonic() - started
    assert kernel.value("total") == 2.0
    return elapsed


def test_a_second_kernels_launcher_is_forked_from_the_template_and_a_killed_kernel_leaves_only_it(
    template_env, record_property, tmp_path
):
    first, first_launcher = loaded_kernel(template_env)
    with first:
        template = parent_of(first_launcher)
        assert template in templates(template_env[naming.DIRECTORY_VARIABLE])
        second = NotebookKernel(env=template_env)
        with second:
            second.run_ok("%load_ext nbtrain")
            elapsed = timed_first_run(second)
            record_property("second_kernel_first_run_seconds", round(elapsed, 3))
            second_launcher = second.value(LAUNCHER_PID)
            assert second_launcher != first_launcher
            assert parent_of(second_launcher) == template, "the second kernel's launcher is not the template's child"
            # The launcher has the kernel's working directory and environment, not the template's.
            assert psutil.Process(second_launcher).cwd() == os.getcwd()
            # The first kernel dies in the middle of a run: its launcher and ranks go with it.
            msg_id = first.start_cell(WAIT_FOR_FILE.format(marker=str(tmp_path / "never")))
            first.wait_for_stream(msg_id, ["waiting"])
            ranks = [child.pid for child in psutil.Process(first_launcher).children()]
            assert len(ranks) == 2
            os.kill(first.pid, signal.SIGKILL)
            assert procs.wait_gone([first.pid, first_launcher, *ranks], GONE_SECONDS, reaped=False) == []
            assert psutil.pid_exists(template)
            assert psutil.Process(template).children() == [psutil.Process(second_launcher)]
        assert procs.wait_gone([second_launcher], GONE_SECONDS, reaped=False) == []
    # No kernel left: the template goes by itself after its idle time (3 s here).
    assert procs.wait_gone([template], GONE_SECONDS, reaped=False) == []
    folder = template_env[naming.DIRECTORY_VARIABLE]
    assert [name for name in os.listdir(folder) if name.endswith(".sock")] == []




def test_killing_the_template_mid_run_changes_nothing_and_the_next_kernel_starts_a_new_one(template_env, tmp_path):
    marker = str(tmp_path / "go")
    kernel, launcher = loaded_kernel(template_env)
    with kernel:
        template = parent_of(launcher)
        msg_id = kernel.start_cell(WAIT_FOR_FILE.format(marker=marker))
        kernel.wait_for_stream(msg_id, ["waiting"])
        os.kill(template, signal.SIGKILL)
        assert procs.wait_gone([template], GONE_SECONDS, reaped=False) == []
        with open(marker, "w"):
            pass
        _reply, out = kernel.wait_for_reply(msg_id, 120.0)
        assert out.error is None, out.text
        assert kernel.value("found") is True
        assert psutil.pid_exists(launcher)
        timed_first_run(kernel)  # the same launcher goes on serving runs
        assert kernel.value(LAUNCHER_PID) == launcher
        other, other_launcher = loaded_kernel(template_env)
        with other:
            new_template = parent_of(other_launcher)
            assert new_template != template
            assert new_template in templates(template_env[naming.DIRECTORY_VARIABLE])


def test_a_template_of_another_environment_or_version_is_never_used(template_env):
    folder = template_env[naming.DIRECTORY_VARIABLE]
    # A template of another nbtrain version, at the very name this environment's kernels use:
    # the handshake refuses it, and the kernel starts its own launcher, silently.
    path = naming.socket_path(folder, naming.identity(environ={}))
    stranger_env = {**os.environ, **template_env, naming.TAG_VARIABLE: "an older nbtrain", naming.IDLE_VARIABLE: "600"}
    start_template(path, stranger_env)
    stranger = templates(folder)
    assert len(stranger) == 1
    log_path = os.path.join(folder, "kernel.log")
    kernel = NotebookKernel(env=template_env, log=log_path)
    with kernel:
        kernel.run_ok("%load_ext nbtrain")
        said_and_listed(kernel, log_path, "the template forked no launcher: the template was started for Identity(")
        launcher = kernel.value(LAUNCHER_PID)
        assert parent_of(launcher) == kernel.pid
        timed_first_run(kernel)
        assert psutil.Process(stranger[0]).children() == []
    # Another environment (its identity differs) asks for a socket of another name: its own template.
    other_env = {**template_env, naming.TAG_VARIABLE: "another environment"}
    kernel, launcher = loaded_kernel(other_env)
    with kernel:
        assert parent_of(launcher) not in (kernel.pid, stranger[0])
        assert parent_of(launcher) in templates(folder)


def start_template(path: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", processes.TEMPLATE_MODULE, path], env=env, check=True, timeout=60)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no template socket at {path}"
        time.sleep(0.01)


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    """A second user of this machine, made for the test (root, useradd and setpriv needed) and removed after."""
    if os.getuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, useradd and setpriv to act as a second user")
    name = "nbtrainother"
    made = False
    try:
        pwd.getpwnam(name)
    except KeyError:
        if subprocess.run(["useradd", "--no-create-home", name], check=False, capture_output=True).returncode != 0:
            pytest.skip("useradd could not make a second user here")
        made = True
    try:
        yield pwd.getpwnam(name)
    finally:
        if made:
            subprocess.run(["userdel", name], check=False, capture_output=True)


# Standard library only: the other user need not be able to read this checkout.
ASK_AS_OTHER = """
import pickle, socket, struct, sys
sock = socket.socket(socket.AF_UNIX)
try:
    sock.connect(sys.argv[1])
except PermissionError:
    print("no access"); sys.exit(0)
sock.settimeout(30)
body = pickle.dumps({"a request": True})
try:
    socket.send_fds(sock, [struct.pack("!Q", len(body))], [0, 1])
    sock.sendall(body)
    print("refused" if sock.recv(1) == b"" else "answered")
except (BrokenPipeError, ConnectionResetError):  # closed on us before we finished asking
    print("refused")
"""


def test_another_users_process_is_refused(template_env, other_user):
    user = other_user
    folder = template_env[naming.DIRECTORY_VARIABLE]
    path = naming.socket_path(folder, naming.identity())
    with warm_launcher({**template_env, naming.IDLE_VARIABLE: "600"}) as launcher:
        assert launcher.popen.pid > 0
    ask = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "/usr/bin/python3", "-c"]
    # The runtime directory is the user's own (0700): another user cannot reach the socket.
    answer = subprocess.run([*ask, ASK_AS_OTHER, path], check=False, capture_output=True, text=True, timeout=60)
    assert answer.stdout.strip() == "no access", answer.stderr
    # Even where it can (the directory opened up), the template closes on them unanswered.
    os.chmod(folder, 0o755)
    os.chmod(path, 0o666)
    answer = subprocess.run([*ask, ASK_AS_OTHER, path], check=False, capture_output=True, text=True, timeout=60)
    assert answer.stdout.strip() == "refused", answer.stdout + answer.stderr
    os.chmod(folder, 0o700)


class warm_launcher:
    """A private launcher from the template, for the test process itself; stopped on exit."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def __enter__(self) -> processes.LauncherProcess:
        self.saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        launcher = warm.forked_launcher()
        assert launcher is not None
        launcher.channel.settimeout(READY_SECONDS)
        ready, _ = wire.receive(launcher.channel)
        assert type(ready).__name__ == "LauncherReady"
        self.launcher = launcher
        return launcher

    def __exit__(self, *exc: object) -> None:
        processes.stop_launcher(self.launcher)
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_hundred_launcher_starts_and_stops_leave_no_growth(template_env):
    """100 kernels' worth of private launchers (the kernel's side of it, from this process):
    the template's and this process's descriptors, children and memory stay as they were."""
    with warm_launcher(template_env) as first:
        template = parent_of(first.popen.pid)
    gc.collect()  # earlier tests' kernel clients may still hold descriptors that a collection frees
    before = (open_fds(template), open_fds(os.getpid()), psutil.Process(template).memory_info().rss)
    pids = set()
    for _ in range(100):
        with warm_launcher(template_env) as launcher:
            pids.add(launcher.popen.pid)
            assert parent_of(launcher.popen.pid) == template
    assert len(pids) == 100
    assert procs.wait_gone(sorted(pids), GONE_SECONDS, reaped=False) == []
    # The template reaps each launcher (and closes its pidfd) as its loop sees it exit.
    deadline = time.monotonic() + GONE_SECONDS
    while (open_fds(template) != before[0] or psutil.Process(template).children()) and time.monotonic() < deadline:
        time.sleep(0.02)
    gc.collect()
    after = (open_fds(template), open_fds(os.getpid()), psutil.Process(template).memory_info().rss)
    assert after[0] == before[0], f"the template's descriptors went from {before[0]} to {after[0]}"
    assert after[1] <= before[1], f"this process's descriptors went from {before[1]} to {after[1]}"
    assert psutil.Process(template).children() == []
    assert after[2] - before[2] < 16 << 20, f"the template grew by {(after[2] - before[2]) >> 20} MiB"


# A launcher the template forked (or was asked to fork) that cannot serve before the first
# run was sent: the kernel starts its own launcher instead, silently, and leaves nothing of it.

def test_a_kernel_working_in_a_shadowing_checkout_starts_a_template_of_its_own_nbtrain(template_env, tmp_path):
    """The kernel's working directory holds another copy of nbtrain (newer files). The template
    the kernel starts there imports the kernel's nbtrain, not that copy: it serves the kernel."""
    shadow = tmp_path / "checkout"
    package = os.path.dirname(os.path.dirname(os.path.abspath(warm.__file__)))
    # shutil.copy, not copy2: fresh modification times, so the copy's code stamp differs.
    skip = shutil.ignore_patterns("labextension", "__pycache__")
    shutil.copytree(package, shadow / "nbtrain", copy_function=shutil.copy, ignore=skip)
    kernel = NotebookKernel(env={**template_env, naming.IDLE_VARIABLE: "600"})  # the template stays to be looked at
    with kernel:
        kernel.run_ok(f"import nbtrain, os\nos.chdir({str(shadow)!r})")
        kernel.run_ok("%load_ext nbtrain")
        timed_first_run(kernel)
        launcher = kernel.value(LAUNCHER_PID)
        forked = templates(template_env[naming.DIRECTORY_VARIABLE])  # its launcher and ranks share its command line
        found = [pid for pid in forked if parent_of(pid) not in forked]
        assert len(found) == 1, found
        assert parent_of(launcher) == found[0], "the first run did not go to a launcher of the template"
        assert kernel.value("os.getcwd()") == str(shadow)  # the kernel's directory is as it was
    assert procs.wait_gone([launcher], GONE_SECONDS, reaped=False) == []


def test_a_forked_launcher_killed_before_the_first_run_is_replaced_by_the_kernels_own(template_env, tmp_path):
    log_path = str(tmp_path / "kernel.log")
    kernel = NotebookKernel(env={**template_env, naming.IDLE_VARIABLE: "600"}, log=log_path)  # the template stays
    with kernel:
        kernel.run_ok("%load_ext nbtrain")
        forked = kernel.value(LAUNCHER_PID)  # answered by the template once it has imported torch
        template = parent_of(forked)
        assert template in templates(template_env[naming.DIRECTORY_VARIABLE])
        # Killed once it said it was ready: killed before, it is "closed before it was ready".
        assert kernel.value(WAIT_READY) is True
        os.kill(forked, signal.SIGKILL)
        assert procs.wait_gone([forked], GONE_SECONDS, reaped=False) == []
        timed_first_run(kernel)
        said_and_listed(kernel, log_path, "its launcher ended before the first run was sent to it")
        launcher = kernel.value(LAUNCHER_PID)
        assert launcher != forked
        assert parent_of(launcher) == kernel.pid
        assert psutil.Process(template).children() == []
        # From here on the launcher's death is an error again, and the next run starts a new one.
        os.kill(launcher, signal.SIGKILL)
        assert procs.wait_gone([launcher], GONE_SECONDS, reaped=False) == []
        timed_first_run(kernel)


def test_a_template_that_does_not_answer_in_time_is_given_up_and_forks_nothing_later(template_env, tmp_path):
    folder = template_env[naming.DIRECTORY_VARIABLE]
    path = naming.socket_path(folder, naming.identity(environ={}))
    start_template(path, {**os.environ, **template_env})
    [template] = templates(folder)
    os.kill(template, signal.SIGSTOP)  # it accepts nobody: the kernel's request waits in its backlog
    try:
        log_path = str(tmp_path / "kernel.log")
        kernel = NotebookKernel(env=template_env, log=log_path)
        with kernel:
            kernel.run_ok("import nbtrain.kernel.warm as warm\nwarm.READY_SECONDS = 2.0")
            kernel.run_ok("%load_ext nbtrain")
            timed_first_run(kernel)
            said_and_listed(kernel, log_path, "its launcher did not say it was ready within 2 s")
            launcher = kernel.value(LAUNCHER_PID)
            assert parent_of(launcher) == kernel.pid
            os.kill(template, signal.SIGCONT)
            # The template reads the request the kernel gave up on and forks nothing for it;
            # a second kernel then gets its launcher from it as usual.
            other, other_launcher = loaded_kernel(template_env)
            with other:
                assert parent_of(other_launcher) == template
                assert psutil.Process(template).children() == [psutil.Process(other_launcher)]
    finally:
        os.kill(template, signal.SIGCONT)


def test_a_launcher_from_the_template_gives_its_ranks_the_templates_private_network(template_env, tmp_path):
    from nbtrain.system import privatenet

    if privatenet.probe() is not None:
        pytest.skip(f"no namespaces here: {privatenet.probe()}")
    kernel, launcher = loaded_kernel(template_env)
    with kernel:
        assert parent_of(launcher) in templates(template_env[naming.DIRECTORY_VARIABLE])
        msg_id = kernel.start_cell(WAIT_FOR_FILE.format(marker=str(tmp_path / "go")))
        kernel.wait_for_stream(msg_id, ["waiting"])
        ranks = [child.pid for child in psutil.Process(launcher).children()]
        namespaces = {os.readlink(f"/proc/{pid}/ns/user") for pid in ranks}
        (tmp_path / "go").touch()
        _reply, out = kernel.wait_for_reply(msg_id, 120.0)
        assert out.error is None, out.text
    # Both ranks joined one user namespace (the template's, made once), not the kernel's.
    assert len(ranks) == 2 and len(namespaces) == 1
    assert namespaces != {os.readlink("/proc/self/ns/user")}


# Run by a fresh interpreter whose nbtrain is a copy (the test saves one of its files).
SAVED_WHILE_STARTING = """
import os, sys, time
from nbtrain.messages import templatesocket as naming, wire
from nbtrain.kernel import warm
launcher = warm.forked_launcher()
path = naming.socket_path(os.environ["NBTRAIN_TEMPLATE_DIR"], naming.identity())
deadline = time.monotonic() + 60
while not os.path.exists(path) and time.monotonic() < deadline:  # bound: the template is importing torch now
    time.sleep(0.005)
os.utime(os.path.join(os.path.dirname(warm.__file__), os.pardir, "errors.py"))  # a file saved meanwhile
launcher.channel.settimeout(180)
try:
    print(type(wire.receive(launcher.channel)[0]).__name__)
except wire.ChannelClosed:
    print("refused:", launcher.popen.answered_pid(), launcher.popen.why_none)
"""


def test_a_file_saved_while_the_template_starts_does_not_make_it_refuse_its_kernel(template_env, tmp_path):
    """The template took its identity after importing torch (seconds): a file of nbtrain saved
    meanwhile (an editor, a checkout) made it refuse the kernel that started it, whose launcher
    then came from nowhere but the kernel's own start."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(warm.__file__)))
    skip = shutil.ignore_patterns("labextension", "__pycache__")
    shutil.copytree(package, tmp_path / "nbtrain", copy_function=shutil.copy, ignore=skip)
    env = {**os.environ, **template_env, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SAVED_WHILE_STARTING], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.stdout.strip() == "LauncherReady", done.stdout + done.stderr


def kernel_log(kernel_log_path: str) -> str:
    with open(kernel_log_path) as log:
        return log.read()


SAID = "nbtrain: the warm template is not used: "
FALLBACKS = "__import__('nbtrain.kernel.warm', fromlist=['x']).fallbacks()"


def said_and_listed(kernel: NotebookKernel, log_path: str, words: str) -> None:
    """The kernel's launcher is its own, and both its log and ``warm.fallbacks()`` say ``words``."""
    assert kernel.value(WAIT_READY) is True
    assert parent_of(kernel.value(LAUNCHER_PID)) == kernel.pid
    reasons = kernel.value(FALLBACKS)
    assert any(words in reason for reason in reasons), reasons
    lines = [line for line in kernel_log(log_path).splitlines() if line.startswith(SAID)]
    assert any(words in line for line in lines), kernel_log(log_path)


@pytest.mark.parametrize("case", ["switched off", "directory open to others", "socket path too long", "no answer"])
def test_each_way_the_template_is_not_used_is_said_in_the_kernels_log(template_env, tmp_path, case):
    folder = template_env[naming.DIRECTORY_VARIABLE]
    env = dict(template_env)
    if case == "switched off":
        env[naming.ENABLED_VARIABLE] = "0"
        words = "$NBTRAIN_TEMPLATE='0' switches it off"
    elif case == "directory open to others":
        os.chmod(folder, 0o755)
        words = f"{folder} is not a directory of uid {os.getuid()}'s own"
    elif case == "socket path too long":  # no Unix socket can be named there
        env[naming.DIRECTORY_VARIABLE] = os.path.join(folder, "x" * 120)
        words = "reaching the template at"
    else:  # something listens at the template's name and closes on every kernel unanswered
        words = "the template closed the connection without an answer"
    log_path = str(tmp_path / "kernel.log")
    with contextlib.ExitStack() as stack:
        if case == "no answer":
            stack.enter_context(closing_listener(naming.socket_path(folder, naming.identity(environ={}))))
        kernel = stack.enter_context(NotebookKernel(env=env, log=log_path))
        kernel.run_ok("%load_ext nbtrain")
        said_and_listed(kernel, log_path, words)
        timed_first_run(kernel)


@contextlib.contextmanager
def closing_listener(path: str) -> Iterator[None]:
    """A socket at ``path`` that reads each request and closes on it unanswered, from a thread of this process."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                connection, _ = listener.accept()
                with connection, contextlib.suppress(OSError, wire.ChannelClosed):
                    connection.settimeout(10.0)
                    _request, fds = wire.receive(connection)  # read whole: the kernel's send succeeds
                    for fd in fds:
                        os.close(fd)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5.0)
        listener.close()
