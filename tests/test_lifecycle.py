"""The launcher's run lifecycle (nbtrain.launch_server.lifecycle): every allowed move, and refusals.

Pure: the table and the Lifecycle object, no process. tests/test_launch_server_server.py shows the
states a real run of a real launcher passes through.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

import pytest

from nbtrain.launch_server.lifecycle import (
    ACTIVE,
    CAN_DRAIN,
    SECOND_STOP,
    STOPPABLE,
    TRANSITIONS,
    Ending,
    IllegalTransition,
    Lifecycle,
    RunPhase,
    allowed,
    hard_stop,
    names_late,
)

EVERY_MOVE = [(before, after) for before, afters in TRANSITIONS.items() for after in sorted(afters, key=str)]


def path_to(state: RunPhase) -> list[RunPhase]:
    """The shortest way from RUNNING to ``state`` through the table (every state is reachable)."""
    paths = {RunPhase.RUNNING: [RunPhase.RUNNING]}
    queue = deque([RunPhase.RUNNING])
    while queue:
        here = queue.popleft()
        for there in sorted(TRANSITIONS[here], key=str):
            if there not in paths:
                paths[there] = [*paths[here], there]
                queue.append(there)
    return paths[state]


def lifecycle_in(state: RunPhase) -> Lifecycle:
    life = Lifecycle(1, now=0.0)
    for step, there in enumerate(path_to(state)[1:], start=1):
        life.move(there, now=float(step))
    return life


def test_the_table_has_a_row_for_every_state_and_only_ended_has_no_way_out():
    assert set(TRANSITIONS) == set(RunPhase)
    assert [state for state, afters in TRANSITIONS.items() if not afters] == [RunPhase.ENDED]
    assert all(state not in afters for state, afters in TRANSITIONS.items())  # no state follows itself


def test_every_state_is_reached_from_running_and_every_one_reaches_ended():
    assert {state for state in RunPhase if path_to(state)} == set(RunPhase)
    for state in RunPhase:
        life = lifecycle_in(state)
        while life.state is not RunPhase.ENDED:  # towards the end, always by an allowed move
            nearer = min(TRANSITIONS[life.state], key=lambda s: len(path_to(RunPhase.ENDED)) - len(path_to(s)))
            life.move(nearer, now=99.0)
        assert life.state is RunPhase.ENDED


@pytest.mark.parametrize(("before", "after"), EVERY_MOVE, ids=[f"{b.name}->{a.name}" for b, a in EVERY_MOVE])
def test_every_allowed_move_is_made_logged_and_remembered(before, after, caplog):
    life = lifecycle_in(before)
    with caplog.at_level(logging.DEBUG, logger="nbtrain.launch_server.lifecycle"):
        life.move(after, now=123.0)
    assert (life.state, life.since) == (after, 123.0)
    assert life.history[-2:] == [before, after] and life.has_been(before)
    assert caplog.messages == [f"run 1: {before.name} -> {after.name}"]


ILLEGAL = [
    (RunPhase.ENDED, RunPhase.RUNNING),
    (RunPhase.RELEASED, RunPhase.RUNNING),
    (RunPhase.KILLED, RunPhase.TERMINATING),
    (RunPhase.DRAINING, RunPhase.TERMINATING),
    (RunPhase.DUMPING_STACKS, RunPhase.ENDED),
    (RunPhase.TERMINATING, RunPhase.TERMINATING),
    (RunPhase.WAITING_FOR_NODES, RunPhase.OFFERING),
    (RunPhase.STOPPING_OUTSIDE, RunPhase.DRAINING),
]


@pytest.mark.parametrize(("before", "after"), ILLEGAL, ids=[f"{b.name}->{a.name}" for b, a in ILLEGAL])
def test_a_move_the_table_does_not_allow_raises_naming_both_states(before, after):
    life = lifecycle_in(before)
    history, ending = list(life.history), life.ending
    assert not allowed(before, after)
    with pytest.raises(IllegalTransition, match=f"run 1 cannot go from {before.name} to {after.name}: ") as raised:
        life.move(after, now=5.0, outcome="stopped", note=SECOND_STOP, gave_up=True)
    assert "please report it" in str(raised.value)
    assert life.state is before and life.history == history and life.ending is ending  # nothing moved or changed


def test_the_groups_the_launcher_asks_about_follow_from_the_table():
    assert ACTIVE == {RunPhase.RUNNING, RunPhase.STOPPING_AT_STEP}
    assert STOPPABLE == ACTIVE | {RunPhase.OFFERING, RunPhase.WAITING_FOR_NODES, RunPhase.RELEASED}
    assert all(allowed(state, RunPhase.TERMINATING) for state in STOPPABLE)
    assert CAN_DRAIN == {state for state in RunPhase if allowed(state, RunPhase.DRAINING)}
    assert not CAN_DRAIN & ACTIVE  # a run whose ranks may still work never drains


def test_a_new_lifecycle_runs_since_its_start_and_has_been_nowhere_else():
    life = Lifecycle(4, now=2.5)
    assert (life.state, life.since, life.history) == (RunPhase.RUNNING, 2.5, [RunPhase.RUNNING])
    assert not life.has_been(RunPhase.TERMINATING)


def test_why_a_run_ends_is_its_states_data_carried_by_the_moves_of_its_stop():
    life = Lifecycle(2, now=0.0)
    assert life.ending == Ending()  # nothing known yet: RunEnded would say "failed"
    life.move(RunPhase.STOPPING_AT_STEP, now=1.0)
    life.learn(late=(1,))  # a rank came late: its stack dump is asked for with the others'
    note = hard_stop("rank 1", "step 9", 2.0)
    life.move(RunPhase.DUMPING_STACKS, now=2.0, outcome="stopped", gave_up=True, note=note)
    assert life.ending == Ending("stopped", "stopped hard (rank 1 did not reach step 9 within 2.0 s)", True, (1,))
    life.move(RunPhase.TERMINATING, now=3.0)
    assert life.ending.gave_up and life.ending.outcome == "stopped"  # kept until another move changes it
    with pytest.raises(dataclasses.FrozenInstanceError):
        life.ending.gave_up = False  # type: ignore[misc]


def test_a_late_ranks_note_names_the_cause_and_a_second_stop_its_consequence():
    assert names_late(hard_stop("ranks 0, 1", "the optimizer step after step 41", 2.0))
    assert not names_late(SECOND_STOP) and not names_late("")
