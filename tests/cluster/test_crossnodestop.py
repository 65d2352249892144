"""A stop at a step across nodes (nbtrain.cluster.crossnodestop): the kernel's choice of one step from
every node's ``StepsBegun``, when it is overdue, and which node's note says why a stop was hard.
Pure: real records, no Ray.
"""

from __future__ import annotations

import os

from nbtrain.cluster import crossnodestop
from nbtrain.cluster.crossnodestop import CrossNodeStop
from nbtrain.messages import events, stacktext

PKG = os.path.dirname(stacktext.__file__)
SITE = "/venv/lib/python3.11/site-packages"
# A rank's faulthandler dump inside the rank runtime: ``{inner}`` is where it was when dumped.
DUMP = """\
Current thread 0x00007f0000000002 (most recent call first):
{inner}
  File "/tmp/ipykernel_7/123.py", line 12 in <module>
  File "{pkg}/rank/cell.py", line 120 in _execute
  File "{pkg}/rank/runtime.py", line 62 in run_rank
"""
IN_ALL_REDUCE = DUMP.format(
    pkg=PKG, inner=f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 2800 in all_reduce'
)
ASLEEP = DUMP.format(pkg=PKG, inner='  File "/tmp/ipykernel_7/123.py", line 9 in slow_batch')


def test_no_step_is_chosen_until_every_running_node_has_reported() -> None:
    stop = CrossNodeStop(asked_at=100.0)
    assert stop.choose({0, 1}) is None  # nobody reported
    stop.take(1, events.StepsBegun(7, 12, 2.0, events.STOPPED))
    assert stop.choose({0, 1}) is None
    assert stop.chosen is None


def test_the_highest_step_over_the_nodes_and_the_longest_grace_are_chosen_once() -> None:
    stop = CrossNodeStop(asked_at=100.0)
    stop.take(0, events.StepsBegun(7, 41, 6.0, events.STOPPED))
    stop.take(1, events.StepsBegun(7, 43, 2.0, events.TIMED_OUT))
    stop.take(2, events.StepsBegun(7, 42, 3.5, events.STOPPED))
    chosen = stop.choose({0, 1, 2})
    assert chosen == events.StepChosen(run_id=7, step=43, grace=6.0)
    assert stop.chosen is chosen
    stop.take(3, events.StepsBegun(7, 99, 9.0, events.STOPPED))
    assert stop.choose({0, 1, 2, 3}) is None  # already chosen and sent: never a second step


def test_a_node_that_ended_meanwhile_is_not_waited_for() -> None:
    stop = CrossNodeStop(asked_at=100.0)
    stop.take(0, events.StepsBegun(7, 20, 2.0, events.STOPPED))
    assert stop.choose({0}) == events.StepChosen(7, 20, 2.0)  # node 1 is done: only node 0 is running


def test_a_nodes_later_report_replaces_its_first() -> None:
    stop = CrossNodeStop(asked_at=100.0)
    stop.take(0, events.StepsBegun(7, 20, 2.0, events.STOPPED))
    stop.take(0, events.StepsBegun(7, 25, 2.0, events.TIMED_OUT))
    assert stop.choose({0}) == events.StepChosen(7, 25, 2.0)


def test_the_choice_is_overdue_only_after_choice_seconds_without_one() -> None:
    stop = CrossNodeStop(asked_at=100.0)
    assert not stop.overdue(100.0 + crossnodestop.CHOICE_SECONDS)
    assert stop.overdue(100.0 + crossnodestop.CHOICE_SECONDS + 0.01)
    stop.take(0, events.StepsBegun(7, 3, 2.0, events.STOPPED))
    stop.choose({0})
    assert not stop.overdue(100.0 + 10 * crossnodestop.CHOICE_SECONDS)  # chosen: nothing is late


def _stopped(note: str, *dumps: str) -> events.RunEnded:
    return events.RunEnded(7, events.STOPPED, stop_note=note, stacks=tuple(enumerate(dumps)))


LATE_1 = "stopped hard (rank 1 did not reach step 9 within 2.0 s)"
LATE_0 = "stopped hard (rank 0 did not reach step 9 within 2.0 s)"
SECOND = "stopped hard at once (asked to stop a second time)"


def test_the_note_of_a_node_with_a_late_rank_wins_over_a_second_stop() -> None:
    assert crossnodestop.stop_note([_stopped(SECOND), _stopped(LATE_1)]) == LATE_1


def test_a_late_rank_that_was_asleep_is_the_cause_not_one_waiting_for_it() -> None:
    # Node 0's rank 0 waited in an all_reduce for node 1's rank 1, which slept: node 1's note names the cause.
    waiting = _stopped(LATE_0, IN_ALL_REDUCE)
    asleep = _stopped(LATE_1, ASLEEP)
    assert crossnodestop.stop_note([waiting, asleep]) == LATE_1
    assert crossnodestop.stop_note([asleep, waiting]) == LATE_1


def test_without_a_late_rank_the_first_note_that_is_not_a_second_stop_is_taken() -> None:
    other = "stopped hard (the step could not be kept)"
    assert crossnodestop.stop_note([_stopped(""), _stopped(SECOND), _stopped(other)]) == other
    assert crossnodestop.stop_note([_stopped(SECOND), _stopped("")]) == SECOND
    assert crossnodestop.stop_note([_stopped(""), events.RunEnded(7, events.FINISHED)]) == ""
