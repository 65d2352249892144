"""The launcher's run lifecycle (nbtrain.launch_server.lifecycle): every allowed move, and refusals.

Pure: the table and the Lifecycle object, no process. tests/test_launch_server.py shows the
states a real run of a real launcher passes through.
"""

from __future__ import annotations

import logging
from collections import deque

import pytest

from nbtrain.launch_server.lifecycle import (
    ACTIVE,
    CAN_DRAIN,
    STOPPABLE,
    TRANSITIONS,
    IllegalTransition,
    Lifecycle,
    RunState,
    allowed,
)

EVERY_MOVE = [(before, after) for before, afters in TRANSITIONS.items() for after in sorted(afters, key=str)]


def path_to(state: RunState) -> list[RunState]:
    """The shortest way from RUNNING to ``state`` through the table (every state is reachable)."""
    paths = {RunState.RUNNING: [RunState.RUNNING]}
    queue = deque([RunState.RUNNING])
    while queue:
        here = queue.popleft()
        for there in sorted(TRANSITIONS[here], key=str):
            if there not in paths:
                paths[there] = [*paths[here], there]
                queue.append(there)
    return paths[state]


def lifecycle_in(state: RunState) -> Lifecycle:
    life = Lifecycle(1, now=0.0)
    for step, there in enumerate(path_to(state)[1:], start=1):
        life.move(there, now=float(step))
    return life


def test_the_table_has_a_row_for_every_state_and_only_ended_has_no_way_out():
    assert set(TRANSITIONS) == set(RunState)
    assert [state for state, afters in TRANSITIONS.items() if not afters] == [RunState.ENDED]
    assert all(state not in afters for state, afters in TRANSITIONS.items())  # no state follows itself


def test_every_state_is_reached_from_running_and_every_one_reaches_ended():
    assert {state for state in RunState if path_to(state)} == set(RunState)
    for state in RunState:
        life = lifecycle_in(state)
        while life.state is not RunState.ENDED:  # towards the end, always by an allowed move
            nearer = min(TRANSITIONS[life.state], key=lambda s: len(path_to(RunState.ENDED)) - len(path_to(s)))
            life.move(nearer, now=99.0)
        assert life.state is RunState.ENDED


@pytest.mark.parametrize(("before", "after"), EVERY_MOVE, ids=[f"{b.name}->{a.name}" for b, a in EVERY_MOVE])
def test_every_allowed_move_is_made_logged_and_remembered(before, after, caplog):
    life = lifecycle_in(before)
    with caplog.at_level(logging.DEBUG, logger="nbtrain.launch_server.lifecycle"):
        life.move(after, now=123.0)
    assert (life.state, life.since) == (after, 123.0)
    assert life.history[-2:] == [before, after] and life.has_been(before)
    assert caplog.messages == [f"run 1: {before.name} -> {after.name}"]


ILLEGAL = [
    (RunState.ENDED, RunState.RUNNING),
    (RunState.RELEASED, RunState.RUNNING),
    (RunState.KILLED, RunState.TERMINATING),
    (RunState.DRAINING, RunState.TERMINATING),
    (RunState.DUMPING_STACKS, RunState.ENDED),
    (RunState.TERMINATING, RunState.TERMINATING),
    (RunState.WAITING_FOR_NODES, RunState.OFFERING),
    (RunState.STOPPING_OUTSIDE, RunState.DRAINING),
]


@pytest.mark.parametrize(("before", "after"), ILLEGAL, ids=[f"{b.name}->{a.name}" for b, a in ILLEGAL])
def test_a_move_the_table_does_not_allow_raises_naming_both_states(before, after):
    life = lifecycle_in(before)
    history = list(life.history)
    assert not allowed(before, after)
    with pytest.raises(IllegalTransition, match=f"run 1 cannot go from {before.name} to {after.name}: ") as raised:
        life.move(after, now=5.0)
    assert "please report it" in str(raised.value)
    assert life.state is before and life.history == history  # nothing moved


def test_the_groups_the_launcher_asks_about_follow_from_the_table():
    assert ACTIVE == {RunState.RUNNING, RunState.STOPPING_AT_STEP}
    assert STOPPABLE == ACTIVE | {RunState.OFFERING, RunState.WAITING_FOR_NODES, RunState.RELEASED}
    assert all(allowed(state, RunState.TERMINATING) for state in STOPPABLE)
    assert CAN_DRAIN == {state for state in RunState if allowed(state, RunState.DRAINING)}
    assert not CAN_DRAIN & ACTIVE  # a run whose ranks may still work never drains


def test_a_new_lifecycle_runs_since_its_start_and_has_been_nowhere_else():
    life = Lifecycle(4, now=2.5)
    assert (life.state, life.since, life.history) == (RunState.RUNNING, 2.5, [RunState.RUNNING])
    assert not life.has_been(RunState.TERMINATING)
