"""A rank's life (nbtrain.rank.machinery.runtime), piece by piece, without a launcher.

What changes process-wide state (the environment, the working directory, signal handlers)
runs in a child interpreter; the channel to the launcher is a real socket pair.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import linecache
import os
import socket
import subprocess
import sys
import textwrap
import threading
import traceback
from collections.abc import Iterator

import pytest

from nbtrain.messages import events, sharedtensors, stacktext, wire
from nbtrain.rank import api
from nbtrain.rank.machinery import runtime
from nbtrain.system import processes

CHILD_SECONDS = 120.0
SPEC = events.RankSpec(rank=1, local_rank=1, world_size=2, device_type="cpu", device_index=None)
START = events.StartRun(
    run_id=5,
    payload=b"",
    ranks=(events.RankSpec(0, 0, 2, "cpu", None), SPEC),
    start_method="fork",
    environ={"HOME": "/home/user", "OMP_NUM_THREADS": "3"},
    cwd="/",
    sys_path=("/opt/code",),
    source_lines={},
    timeout=None,
)


@pytest.fixture
def channel() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the rank's end, the launcher's end)."""
    rank_end, launcher_end = socket.socketpair()
    try:
        yield rank_end, launcher_end
    finally:
        rank_end.close()
        launcher_end.close()


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=CHILD_SECONDS,
        check=False,
    )


# --- the caller's state ------------------------------------------------------------------


