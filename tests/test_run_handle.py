"""The kernel's handle on a run (nbtrain.kernel.run_handle), fed records as its engine would.

``Run`` reads what an engine files in its inbox; here a small engine that answers as the
launcher does (or, for the stop tests, does not answer) stands in for the launcher. What
a real launcher does with the records is in test_launch.py and test_failures.py.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
from typing import Any

import pytest

from nbtrain.errors import (
    LauncherError,
    NodeLostError,
    RankDiedError,
    RankError,
    RankStartError,
    RunNotEndedError,
    RunStoppedError,
    RunTimeoutError,
)
from nbtrain.kernel import launcher_connection, run_handle
from nbtrain.messages import events
from nbtrain.planning import config
from nbtrain.planning.deviceplan import DevicePlan

RUN = 9
CONFIG = config.make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=30)
WAIT_SECONDS = 10.0


class Launcher:
    """An engine that records what the Run asks; ``answer_stop``: a stop ends the run at once."""

    def __init__(self, answer_stop: bool = True) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.answer_stop = answer_stop
        self.calls: list[tuple[str, Any]] = []

    def submit(self, start_run: Any, tensor_fd: int | None) -> tuple[int, queue.Queue]:
        self.calls.append(("submit", start_run(RUN)))
        return RUN, self.inbox

    def stop(self, run_id: int, reason: str, graceful: bool = False) -> None:
        self.calls.append(("stop", reason))
        if self.answer_stop:
            self.inbox.put((events.RunEnded(run_id, events.STOPPED), []))

    def forget(self, run_id: int) -> None:
        self.calls.append(("forget", run_id))

    def output_taken(self, run_id: int, chars: int) -> None:
        self.calls.append(("output_taken", chars))

    def close(self) -> None:
        self.calls.append(("close", None))

    def file(self, *records: Any) -> None:
        for record in records:
            self.inbox.put((record, []))


def new_run(launcher: Launcher, cfg: config.LaunchConfig = CONFIG) -> run_handle.Run:
    return run_handle.Run(launcher, RUN, launcher.inbox, cfg)


def finished(value: Any) -> events.RunEnded:
    return events.RunEnded(RUN, events.FINISHED, result=pickle.dumps(value))


# --- events and the result -------------------------------------------------------------------


def test_events_yield_the_records_and_end_with_the_run():
    launcher = Launcher()
    run = new_run(launcher)
    output = events.Output(RUN, 1, "stdout", "epoch 1\n")
    launcher.file(events.RankStarted(RUN, 0, 4001), events.RankStarted(RUN, 1, 4002), output, finished(42))
    seen = [e for e in run.events(poll=0.01) if e is not None]
    assert seen[-1] == finished(42) and output in seen
    assert run.state == events.FINISHED and run.pids == {0: 4001, 1: 4002}
    assert ("output_taken", len("epoch 1\n")) in launcher.calls and launcher.calls[-1] == ("forget", RUN)
    assert run.result() == 42 and run.wait() == 42  # wait() after the end gives the result again


def test_events_yield_none_while_nothing_arrives_so_a_view_can_redraw():
    launcher = Launcher()
    run = new_run(launcher)
    stream = run.events(poll=0.01)
    assert next(stream) is None
    launcher.file(finished("done"))
    assert [e for e in stream] == [finished("done")]


def test_the_result_before_the_end_says_to_wait():
    with pytest.raises(RunNotEndedError, match=r"run 9 has not ended yet, so it has no result .* Call run\.wait\(\)"):
        new_run(Launcher()).result()


def test_a_result_with_tensors_arrives_through_its_memory_file():
    import torch

    from nbtrain.messages import sharedtensors

    data, fd = sharedtensors.dumps_to_shared_memory({"weights": torch.arange(3.0)})
    assert fd is not None
    launcher = Launcher()
    launcher.inbox.put((events.RunEnded(RUN, events.FINISHED, result=data, has_tensor_file=True), [fd]))
    result = new_run(launcher).wait()
    assert result["weights"].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(OSError):
        os.fstat(fd)  # the run closed the file once the result was loaded


# --- failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ended", "error", "text"),
    [
        (
            events.RunEnded(
                RUN,
                events.FAILED,
                failure=events.RankFailed(RUN, 1, "ValueError", "bad", "Traceback\nValueError: bad\n"),
            ),
            RankError,
            "rank 1 raised ValueError: bad",
        ),
        (
            events.RunEnded(
                RUN, events.FAILED, failure=events.RankExited(RUN, 0, None, signal.SIGKILL, reported=False)
            ),
            RankDiedError,
            "rank 0 was killed by signal 9 (SIGKILL)",
        ),
        (
            events.RunEnded(
                RUN, events.FAILED, failure=events.RankNotStarted(RUN, 1, 2, "EAGAIN", "no more processes")
            ),
            RankStartError,
            "could not start rank 1 of 2: creating its process failed with EAGAIN (no more processes)",
        ),
        (
            events.RunEnded(RUN, events.FAILED, failure=events.NodeLost(RUN, "node 1 (10.0.0.8)", "its agent exited")),
            NodeLostError,
            "node 1 (10.0.0.8) was lost during the run: its agent exited",
        ),
        (events.RunEnded(RUN, events.TIMED_OUT), RunTimeoutError, "the run exceeded timeout=30 s"),
        (events.RunEnded(RUN, events.STOPPED), RunStoppedError, "the run was stopped before it finished"),
        (
            events.RunEnded(RUN, events.FAILED, detail="the launcher exited (code 1)"),
            LauncherError,
            "the launcher exited (code 1)",
        ),
    ],
    ids=["raised", "killed", "not started", "node lost", "timed out", "stopped", "launcher"],
)
def test_each_way_a_run_ends_raises_its_error(ended, error, text):
    launcher = Launcher()
    launcher.file(ended)
    with pytest.raises(error) as caught:
        new_run(launcher).wait()
    assert str(caught.value).startswith(text)


def test_a_failure_without_a_cause_says_what_each_rank_did_and_where_the_log_is(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[rank 1] loading\n")
    launcher = Launcher()
    launcher.file(
        events.Output(RUN, 1, "stdout", "loading\nstep 1\nstep 2\nsaving\n"),
        events.RankExited(RUN, 0, exit_code=None, signal_number=signal.SIGTERM, reported=False, stopped=True),
        events.RankExited(RUN, 1, exit_code=0, signal_number=None, reported=True),
        events.RunEnded(RUN, events.FAILED),
    )
    run = run_handle.Run(launcher, RUN, launcher.inbox, CONFIG, str(log))
    with pytest.raises(LauncherError) as caught:
        run.wait()
    assert str(caught.value).splitlines() == [
        "the run failed, but no rank reported an error and nbtrain saw no cause.",
        (
            "Seen: rank 0 was killed by signal 15 (SIGTERM) when nbtrain stopped it; "
            "rank 1 exited with code 0 after finishing its work."
        ),
        "Last output of rank 1: step 1 | step 2 | saving",
        (
            f"Every rank's full output is in {log}. Run it again; if it fails the same way, the launcher's own "
            "messages are on the kernel's stderr (the terminal or log that runs Jupyter)."
        ),
    ]


def test_a_launcher_gone_mid_run_fails_the_run_with_what_was_seen():
    launcher = Launcher()
    launcher.file(launcher_connection.LauncherGone("the launcher was killed by signal 9"))
    run = new_run(launcher)
    with pytest.raises(LauncherError, match="the launcher was killed by signal 9"):
        run.wait()
    assert run.state == events.FAILED and ("forget", RUN) in launcher.calls


def test_where_ranks_were_is_empty_unless_the_launcher_sent_stacks():
    launcher = Launcher()
    launcher.file(events.RunEnded(RUN, events.STOPPED))
    run = new_run(launcher)
    with pytest.raises(RunStoppedError):
        run.wait()
    assert run.where_ranks_were() == ""


# --- stopping ---------------------------------------------------------------------------------


def test_stop_asks_the_engine_and_waits_for_the_end():
    launcher = Launcher()
    run = new_run(launcher)
    run.stop("stopped with the Stop button")
    assert run.state == events.STOPPED and ("stop", "stopped with the Stop button") in launcher.calls
    run.stop()  # a second stop: the run has ended, nothing is sent
    assert [c for c in launcher.calls if c[0] == "stop"] == [("stop", "stopped with the Stop button")]


def test_a_launcher_that_does_not_answer_a_stop_is_replaced(monkeypatch):
    monkeypatch.setattr(run_handle, "INTERRUPT_GRACE_SECONDS", 0.2)
    launcher = Launcher(answer_stop=False)
    run = new_run(launcher)
    run.stop()
    assert run.state == events.STOPPED and launcher.calls[-1] == ("close", None)


def test_abandon_drops_what_arrived_after_the_end_and_closes_its_files():
    launcher = Launcher()
    read_end, write_end = os.pipe()
    os.close(write_end)
    launcher.file(finished(1))
    launcher.inbox.put((events.Output(RUN, 0, "stdout", "late\n"), [read_end]))
    run = new_run(launcher)
    list(run.events(poll=0.01))
    run.abandon()
    assert launcher.inbox.empty()
    with pytest.raises(OSError):
        os.fstat(read_end)


def test_an_interrupt_while_waiting_stops_the_run_and_is_raised():
    launcher = Launcher()
    run = new_run(launcher)

    def interrupt(event: Any) -> None:
        raise KeyboardInterrupt

    launcher.file(events.RankStarted(RUN, 0, 4001))
    with pytest.raises(KeyboardInterrupt):
        run.wait(on_event=interrupt)
    assert run.state == events.STOPPED and ("stop", "interrupted") in launcher.calls
