"""Resources: repeated launches leak nothing; big results and big inputs travel in shared memory."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import nbtrain
from helpers import procs
from helpers.procs import collect, finish
from nbtrain.kernel import launcher_connection
from nbtrain.messages import events

HELPERS = Path(__file__).parent / "helpers"
GIB = 1 << 30


SETTLE_SECONDS = 10.0


def test_twenty_launches_in_a_row_leak_nothing(launcher):
    """Processes, threads, descriptors and /dev/shm entries stay flat over 20 launches.

    Successes with tensor results (a memfd to the ranks, a read of rank 0's memory back) and
    failures (stopped ranks) alternate.
    """

    def run_once(i: int) -> None:
        if i % 4 == 3:
            def fails():
                if nbtrain.rank() == 1:
                    raise RuntimeError(f"launch {i} fails on purpose")
                import torch.distributed as dist

                dist.barrier()

            _, error, _ = collect(nbtrain.start(fails, devices=2))
            assert isinstance(error, nbtrain.RankError), error
        else:
            weights = torch.full((1000,), float(i))
            result = finish(nbtrain.start(lambda w: {"w": w * 2, "rank": nbtrain.rank()}, (weights,), devices=2))
            assert result["rank"] == 0 and torch.equal(result["w"], weights * 2)

    def settled_snapshot() -> procs.Snapshot:
        # The launcher finishes a run's bookkeeping just after sending RunEnded; a last run
        # without a result makes sure that happened before we count.
        assert finish(nbtrain.start(lambda: None, devices=2)) is None
        nbtrain.release()  # the next run's standby ranks, shown and held on purpose: ended and reaped
        gc.collect()  # objects of earlier tests (a Popen's pipes, say) close their fds now, not mid-count
        # A rank the launcher just ended can be its zombie for a moment (reaped on its next turn):
        # a leak is a child that stays, so wait (bounded) for none before counting.
        procs.wait_for(lambda: not procs.launcher_children(), SETTLE_SECONDS, "the launcher kept a child process")
        return procs.snapshot()

    run_once(0)  # warm: the first launch may create lazily-made objects once
    before = settled_snapshot()
    for i in range(1, 21):
        run_once(i)
    after = settled_snapshot()

    assert after.launcher_children == before.launcher_children == 0
    assert after.threads <= before.threads, "threads of the test process grew"
    assert after.fds <= before.fds, f"open descriptors of the test process grew: {procs.fd_targets()}"
    assert after.shm == before.shm, "/dev/shm entries appeared"
    assert after.launcher_fds == before.launcher_fds, "open descriptors of the launcher grew"


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["read", "file"])
def test_a_300_mb_state_dict_comes_back_equal_without_dev_shm(launcher, leak_guard, monkeypatch, transfer):
    """Read out of rank 0's memory (the default), or sent in a memfd (where reading is forbidden)."""
    if transfer == "file":
        monkeypatch.setenv(launcher_connection.RESULT_TRANSFER_VARIABLE, "file")
    shapes = {
        "embed.weight": (50_000, 512), "proj.weight": (4096, 4096), "proj.bias": (4096,), "head.weight": (16_384, 2048)
    }

    def make():
        generator = torch.Generator().manual_seed(7)
        state = {}
        for index, (name, shape) in enumerate(shapes.items()):
            numel = 1
            for size in shape:
                numel *= size
            # arange catches any misplaced byte; the random head catches misplaced blocks
            state[name] = torch.arange(numel, dtype=torch.float32).reshape(shape).mul_(index + 1)
            state[name][:16] = torch.randn(state[name][:16].shape, generator=generator)
        state["tied.weight"] = state["embed.weight"]  # one storage, two names
        state["step"] = torch.tensor(1234, dtype=torch.int64)
        return state

    shm_before = procs.shm_entries()
    result = finish(nbtrain.start(make, devices=2))
    assert procs.shm_entries() == shm_before

    expected = make()
    total = sum(t.numel() * t.element_size() for n, t in expected.items() if n != "tied.weight")
    assert total > 300e6
    assert result.keys() == expected.keys()
    for name, tensor in expected.items():
        assert result[name].dtype == tensor.dtype and torch.equal(result[name], tensor), name
    assert result["tied.weight"].data_ptr() == result["embed.weight"].data_ptr()


def test_a_result_nobody_waits_for_does_not_hold_rank_zero(launcher, leak_guard):
    """Rank 0 keeps its result's tensors until the kernel copied them; the kernel copies at
    once, not when someone calls wait(), so a started run's ranks all leave by themselves."""
    run = nbtrain.start(lambda: {"w": torch.arange(16 << 20, dtype=torch.float32)}, devices=2)
    deadline = time.monotonic() + procs.RUN_TIMEOUT
    for event in run.events():  # only as far as both ranks' pids
        if len(run.pids) == 2 or isinstance(event, events.RunEnded) or time.monotonic() > deadline:
            break
    assert len(run.pids) == 2, "the ranks did not start"
    still_alive = procs.wait_gone(run.pids.values(), timeout=procs.RUN_TIMEOUT)
    assert not still_alive, "ranks still alive, waiting for someone to take the result"
    result = finish(run)
    assert torch.equal(result["w"], torch.arange(16 << 20, dtype=torch.float32))
    result["w"][0] = -1.0  # the kernel's own, writable memory
    assert result["w"][0] == -1.0


@pytest.mark.slow
def test_closing_over_1_gb_keeps_four_ranks_under_2_5_gb(leak_guard, tmp_path):
    """The caller, the launcher and 4 ranks share one copy of a 1 GB input: total PSS < 2.5 GB."""
    release = tmp_path / "release"
    proc = subprocess.Popen(
        [sys.executable, str(HELPERS / "memory_caller.py"), str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pids: dict = {"caller": proc.pid, "launcher": None, "ranks": []}
    try:
        pids = procs.read_json_line(proc, timeout=180)
        everyone = [pids["caller"], pids["launcher"], *pids["ranks"]]
        assert len(pids["ranks"]) == 4
        pss = {pid: procs.pss_bytes(pid) for pid in everyone}  # the ranks are alive: they wait for us
        release.touch()
        out, err = procs.rest_of_output(proc, timeout=120)
        assert proc.returncode == 0, (out, err)
        assert f"SUM {256 * 1024 * 1024:.1f}" in out, (out, err)
        total = sum(pss.values())
        breakdown = {pid: f"{value / 2**20:.0f} MiB" for pid, value in pss.items()}
        assert total < 2.5 * GIB, f"total PSS {total / GIB:.2f} GiB: {breakdown}"
    finally:
        release.touch()
        procs.cleanup_caller(proc, [pids["launcher"], *pids["ranks"]])


def test_closing_a_client_lets_its_launcher_exit_by_itself(launcher):
    """Closing the channel ends the launcher cleanly (exit code 0), not by the kill after the grace."""
    threads_before = procs.thread_count()
    fds_before = procs.fd_count()
    client = launcher_connection.LauncherClient()  # a second launcher, beside the session's
    try:
        assert client.ready.wait(120), client.exit_detail()
        started = time.monotonic()
        client.close()
        elapsed = time.monotonic() - started
        assert client.process.popen.returncode == 0, "the launcher had to be killed"
        assert elapsed < 2.0, elapsed  # stop_launcher's grace before it kills
    finally:
        if client.process.popen.poll() is None:
            client.process.popen.kill()
            client.process.popen.wait(timeout=10)
    deadline = time.monotonic() + 10
    while procs.thread_count() > threads_before and time.monotonic() < deadline:
        time.sleep(procs.POLL)  # bounded: the client's reader threads end at EOF
    assert procs.thread_count() == threads_before
    assert procs.fd_count() == fds_before
