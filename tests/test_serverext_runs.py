"""The run registry as the server extension shows and acts on it (nbtrain.serverext.runs), without tornado.

The records name real processes this test starts (``sleep`` in a session of its own, as a
rank leads its own process group); a kernel or launcher that is gone is a real process that
has ended. The HTTP routes over these functions are tested in tests/test_serverext_handlers.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from nbtrain.serverext import runs
from nbtrain.system import processes, registry

GONE_SECONDS = 10.0


@pytest.fixture(autouse=True)
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.DIRECTORY_VARIABLE, str(tmp_path / "registry"))
    return tmp_path / "registry"


@pytest.fixture
def stand_ins():
    """Processes standing in for ranks: killed and reaped by pid at the end."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        process = subprocess.Popen(["sleep", "120"], start_new_session=True)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def _alive(pid: int) -> tuple[int, int | None]:
    return pid, processes.start_time(pid)


def _gone() -> tuple[int, int]:
    """A process that has ended: its pid and the start time it had."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    started = processes.start_time(process.pid)
    process.wait(timeout=GONE_SECONDS)
    return process.pid, started or 1


def _record(run_id: str, ranks: list[subprocess.Popen], launcher=None, kernel=None, **fields) -> registry.RunRecord:
    kernel_pid, kernel_start = kernel or _alive(os.getpid())
    launcher_pid, launcher_start = launcher or _alive(os.getpid())
    record = registry.RunRecord(
        id=run_id,
        world_size=len(ranks),
        ranks=tuple((rank, p.pid, processes.start_time(p.pid) or 0) for rank, p in enumerate(ranks)),
        kernel_pid=kernel_pid,
        kernel_start=kernel_start,
        launcher_pid=launcher_pid,
        launcher_start=launcher_start,
        **{"state": "running", "started": 100.0, **fields},
    )
    registry.write(record)
    return record


def test_a_runs_json_says_its_shown_state_live_ranks_path_and_elapsed_time(stand_ins, tmp_path):
    ranks = [stand_ins(), stand_ins()]
    record = _record("rn-1", ranks, notebook=str(tmp_path / "sub" / "a.ipynb"))
    ranks[0].kill()
    ranks[0].wait()
    shown = runs.run_json(record, now=160.0, root=str(tmp_path))
    assert shown["state"] == shown["recorded_state"] == "running" and shown["path"] == "sub/a.ipynb"
    assert shown["pids"] == [ranks[0].pid, ranks[1].pid] and shown["live_pids"] == [ranks[1].pid]
    assert shown["elapsed"] == 60.0
    ended = runs.run_json(_record("rn-2", [], state="finished", ended=130.0), now=1000.0)
    assert ended["elapsed"] == 30.0 and ended["path"] is None


def test_an_active_run_whose_kernel_or_launcher_is_gone_is_orphaned(stand_ins):
    assert runs.shown_state(_record("rn-3", [stand_ins()], kernel=_gone())) == runs.ORPHANED
    assert runs.shown_state(_record("rn-4", [stand_ins()], launcher=_gone())) == runs.ORPHANED
    assert runs.shown_state(_record("rn-5", [], launcher=_gone(), state="failed")) == "failed"  # ended: as recorded


def test_listing_forgets_ended_runs_whose_launcher_is_gone_and_keeps_the_rest(stand_ins):
    _record("rn-6", [], launcher=_gone(), state="finished", started=1.0)
    _record("rn-7", [], state="finished", started=2.0)  # its launcher lives: it may still show the run
    _record("rn-8", [stand_ins()], launcher=_gone(), started=3.0)  # active: shown as orphaned until cleaned
    assert [(run["id"], run["state"]) for run in runs.list_runs()] == [("rn-7", "finished"), ("rn-8", "orphaned")]
    assert registry.read("rn-6") is None


def test_stop_signals_the_ranks_and_kill_rest_ends_what_stays(stand_ins):
    ranks = [stand_ins(), stand_ins()]
    _record("rn-9", ranks)
    outcome = runs.stop("rn-9", signal.SIGSTOP)  # a rank that ignores SIGTERM stays: stopped here
    assert sorted(outcome.signalled) == sorted(p.pid for p in ranks) and registry.stop_requested("rn-9")
    assert "sent SIGSTOP to rank processes" in outcome.message
    assert [p.poll() for p in ranks] == [None, None]
    rest = runs.kill_rest("rn-9")
    assert rest is not None and sorted(rest.signalled) == sorted(p.pid for p in ranks)
    assert [p.wait(timeout=GONE_SECONDS) for p in ranks] == [-9, -9]
    assert runs.kill_rest("no-such-1") is None


def test_stopping_an_ended_run_signals_nothing_and_an_unknown_one_says_what_to_do(stand_ins):
    rank = stand_ins()
    _record("rn-10", [rank], state="finished")
    outcome = runs.stop("rn-10")
    assert outcome.signalled == () and "already ended (finished); nothing to stop" in outcome.message
    assert rank.poll() is None
    with pytest.raises(runs.RunNotFound, match="has no run 'rn-404'.*Refresh the list of runs"):
        runs.stop("rn-404")


def test_a_stop_at_a_step_is_left_to_a_live_launcher_until_it_is_late(stand_ins):
    rank = stand_ins()
    _record("rn-11", [rank], stop_at_step=True)
    outcome = runs.stop("rn-11")
    assert outcome.signalled == () and "stop every rank at the last optimizer step" in outcome.message
    assert registry.stop_requested("rn-11") and rank.poll() is None
    _record("rn-11", [rank], stop_at_step=True, state="stopping")  # the launcher took it up, no step chosen yet
    assert runs.follow_up("rn-11") == runs.ANSWER_SECONDS
    _record("rn-11", [rank], stop_at_step=True, state="stopping", stop_deadline=1000.0)
    assert runs.follow_up("rn-11", now=1001.0) == pytest.approx(runs.ANSWER_SECONDS - 1.0)
    assert rank.poll() is None
    assert runs.follow_up("rn-11", now=1000.0 + runs.ANSWER_SECONDS + 1) is None  # overdue: SIGTERM now
    assert rank.wait(timeout=GONE_SECONDS) == -signal.SIGTERM


def test_a_launcher_that_never_takes_the_stop_up_gets_its_ranks_signalled(stand_ins):
    rank = stand_ins()
    _record("rn-12", [rank], stop_at_step=True)
    runs.stop("rn-12")
    assert runs.follow_up("rn-12") is None  # still "running" after ANSWER_SECONDS: not answered
    assert rank.wait(timeout=GONE_SECONDS) == -signal.SIGTERM


def test_clean_refuses_a_live_run_and_forgets_an_orphaned_one_killing_its_ranks(stand_ins):
    live = stand_ins()
    _record("rn-13", [live])
    with pytest.raises(ValueError, match="still running and its kernel lives: stop it first"):
        runs.clean("rn-13")
    assert live.poll() is None and registry.read("rn-13") is not None
    orphaned = [stand_ins(), stand_ins()]
    _record("rn-14", orphaned, kernel=_gone())
    outcome = runs.clean("rn-14")
    assert sorted(outcome.signalled) == sorted(p.pid for p in orphaned) and registry.read("rn-14") is None
    assert [p.wait(timeout=GONE_SECONDS) for p in orphaned] == [-9, -9]


def test_the_outcome_as_json_is_what_the_api_answers():
    outcome = runs.StopOutcome("rn-15", (11, 12), (13,), "sent SIGTERM")
    assert outcome.as_json() == {"id": "rn-15", "signalled": [11, 12], "refused": [13], "message": "sent SIGTERM"}
