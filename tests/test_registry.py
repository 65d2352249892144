"""The run registry as the launcher keeps it, and a stop that goes around the kernel.

Real launcher, real ranks: a run's record appears with its ranks' pids and start times,
rank 0's step and loss, and is rewritten at most about once a second while rank 0 logs
every 20 ms; the server extension's stop (nbtrain.serverext.runs.stop, which
signals the ranks itself) ends the run as stopped, exactly as the kernel's own stop does.
"""

from __future__ import annotations

import itertools
import os
import signal
import stat
import time

import pytest

from helpers import procs
from nbtrain.errors import RunStoppedError
from nbtrain.kernel import client as kernel_client
from nbtrain.messages import events
from nbtrain.serverext import runs
from nbtrain.system import processes, registry

RECORD_SECONDS = 30.0  # a record appears once every rank is forked
ENDED_SECONDS = 30.0


def _train_until_stopped() -> None:
    import time

    import nbtrain

    for step in range(100_000):
        nbtrain.log(loss=1.0 / (step + 1))
        time.sleep(0.02)


def _newest_record(since: float) -> registry.RunRecord | None:
    """This process's newest run in the registry started after ``since``."""
    mine = [r for r in registry.read_all() if r.kernel_pid == os.getpid() and r.started >= since]
    return mine[-1] if mine else None


def test_a_run_is_recorded_and_a_stop_from_outside_ends_it_as_stopped(launcher) -> None:
    since = time.time()
    run = kernel_client.start(_train_until_stopped, devices=2, accelerator="cpu")
    try:
        record = procs.wait_for(
            lambda: (r := _newest_record(since)) is not None and r.step is not None and r.losses and r,
            RECORD_SECONDS,
            "the run's record with rank 0's step and loss",
        )
        assert stat.S_IMODE(os.stat(registry.runs_directory()).st_mode) == 0o700
        assert record.world_size == 2 and record.state == "running" and record.strategy == "ddp_notebook"
        assert record.accelerator == "cpu" and record.kernel_pid == os.getpid()
        assert [rank for rank, _, _ in record.ranks] == [0, 1]
        for _, pid, started in record.ranks:
            assert processes.start_time(pid) == started
        assert runs.shown_state(record) == "running"
        gaps = _rewrite_gaps(record.id, writes=4, timeout=RECORD_SECONDS)
        assert min(gaps) >= 0.9, f"the record was rewritten {min(gaps):.3f} s after its previous write: {gaps}"

        outcome = runs.stop(record.id)
        assert sorted(outcome.signalled) == sorted(record.pids), outcome
        with pytest.raises(RunStoppedError, match="stopped before it finished") as stopped:
            procs.finish(run, ENDED_SECONDS)
        # The server signalled every rank as it asked: no rank is said to have "not answered".
        assert "Where each rank was" not in str(stopped.value), str(stopped.value)
    finally:
        run.stop()
    assert procs.wait_gone(record.pids, 10.0, reaped=False) == []
    ended = registry.read(record.id)
    assert ended is not None and ended.state == "stopped" and ended.ended is not None
    assert not registry.stop_requested(record.id), "the launcher removes the stop request once the run ended"


def _train_ignoring_sigterm() -> None:
    import signal
    import time

    import nbtrain

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # user code that will not stop politely
    for step in range(100_000):
        nbtrain.log(loss=1.0 / (step + 1))
        time.sleep(0.02)


def test_ranks_the_server_kills_after_its_stop_count_as_stopped_not_as_deaths(launcher) -> None:
    since = time.time()
    run = kernel_client.start(_train_ignoring_sigterm, devices=2, accelerator="cpu")
    try:
        record = procs.wait_for(
            lambda: (r := _newest_record(since)) is not None and r.step is not None and r,
            RECORD_SECONDS,
            "the run's record with rank 0's step",
        )
        runs.stop(record.id)  # SIGTERM, which these ranks ignore
        runs.kill_rest(record.id)  # what the server extension sends after its grace period
        _, error, seen = procs.collect(run, ENDED_SECONDS)
    finally:
        run.stop()
    assert isinstance(error, RunStoppedError), error
    exits = [e for e in seen if isinstance(e, events.RankExited)]
    assert sorted(e.rank for e in exits) == [0, 1], exits
    assert all(e.signal_number == signal.SIGKILL and e.stopped for e in exits), exits
    assert procs.wait_gone(record.pids, 10.0, reaped=False) == []


def _rewrite_gaps(run_id: str, writes: int, timeout: float) -> list[float]:
    """Seconds between successive writes of a running run's record, as seen by polling its
    ``updated`` time until ``writes`` writes were seen (a poll may miss a write: a gap seen
    is never shorter than the real one)."""
    seen: list[float] = []
    deadline = time.monotonic() + timeout
    while len(seen) < writes and time.monotonic() < deadline:
        current = registry.read(run_id)
        if current is not None and (not seen or current.updated != seen[-1]):
            seen.append(current.updated)
        time.sleep(0.01)  # the poll interval, bounded by the deadline above
    assert len(seen) == writes, f"{len(seen)} writes of the record in {timeout} s while rank 0 logs every 20 ms"
    return [later - earlier for earlier, later in itertools.pairwise(seen)]


def test_signal_ranks_refuses_a_pid_whose_start_time_differs() -> None:
    import subprocess

    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = processes.start_time(other.pid)
        assert started is not None
        assert processes.signal_ranks([(other.pid, started + 1)], 15) == []
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=0.5)  # not signalled: still running
        assert processes.signal_ranks([(other.pid, started)], 15) == [other.pid]
        assert other.wait(timeout=10) == -15
    finally:
        other.kill()
        other.wait()


def test_a_record_survives_a_round_trip_and_ids_cannot_climb_out(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(registry.DIRECTORY_VARIABLE, str(tmp_path / "reg"))
    record = registry.RunRecord(
        id="ab12-3", world_size=2, state="running", ranks=((0, 10, 99), (1, 11, 98)), losses=(1.0, 0.5)
    )
    registry.write(record)
    assert registry.read("ab12-3") == record
    assert registry.read("../ab12-3") is None
    registry.request_stop("../../x")
    assert os.listdir(tmp_path / "reg") == ["ab12-3.json"]
    os.chmod(tmp_path / "reg", 0o755)
    with pytest.raises(registry.RegistryError, match="chmod 700"):
        registry.runs_directory()
