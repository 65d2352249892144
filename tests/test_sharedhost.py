"""A run on a machine shared with other users: nothing of it is reachable by another user.

The suite runs as root; the test makes two users (``useradd``), a victim and an attacker. The
victim's real Jupyter kernel runs a 2-rank CPU training run. While it trains, and again while
its standby ranks wait for the next run, the test finds every listening TCP and Unix socket
of the kernel's processes (kernel, launcher, ranks, standby ranks) from each process's own
``/proc/<pid>/net/*`` and ``/proc/<pid>/fd`` and the attacker tries to connect to each. The
kernel's own sockets from before nbtrain was loaded (Jupyter's ZMQ ports, every message on
them signed with the connection file's key, and ipykernel's pipe for forked output) are the
only ones left out. The rank's own network is unchanged: its user code
reaches a server on the host's 127.0.0.1 and one on the host's outward address (a stand-in
for the outside network).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator

import psutil
import pytest

from helpers import listeners, osusers
from kernel_helpers import NotebookKernel, wait_for_standby

pytestmark = pytest.mark.slow

TRAIN = """%%distributed --devices 2 --accelerator cpu
import os, socket, time, torch
import torch.distributed as dist
def fetch(host, port):
    with socket.create_connection((host, port), timeout=10) as conn:
        return conn.recv(64).decode()
reached = [fetch(host, port) for host, port in {servers!r}]
model = torch.nn.Linear(4, 1)
print("training", flush=True)
deadline = time.monotonic() + 120
while True:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    stop = torch.tensor([float(os.path.exists({marker!r}) or time.monotonic() > deadline)])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank leaves the loop at the same step
    if stop.item():
        break
    time.sleep(0.01)
finished = os.path.exists({marker!r})
group = dist.new_group([0, 1])  # a group the cell makes itself, from its own thread
total = torch.ones(1)
dist.all_reduce(total, group=group)
gathered = [None, None]
dist.all_gather_object(gathered, dist.get_rank())
grouped = [total.item(), gathered]
big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: the kernel reads it out of rank 0's memory
"""


class Greeter:
    """A TCP server of the test's (a tracker's server, a dataset cache): says its name to whoever connects."""

    def __init__(self, host: str, name: str):
        self.server = socket.create_server((host, 0))
        self.address = (host, self.server.getsockname()[1])
        self.name = name
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            with conn:
                conn.sendall(self.name.encode())

    def close(self) -> None:
        self.server.close()


def outward_address() -> str | None:
    """An address of this host's on a non-loopback interface, if it has one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's source
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


@pytest.fixture
def people() -> Iterator[tuple]:
    with osusers.made_user("victim") as victim, osusers.made_user("attack") as attacker:
        yield victim, attacker