def test_a_rank_on_one_machine_gets_torchruns_variables_on_loopback():
    variables = runtime._torchrun_variables(events.RankAssignment(START, SPEC, 29511, 100))
    assert {k: variables[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
    }
    assert (variables["MASTER_ADDR"], variables["MASTER_PORT"], variables["NBTRAIN_ROLE"]) == (
        "127.0.0.1",
        "29511",
        "rank",
    )
    assert variables["GLOO_SOCKET_IFNAME"] == variables["NCCL_SOCKET_IFNAME"] == runtime._loopback_interface()


def test_a_rank_on_a_cluster_node_gets_the_nodes_place_and_no_interface():
    node = events.NodePlace(node_rank=1, num_nodes=2, local_world_size=2, master_addr="10.0.0.7", master_port=29500)
    spec = dataclasses.replace(SPEC, rank=3, world_size=4)
    variables = runtime._torchrun_variables(
        events.RankAssignment(dataclasses.replace(START, node=node), spec, 29500, 100)
    )
    assert (variables["RANK"], variables["WORLD_SIZE"], variables["LOCAL_WORLD_SIZE"], variables["GROUP_RANK"]) == (
        "3",
        "4",
        "2",
        "1",
    )
    assert variables["MASTER_ADDR"] == "10.0.0.7" and "GLOO_SOCKET_IFNAME" not in variables  # the agent names it


def test_the_loopback_interface_is_the_one_flagged_loopback(tmp_path):
    for name, flags in (("eth0", "0x1003"), ("lo0", "0x9"), ("broken", "zz")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "flags").write_text(flags + "\n")
    assert runtime._loopback_interface(str(tmp_path)) == "lo0"
    assert runtime._loopback_interface(str(tmp_path / "absent")) == "lo"
    (tmp_path / "lo0" / "flags").write_text("0x1003\n")
    assert runtime._loopback_interface(str(tmp_path)) == "lo"  # none flagged: the usual name


def test_a_rank_adopts_the_callers_environment_directory_path_and_threads(tmp_path):
    result = run_python(
        f"""
        import dataclasses, os, sys, torch
        from nbtrain.messages import events
        from nbtrain.rank.machinery import runtime, settings
        start = events.StartRun(5, b"", (), "fork", {{"ONLY": "this", "OMP_NUM_THREADS": "1"}},
                                {str(tmp_path)!r}, ("/opt/code",) + tuple(sys.path), {{}}, None,
                                rank_settings=events.RankSettings(threads_per_rank=2))
        spec = events.RankSpec(0, 0, 1, "cpu", None)
        settings.adopt(start.rank_settings)  # as the rank's start does: its threads are read from its settings
        runtime._adopt_caller_state(events.RankAssignment(start, spec, 29600, 1))
        print(os.environ["ONLY"], "HOME" in os.environ, os.environ["OMP_NUM_THREADS"], torch.get_num_threads())
        print(os.getcwd() == {str(tmp_path)!r}, sys.path[0], os.environ["RANK"], os.environ["MASTER_PORT"])
        """
    )
    assert result.stdout.splitlines() == ["this False 2 2", "True /opt/code 0 29600"], result.stderr


def test_a_cells_source_lines_are_installed_for_tracebacks():
    filename = "<cell test_runtime 1>"
    runtime.install_source_lines({filename: ("x = 1\n", "raise ValueError(x)\n")})
    try:
        assert linecache.getline(filename, 2) == "raise ValueError(x)\n"
        with pytest.raises(ValueError) as caught:
            exec(compile("x = 1\nraise ValueError(x)\n", filename, "exec"), {})
        assert "raise ValueError(x)" in "".join(traceback.format_exception(caught.value))
    finally:
        linecache.cache.pop(filename, None)


# --- done, failed, released ----------------------------------------------------------------


def context(rank: int, channel_end: socket.socket) -> api.RankContext:
    return api.RankContext(5, rank, rank, 2, "cpu", None, send=lambda message: wire.send(channel_end, message))


def test_rank_0_sends_its_result_and_the_others_only_that_they_are_done(channel):
    rank_end, launcher_end = channel
    assert runtime._send_done(rank_end, context(1, rank_end), "ignored") is None
    assert wire.receive(launcher_end) == (events.RankDone(5, 1), [])
    sent = runtime._send_done(rank_end, context(0, rank_end), {"answer": 42})
    done, fds = wire.receive(launcher_end)
    assert fds == [] and isinstance(done, events.RankDone) and (done.run_id, done.rank) == (5, 0)
    assert sent is not None and sharedtensors.loads(done.result, None) == {"answer": 42}


def test_a_result_that_cannot_be_pickled_says_what_to_return(channel):
    rank_end, _ = channel
    with pytest.raises(
        TypeError,
        match=r"rank 0's return value \(a generator\) cannot be sent back to the kernel: .* Return plain data",
    ):
        runtime._send_done(rank_end, context(0, rank_end), (i for i in range(3)))


def user_code() -> None:
    def inner() -> None:
        raise KeyError("missing")

    inner()


def report_from_a_hidden_frame(channel_end: socket.socket) -> None:
    # As the runtime's own frames: the first frames of a rank's traceback, not the user's.
    __tracebackhide__ = True
    try:
        user_code()
    except KeyError as error:
        runtime._report_failure(channel_end, 5, 1, error)


def test_a_failure_is_reported_from_the_users_first_frame(channel):
    rank_end, launcher_end = channel
    report_from_a_hidden_frame(rank_end)
    failed, _ = wire.receive(launcher_end)
    assert isinstance(failed, events.RankFailed)
    assert (failed.run_id, failed.rank, failed.exc_type, failed.message) == (5, 1, "KeyError", "'missing'")
    lines = failed.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[1].endswith(", in user_code")
    assert "report_from_a_hidden_frame" not in failed.traceback and "in inner" in failed.traceback
    assert lines[-1] == "KeyError: 'missing'"


def test_a_failure_with_the_launcher_gone_is_dropped_silently(channel):
    rank_end, launcher_end = channel
    launcher_end.close()
    runtime._report_failure(rank_end, 5, 1, RuntimeError("x"))  # EPIPE: nobody is left to tell


def test_a_rank_waits_for_release_and_sends_its_result_as_a_file_when_asked(channel):
    rank_end, launcher_end = channel
    sent = runtime._send_done(rank_end, context(0, rank_end), torch_tensor())
    wire.receive(launcher_end)
    waiter = threading.Thread(target=runtime._wait_for_release, args=(rank_end, sent))
    waiter.start()
    try:
        wire.send(launcher_end, events.SendResultFile(5))
        done, fds = wire.receive(launcher_end)
        assert isinstance(done, events.RankDone) and done.has_tensor_file and len(fds) == 1
        tensor = sharedtensors.loads(done.result, fds[0])
        os.close(fds[0])
        assert tensor.tolist() == [1.0, 2.0, 3.0]
        wire.send(launcher_end, events.Release(5))
    finally:
        waiter.join(CHILD_SECONDS)
    assert not waiter.is_alive()


def torch_tensor() -> object:
    import torch

    return torch.tensor([1.0, 2.0, 3.0])


def test_a_closed_channel_ends_the_wait_for_release(channel):
    rank_end, launcher_end = channel
    launcher_end.close()
    runtime._wait_for_release(rank_end, None)  # returns: the launcher is gone


# --- torchrun-style code and stack dumps ----------------------------------------------------


def test_code_written_for_torchrun_may_init_and_destroy_the_group_again():
    calls: list[tuple[str, object]] = []
    init = runtime.harmless_init(lambda *a, **k: calls.append(("init", a)))
    destroy = runtime.harmless_destroy(lambda group=None: calls.append(("destroy", group)))
    init("gloo")  # this process has no group: torch's own init runs
    destroy()
    destroy("a subgroup")
    assert calls == [("init", ("gloo",)), ("destroy", "a subgroup")]  # only a subgroup is really destroyed


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    try:
        yield read_end, write_end
    finally:
        faulthandler.unregister(stacktext.DUMP_SIGNAL)  # what register_stack_dump set, if anything
        os.close(read_end)
        os.close(write_end)


def test_a_registered_rank_dumps_its_stack_to_the_launchers_pipe(pipe):
    read_end, write_end = pipe
    runtime.register_stack_dump(write_end, {})
    assert processes.catches(os.getpid(), stacktext.DUMP_SIGNAL)
    os.kill(os.getpid(), stacktext.DUMP_SIGNAL)  # a signal to itself is handled before kill returns
    os.set_blocking(read_end, False)
    dump = os.read(read_end, 1 << 16).decode()
    assert "test_a_registered_rank_dumps_its_stack_to_the_launchers_pipe" in dump  # all threads, this one too


@pytest.mark.parametrize("environ", [{stacktext.DISABLE_VARIABLE: "0"}, None], ids=["turned off", "no pipe"])
def test_no_stack_dump_is_registered_when_turned_off_or_without_a_pipe(pipe, environ):
    runtime.register_stack_dump(None if environ is None else pipe[1], environ or {})
    assert not processes.catches(os.getpid(), stacktext.DUMP_SIGNAL)
