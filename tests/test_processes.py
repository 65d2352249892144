"""Processes, /proc and signals (nbtrain.system.processes), on real child processes.

Each test starts the processes it needs and kills them by pid when it ends. Anything that
would act on this test process's own children (kill_strays) runs in a child interpreter.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from helpers import procs
from nbtrain.system import processes

GONE_SECONDS = 10.0
CHILD_SECONDS = 60.0
PR_SET_NAME = 15


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    """Popen objects a test adds to; each is killed and reaped at the end."""
    children: list[subprocess.Popen] = []
    yield children
    for child in children:
        if child.poll() is None:  # never a pid already reaped: it may be another process's now
            child.kill()
            child.wait(GONE_SECONDS)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def sleeper(started: list[subprocess.Popen], *, session: bool = False, name: bytes | None = None) -> subprocess.Popen:
    """A child that waits on stdin until the test kills it (its comm set to ``name``)."""
    code = "import sys\n"
    if name is not None:
        code += f"import ctypes; ctypes.CDLL(None).prctl({PR_SET_NAME}, {name!r}, 0, 0, 0)\n"
    code += "print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=session
    )
    started.append(child)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=CHILD_SECONDS,
        check=False,
    )


# --- /proc -------------------------------------------------------------------------------


def test_children_lists_this_process_children_and_descendants_go_all_the_way_down(started):
    parent = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True)
    started.append(parent)
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    try:
        assert parent.pid in processes.children()
        assert processes.children(parent.pid) == [grandchild]
        below = processes.descendants(os.getpid())  # children first, then theirs (and other tests' leftovers)
        assert below.index(parent.pid) < below.index(grandchild)
        assert processes.descendants(grandchild) == []
    finally:
        procs.kill_pids([grandchild])


def test_children_of_a_process_that_is_gone_is_empty():
    gone = subprocess.Popen(["true"])
    gone.wait(GONE_SECONDS)
    assert processes.children(gone.pid) == [] and processes.descendants(gone.pid) == []


def test_the_start_time_tells_a_process_from_a_later_one_with_the_same_pid(started):
    child = sleeper(started)
    mine = processes.start_time(os.getpid())
    theirs = processes.start_time(child.pid)
    assert mine is not None and theirs is not None and theirs >= mine
    assert processes.start_time(child.pid) == theirs  # stable while it lives
    child.kill()
    procs.wait_for(lambda: processes.start_time(child.pid) is None, GONE_SECONDS, "a zombie has no start time")
    child.wait(GONE_SECONDS)
    assert processes.start_time(child.pid) is None


def test_proc_stat_is_read_past_a_command_name_with_spaces_and_parentheses(started):
    child = sleeper(started, session=True, name=b"x) (y z")
    with open(f"/proc/{child.pid}/stat", "rb") as f:
        assert b"(x) (y z)" in f.read()
    assert processes.start_time(child.pid) is not None
    assert processes.process_groups()[child.pid] == [child.pid]  # it leads its own group


def test_process_groups_holds_every_process_of_a_group(started):
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True)
    started.append(leader)
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    try:
        assert sorted(processes.process_groups()[leader.pid]) == sorted([leader.pid, member])
        assert os.getpid() in processes.process_groups()[os.getpgid(0)]
    finally:
        procs.kill_pids([member])


def test_resident_bytes_is_a_live_process_memory_and_none_once_it_is_gone(started):
    child = sleeper(started)
    resident = processes.resident_bytes(child.pid)
    assert resident is not None and 1 << 20 < resident < 1 << 31  # an interpreter: megabytes
    child.kill()
    child.wait(GONE_SECONDS)
    assert processes.resident_bytes(child.pid) is None


def test_thread_count_counts_os_threads():
    before = processes.thread_count()
    assert before >= threading.active_count()
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(GONE_SECONDS,))
    thread.start()
    try:
        assert processes.thread_count() == before + 1
    finally:
        release.set()
        thread.join(GONE_SECONDS)


# --- reaping ------------------------------------------------------------------------------


def test_reap_gives_the_exit_code_or_the_signal_of_a_finished_child(started):
    exited = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    started.append(exited)
    killed = sleeper(started)
    running = sleeper(started)
    killed.send_signal(signal.SIGTERM)
    assert procs.wait_for(lambda: processes.reap(exited.pid), GONE_SECONDS, "exit 3") == (3, None)
    assert procs.wait_for(lambda: processes.reap(killed.pid), GONE_SECONDS, "SIGTERM") == (None, signal.SIGTERM)
    assert processes.reap(running.pid) is None
    assert processes.reap(exited.pid) == (None, None)  # reaped already: no longer a child


def test_reap_now_leaves_no_zombie(started):
    child = sleeper(started)
    child.kill()
    processes.reap_now(child.pid, timeout=GONE_SECONDS)
    assert not procs.alive(child.pid)


# --- signals ------------------------------------------------------------------------------


def test_signal_ranks_signals_only_a_group_leader_whose_start_time_still_matches(started):
    rank = sleeper(started, session=True)
    not_a_leader = sleeper(started)  # in the test's own process group
    started_at = processes.start_time(rank.pid)
    assert started_at is not None
    assert processes.signal_ranks([(rank.pid, started_at + 1)], signal.SIGTERM) == []  # a reused pid
    other_started = processes.start_time(not_a_leader.pid)
    assert other_started is not None
    assert processes.signal_ranks([(not_a_leader.pid, other_started)], signal.SIGTERM) == []
    assert rank.poll() is None and not_a_leader.poll() is None
    assert processes.signal_ranks([(rank.pid, started_at)], signal.SIGTERM) == [rank.pid]
    assert rank.wait(GONE_SECONDS) == -signal.SIGTERM


def test_signal_ranks_skips_a_process_that_is_gone():
    gone = subprocess.Popen(["true"])
    gone.wait(GONE_SECONDS)
    assert processes.signal_ranks([(gone.pid, 1)], signal.SIGKILL) == []
    processes.signal_group(gone.pid, signal.SIGKILL)  # a group already gone is fine


def test_signal_group_reaches_every_process_of_the_group(started):
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True)
    started.append(leader)
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    processes.signal_group(leader.pid, signal.SIGKILL)
    assert leader.wait(GONE_SECONDS) == -signal.SIGKILL
    assert procs.wait_gone([member], GONE_SECONDS, reaped=False) == []


def test_catches_reads_the_signal_mask_of_a_process(started):
    child = sleeper(started)  # Python catches SIGINT (KeyboardInterrupt), not SIGUSR2
    assert processes.catches(child.pid, signal.SIGINT)
    assert not processes.catches(child.pid, signal.SIGUSR2)
    assert not processes.request_stack(child.pid)  # it registered no stack dump: not asked
    assert child.poll() is None
    child.kill()
    child.wait(GONE_SECONDS)
    assert not processes.catches(child.pid, signal.SIGINT)


def test_interrupts_held_turns_sigint_into_a_flag_and_restores_the_handler():
    before = signal.getsignal(signal.SIGINT)
    with processes.interrupts_held() as held:
        assert not held.received
        with processes.interrupts_held() as inner:  # the outermost section acts
            signal.raise_signal(signal.SIGINT)
        assert held.received and not inner.received
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)  # the handler is back


def test_interrupts_held_in_another_thread_holds_nothing():
    seen: list[bool] = []

    def hold() -> None:
        with processes.interrupts_held() as held:
            seen.append(signal.getsignal(signal.SIGINT) is before and not held.received)

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=hold)
    thread.start()
    thread.join(GONE_SECONDS)
    assert seen == [True]


def test_ignore_interrupts_leaves_sigint_and_the_dump_signal_without_effect():
    result = run_python(
        """
        import os, signal
        from nbtrain.system import processes
        from nbtrain.messages import stacktext
        processes.ignore_interrupts()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), stacktext.DUMP_SIGNAL)
        print("still here", processes.catches(os.getpid(), signal.SIGINT))
        """
    )
    assert (result.returncode, result.stdout) == (0, "still here False\n")


# --- process lifetime ---------------------------------------------------------------------


def test_kill_strays_kills_unknown_children_and_their_descendants_but_keeps_the_rest():
    result = run_python(
        """
        import os, subprocess, time
        from nbtrain.system import processes
        keep = subprocess.Popen(["sleep", "300"])
        stray = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE)
        below = int(stray.stdout.readline())
        first = sorted(processes.kill_strays({keep.pid})) == sorted([stray.pid, below])
        # As the launcher does: call again until nothing is left (a stray killed a moment
        # ago may not be a zombie yet, and is reaped by a later pass).
        deadline = time.monotonic() + 10
        while processes.kill_strays({keep.pid}) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(first, os.path.exists(f"/proc/{stray.pid}"), processes.children() == [keep.pid])
        keep.kill()
        """
    )
    assert result.stdout == "True False True\n", result.stderr


def test_die_with_parent_kills_a_child_when_its_parent_exits():
    result = run_python(
        """
        import os, time
        from nbtrain.system import processes
        parent = os.getpid()
        child = os.fork()
        if child == 0:
            processes.die_with_parent(parent)
            time.sleep(300)
            os._exit(0)
        print(child, flush=True)
        """
    )
    orphan = int(result.stdout)
    left = procs.wait_gone([orphan], GONE_SECONDS, reaped=False)
    procs.kill_pids(left)
    assert left == [], "the child outlived its parent"


def test_exit_now_flushes_output_and_skips_interpreter_teardown():
    result = run_python(
        """
        import atexit, sys
        from nbtrain.system import processes
        atexit.register(lambda: print("teardown ran"))
        sys.stdout.write("written, not yet flushed")
        processes.exit_now(5)
        """
    )
    assert (result.returncode, result.stdout) == (5, "written, not yet flushed")


def test_remove_torch_shared_memory_removes_only_dead_creators_entries(tmp_path, started):
    dead = subprocess.Popen(["true"])
    dead.wait(GONE_SECONDS)
    live = sleeper(started)
    names = [f"torch_{dead.pid}_123_0", f"torch_{live.pid}_456_0", f"torch_{dead.pid}0_7_0", "nbtrain-abc"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    processes.remove_torch_shared_memory([dead.pid, live.pid], directory=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    processes.remove_torch_shared_memory([dead.pid], directory=str(tmp_path / "absent"))  # no such directory: fine


# --- reading another process's memory -----------------------------------------------------


def test_read_memory_copies_bytes_from_a_process():
    source = ctypes.create_string_buffer(b"rank 0's tensor bytes" * 1000)
    target = ctypes.create_string_buffer(len(source))
    processes.read_memory(os.getpid(), ctypes.addressof(target), ctypes.addressof(source), len(source))
    assert target.raw == source.raw


def test_read_memory_of_a_gone_process_or_an_unmapped_address_raises_oserror():
    target = ctypes.create_string_buffer(8)
    gone = subprocess.Popen(["true"])
    gone.wait(GONE_SECONDS)
    with pytest.raises(OSError) as caught:
        processes.read_memory(gone.pid, ctypes.addressof(target), ctypes.addressof(target), 8)
    assert caught.value.errno == errno.ESRCH and f"cannot read the memory of process {gone.pid}" in str(caught.value)
    with pytest.raises(OSError) as caught:
        processes.read_memory(os.getpid(), ctypes.addressof(target), 8, 8)  # page 0 is never mapped
    assert caught.value.errno == errno.EFAULT


def test_a_launcher_seen_ending_by_two_threads_at_once_closes_its_pidfd_once(monkeypatch):
    """The kernel's watcher and its exit both ask whether the launcher lives (``ForkedLauncher._alive``).

    Here the second asker runs while the first is between its select and its close, as a thread
    switch would have it: the first used to close a descriptor the second had already closed.
    """
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        launcher = processes.ForkedLauncher(lambda _timeout: (True, pid, ""), stderr=None)  # type: ignore[arg-type]
        real_select = processes.select.select
        interleaved: list[bool] = []

        def select_then_the_other_thread(*args: object) -> object:
            ready = real_select(*args)
            if not interleaved:
                interleaved.append(False)
                interleaved[0] = launcher.poll() is not None  # the other asker: sees the end, closes
            return ready

        monkeypatch.setattr(processes.select, "select", select_then_the_other_thread)
        assert launcher.wait(timeout=10.0) == processes.UNKNOWN_EXIT
        assert interleaved == [True] and launcher.poll() is not None
    finally:
        os.waitpid(pid, 0)


def test_a_forked_rank_keeps_what_a_step_frees_instead_of_mapping_it_afresh():
    """A 30 MiB block (a step's batch or activations) comes from the rank's heap, and once freed
    stays there for the next step, as in a kernel whose malloc settled long ago."""
    read_end, write_end = os.pipe()

    def rank() -> None:
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        block = libc.malloc(30 << 20)
        heap_before = _heap_bytes()
        in_heap = _in_heap(block)
        libc.free(block)
        kept = _heap_bytes() >= heap_before
        os.write(write_end, f"{in_heap} {kept}".encode())

    pid = processes.fork_rank(rank)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as said:
            assert said.read() == "True True"
    finally:
        os.waitpid(pid, 0)


def _heap_ranges() -> list[tuple[int, int]]:
    with open("/proc/self/maps") as maps:
        heaps = [line.split()[0] for line in maps if line.rstrip().endswith("[heap]")]
    return [(int(low, 16), int(high, 16)) for low, high in (span.split("-") for span in heaps)]


def _heap_bytes() -> int:
    return sum(high - low for low, high in _heap_ranges())


def _in_heap(address: int) -> bool:
    return any(low <= address < high for low, high in _heap_ranges())


# A process that started a spawned child and a queue (named semaphores), then leaves as a rank does.
LEAVES_WITH_A_SPAWNED_CHILD = """
import multiprocessing, os, time
from nbtrain.system import processes
if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    print(child.pid, flush=True)
    processes.end_multiprocessing(5.0)
    os._exit(0)
"""


def test_leaving_as_a_rank_ends_multiprocessing_children_and_unlinks_their_semaphores(tmp_path):
    before = procs.shm_entries()
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES_WITH_A_SPAWNED_CHILD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    child = int(done.stdout.split()[0])
    assert procs.wait_gone([child], 5.0, reaped=False) == []
    assert {name for name in procs.shm_entries() - before if name.startswith("sem.")} == set()