def interpreter_for_all(base: str) -> str:
    """This environment's python as every user can run it.

    The test's interpreter may live where only root may go (a pyenv under /root); the
    system's python of the same version, in a virtual environment of its own whose
    site-packages are this environment's, runs the same code as any user.
    """
    import nbtrain

    for needed in (*_site_packages(), os.path.dirname(nbtrain.__file__)):  # what the victim's kernel imports
        private = _private_parent(needed)
        if private is not None:
            pytest.skip(
                f"the victim (another OS user) cannot read {needed}: {private} is private to its owner "
                f"(mode {os.stat(private).st_mode & 0o777:o}); to run this test, clone nbtrain where other users "
                "may enter"
            )
    real = os.path.realpath(sys.executable)
    if _private_parent(real) is None and os.stat(real).st_mode & 0o001:
        return sys.executable
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.path.exists(system):
        pytest.skip(f"no python the victim can run ({sys.executable} is root's, no {system})")
    venv = os.path.join(base, "venv")
    packages = os.path.join(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
    os.makedirs(packages)
    os.makedirs(os.path.join(venv, "bin"))
    os.symlink(system, os.path.join(venv, "bin", "python"))
    with open(os.path.join(venv, "pyvenv.cfg"), "w") as f:
        f.write(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {sys.version.split()[0]}\n")
    with open(os.path.join(packages, "environment.pth"), "w") as f:
        f.writelines(f"import site; site.addsitedir({path!r})\n" for path in _site_packages())
    return os.path.join(venv, "bin", "python")


def _site_packages() -> list[str]:
    """This environment's own site-packages."""
    import site
    import sysconfig

    ours = [path for path in site.getsitepackages() if path.startswith(sys.prefix)]
    return ours or [sysconfig.get_paths()["purelib"]]


def _private_parent(path: str) -> str | None:
    """The first directory above ``path`` (itself included) that other users may not enter, or None."""
    real = os.path.realpath(path)
    parents = [real[: i or 1] for i, c in enumerate(real) if c == "/"] + [real]
    return next((parent for parent in parents if os.path.isdir(parent) and not os.stat(parent).st_mode & 0o001), None)


def victim_kernel(victim, monkeypatch, extra: dict[str, str] | None = None) -> NotebookKernel:
    """A real kernel running as ``victim``, in directories of the victim's own."""
    base = tempfile.mkdtemp(prefix="nbtrain-sharedhost-")
    os.chmod(base, 0o755)
    python = interpreter_for_all(base)
    home = osusers.private_directory(victim, base)
    runtime = osusers.private_directory(victim, base)
    specs = tempfile.mkdtemp(dir=base)
    kernel_dir = os.path.join(specs, "kernels", "python3")
    os.makedirs(kernel_dir)
    become = " ".join(osusers.as_user(victim))
    # The kernel manager (root) writes the connection file; the victim must own it to read it.
    command = f'chown {victim.pw_uid}:{victim.pw_gid} "$0" && exec {become} {python} -m ipykernel_launcher -f "$0"'
    spec = {"argv": ["/bin/sh", "-c", command, "{connection_file}"], "display_name": "victim", "language": "python"}
    with open(os.path.join(kernel_dir, "kernel.json"), "w") as f:
        json.dump(spec, f)
    monkeypatch.setenv("JUPYTER_PATH", specs)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)
    env = {
        "HOME": home,
        "IPYTHONDIR": os.path.join(home, ".ipython"),
        "MPLCONFIGDIR": os.path.join(home, ".mpl"),
        "XDG_RUNTIME_DIR": runtime,
        "JUPYTER_RUNTIME_DIR": runtime,
        "NBTRAIN_RUNTIME_DIR": os.path.join(runtime, "runs"),
        "NBTRAIN_TEMPLATE_DIR": os.path.join(runtime, "template"),
        "TMPDIR": home,
    }
    kernel = NotebookKernel(cwd=home, env={**env, **(extra or {})})
    kernel.home = home  # type: ignore[attr-defined]
    return kernel


def run_processes(kernel: NotebookKernel) -> list[int]:
    root = psutil.Process(kernel.pid)
    return [root.pid, *(child.pid for child in root.children(recursive=True))]


def targets(kernel: NotebookKernel, jupyters: list[listeners.Listener]) -> list[listeners.Listener]:
    """Every listening socket of the kernel's processes but the kernel's own from before nbtrain was loaded."""
    found = [found for pid in run_processes(kernel) for found in listeners.listeners_of(pid)]
    return [t for t in found if t not in jupyters]


def attack(kernel: NotebookKernel, jupyters: list[listeners.Listener], attacker) -> tuple[list[str], list[str]]:
    """(every socket tried, those the attacker reached), as labels."""
    tried = targets(kernel, jupyters)
    outcomes = listeners.attempts(osusers.as_user(attacker), tried)
    return [t.label() for t in tried], [f"{t.label()}: {outcome}" for t, outcome in outcomes if outcome == "reached"]


def attacked_run(people, monkeypatch, extra: dict[str, str] | None = None) -> tuple[list[str], ...]:
    """A victim's 2-rank CPU run attacked while it trains and while its standby ranks wait:
    (tried while training, reached then, tried while standby ranks wait, reached then)."""
    victim, attacker = people
    outward = outward_address()
    servers = [Greeter("127.0.0.1", "local service")] + ([Greeter(outward, "outside")] if outward else [])
    kernel = victim_kernel(victim, monkeypatch, extra)
    with kernel:
        assert kernel.value("__import__('os').getuid()") == victim.pw_uid
        jupyters = listeners.listeners_of(kernel.pid)  # Jupyter's and ipykernel's, before nbtrain is loaded
        kernel.run_ok("%load_ext nbtrain")
        marker = os.path.join(kernel.home, "stop")  # type: ignore[attr-defined]
        cell = TRAIN.format(servers=[s.address for s in servers], marker=marker)
        msg_id = kernel.start_cell(cell)
        kernel.wait_for_stream(msg_id, ["training"])
        tried_training, reached_training = attack(kernel, jupyters, attacker)
        with open(marker, "w"):
            pass
        _reply, out = kernel.wait_for_reply(msg_id, 180.0)
        assert out.error is None, out.text
        assert kernel.value("finished") is True
        assert kernel.value("reached") == [s.name for s in servers]
        assert kernel.value("grouped") == [2.0, [0, 1]]
        assert kernel.value("[big.numel(), big[-1].item()]") == [1 << 18, (1 << 18) - 1]
        _waited, ready = wait_for_standby(kernel, 120.0)
        assert ready, "no standby ranks were ready in time"
        tried_standby, reached_standby = attack(kernel, jupyters, attacker)
    for server in servers:
        server.close()
    print("tried while training:", tried_training, "\ntried while standby ranks wait:", tried_standby)
    print("reached while training:", reached_training, "\nreached while standby ranks wait:", reached_standby)
    assert tried_training and tried_standby, "found no socket to try: the search itself is broken"
    return tried_training, reached_training, tried_standby, reached_standby


def test_another_user_reaches_no_socket_of_a_run_and_the_rank_still_reaches_the_hosts_services(people, monkeypatch):
    from nbtrain.system import privatenet

    if privatenet.probe() is not None:
        # Only the OS refusing them skips: nbtrain failing to make them (a maker that dies) fails.
        assert privatenet.probe().startswith("this machine refuses"), privatenet.probe()
        pytest.skip(f"this machine cannot isolate a run's process group: {privatenet.probe()}")
    _tried, reached_training, _tried_standby, reached_standby = attacked_run(people, monkeypatch)
    assert reached_training == [], f"another user reached the run while it trained: {reached_training}"
    assert reached_standby == [], f"another user reached the standby ranks: {reached_standby}"


def test_without_a_private_network_only_gloos_listeners_stay_reachable_one_per_rank(people, monkeypatch):
    """The fallback (switched off here; the same where the OS refuses): the store is no port, gloo's listeners are."""
    _tried, reached_training, _tried_standby, reached_standby = attacked_run(
        people, monkeypatch, {"NBTRAIN_PRIVATE_NETWORK": "0"}
    )
    for reached in (reached_training, reached_standby):
        pids = {entry.split("(pid ")[1].split(")")[0] for entry in reached}
        assert len(reached) == 2 and len(pids) == 2, reached  # one listener in each rank, nothing else


# --- saying what stays reachable (nbtrain.system.sharedhost), namespaces refused at their one boundary ---

REFUSE_IN_THE_KERNEL = """
import errno
from nbtrain.system import privatenet, sharedhost
def _refuse():
    raise OSError(errno.EPERM, "unshare(CLONE_NEWUSER|CLONE_NEWNET): Operation not permitted")
privatenet.make_namespaces = _refuse
sharedhost.PASSWD = {passwd!r}
"""

TWO_RANKS = """%%distributed --devices 2 --accelerator cpu
import torch
total = torch.ones(1).sum().item()
"""

SAID = "this run's process-group sockets"


def passwd_with(tmp_path, people: int) -> str:
    path = tmp_path / "passwd"
    lines = ["root:x:0:0:root:/root:/bin/bash", "daemon:x:1:1::/usr/sbin:/usr/sbin/nologin"]
    lines += [f"user{n}:x:{1000 + n}:{1000 + n}::/home/user{n}:/bin/bash" for n in range(people)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_on_a_machine_of_several_people_the_first_run_says_once_what_stayed_reachable(tmp_path):
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain")
        kernel.run_ok(REFUSE_IN_THE_KERNEL.format(passwd=passwd_with(tmp_path, 3)))
        first = kernel.run_ok(TWO_RANKS)
        assert SAID in first.stderr, first.text
        assert "this machine has 3 user accounts" in first.stderr
        assert "refuses unprivileged user namespaces" in first.stderr
        assert "Ask the machine's administrator" in first.stderr
        second = kernel.run_ok(TWO_RANKS)
        assert SAID not in second.text  # once
        assert SAID not in kernel.run_ok("import nbtrain; nbtrain.runs()").text


def test_on_a_machine_of_ones_own_it_is_said_only_when_runs_are_asked(tmp_path):
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain")
        kernel.run_ok(REFUSE_IN_THE_KERNEL.format(passwd=passwd_with(tmp_path, 1)))
        assert SAID not in kernel.run_ok(TWO_RANKS).text
        asked = kernel.run_ok("import nbtrain; nbtrain.runs()")
        assert SAID in asked.stderr and "refuses unprivileged user namespaces" in asked.stderr, asked.text
        assert SAID not in kernel.run_ok("nbtrain.runs()").text


def test_people_are_accounts_with_a_login_shell_and_a_uid_of_a_person(tmp_path):
    from nbtrain.system import sharedhost

    assert sharedhost.human_accounts(passwd_with(tmp_path, 0)) == 0
    assert sharedhost.human_accounts(passwd_with(tmp_path, 2)) == 2
    assert sharedhost.human_accounts(str(tmp_path / "missing")) == 0
    switched_off = sharedhost.run_gap("cpu", "ddp", False, {"NBTRAIN_PRIVATE_NETWORK": "0"})
    assert switched_off == "NBTRAIN_PRIVATE_NETWORK=0 is set"
    assert "Unset NBTRAIN_PRIVATE_NETWORK=0" in sharedhost.sentence(switched_off, 2)
    assert "nccl backend" in (sharedhost.run_gap("cuda", "ddp", False, {}) or "")
    assert sharedhost.run_gap("cuda", "ddp", True, {}) is None  # a cluster's model is its own
