"""The kernel's one run follower (nbtrain.kernel.follower), on runs made of their events: no launcher, no kernel.

A blocking cell (tests/test_cellrun.py) and a background run (tests/test_background.py) both follow
their runs with it in a real kernel; here each piece is checked on its own, as each way of following
uses it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from nbtrain.errors import RankError, RunStoppedError, RunTimeoutError
from nbtrain.kernel import follower
from nbtrain.kernel.cellrun import LastRun
from nbtrain.messages import events


class Run:
    """A run as the follower reads it: its events, then its state, result or failure."""

    def __init__(
        self, stream: list[Any], state: str = events.FINISHED, result: Any = "raw", stopped_at: int | None = None
    ):
        self.stream, self.state, self._result, self.stopped_at = stream, state, result, stopped_at
        self.log_path: str | None = None
        self.no_state_note = ""
        self.order: list[str] = []

    def events(self, poll: float) -> Any:
        yield from self.stream

    def state_at_failure(self) -> Any:
        self.order.append("state_at_failure")
        return (1, "state at the raise")

    def result(self) -> Any:
        self.order.append("result")
        if isinstance(self._result, Exception):
            raise self._result
        return self._result


def test_every_event_is_shown_and_a_cells_record_keeps_its_rows_and_stalls():
    rows = ((1, 0.0, {"loss": 1.0}), (2, 0.0, {"loss": 0.5}))
    stream = [None, events.Metrics(1, 0, rows), events.RanksStalled(1, 12.0), events.RanksStalled(1, 0.0)]
    record, shown = LastRun(), []
    assert follower.follow_events(Run(stream), shown.append, lambda: False, 0.1, record) is True
    assert shown == stream  # where it shows gets each event, a redraw (None) too
    assert list(record.metrics[0]) == list(rows)
    assert record.stall == ""  # the ranks moved again: the note is gone


def test_a_function_run_keeps_nothing_and_stopping_leaves_at_once():
    stream = [events.Output(1, 0, "stdout", "a\n"), events.Output(1, 0, "stdout", "b\n")]
    shown: list[Any] = []
    asked = iter([False, True])
    assert follower.follow_events(Run(stream), shown.append, lambda: next(asked), 0.1) is False
    assert shown == stream[:1]  # the second event comes after the stop hard: not shown


def test_a_failed_cells_state_at_the_raise_is_taken_before_the_result_frees_it():
    error = RankError(1, "ValueError", "only rank 1 fails", "")
    run = Run([], state=events.FAILED, result=error)
    outcome = follower.conclude(run, take_state=True)
    assert run.order == ["state_at_failure", "result"]
    assert (outcome.state, outcome.error, outcome.at_raise) == (events.FAILED, error, (1, "state at the raise"))
    after_a_stop = Run([], state=events.FAILED, result=error)  # a stop was asked for: its failure, no state
    assert follower.conclude(after_a_stop, take_state=False).at_raise is None
    assert after_a_stop.order == ["result"]


def test_a_result_that_cannot_load_fails_the_run_and_a_finished_one_is_its_result():
    broken = follower.conclude(Run([], state=events.FINISHED, result=ValueError("truncated")), take_state=True)
    assert broken.state == events.FAILED and isinstance(broken.error, ValueError)
    assert follower.conclude(Run([]), take_state=True) == follower.Outcome(events.FINISHED, "raw")


def test_the_record_notes_a_finish_or_a_stop_at_a_step_and_names_the_log_only_if_it_exists(tmp_path):
    record, run = LastRun(), Run([], state=events.STOPPED, stopped_at=412)
    run.log_path = str(tmp_path / "absent.log")
    follower.note_end(record, run)
    assert (record.state, record.stopped_at, record.stopped, record.log_path) == ("stopped", 412, "at a step", None)
    run.log_path = str(tmp_path / "run.log")
    open(run.log_path, "w").close()
    finished = LastRun()
    follower.note_end(finished, _with_log(Run([]), run.log_path))
    assert (finished.state, finished.stopped, finished.log_path) == ("finished", "", run.log_path)
    assert os.path.exists(finished.log_path)


def _with_log(run: Run, path: str) -> Run:
    run.log_path = path
    return run


@pytest.mark.parametrize(("state", "raised"), [(events.STOPPED, RunStoppedError), (events.TIMED_OUT, RunTimeoutError)])
def test_a_stop_that_kept_a_step_raises_naming_the_step(state, raised):
    run = Run([], state=state, stopped_at=7)
    run.config = type("Config", (), {"timeout": 2.0})()  # type: ignore[attr-defined]
    error = follower.kept_error(run, ["history"], {"history": []})
    assert isinstance(error, raised)
    assert "stopped at step 7 on every rank; the cell's results at that step are in the kernel." in str(error)


class Prepared:
    """What the follower reads of a cell's PreparedCell."""

    def __init__(self) -> None:
        self.record, self.shipped, self.held = LastRun(), {"value": 0}, {}
        self.targets, self.total_steps = self.shipped, None
        self.unchanged = "Nothing in the kernel was changed."


def test_a_failed_cells_state_at_the_raise_goes_in_where_the_caller_brings_it_back():
    error = RankError(1, "ValueError", "only rank 1 fails", "")
    prepared, brought = Prepared(), []

    def bring_back(raw: Any) -> None:  # as the cell's own thread, or the kernel's main thread, applies it
        brought.append(raw)
        prepared.record.updated = ["value"]

    kept = follower.kept_at_failure(None, Run([]), (1, "raw at the raise"), error, prepared, bring_back)
    assert brought == ["raw at the raise"] and prepared.record.failed_rank == 1
    assert kept == (
        "The kernel holds rank 1's state at the failing line, as one process would: value as the cell had set it."
    )
    gone = "the kernel could not load it: OSError: gone"
    why = follower.kept_at_failure(None, Run([]), gone, error, Prepared(), None)
    assert why == (
        "Nothing in the kernel was changed. The state at the failing line did not come back "
        "(the kernel could not load it: OSError: gone)."
    )
