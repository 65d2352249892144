"""The loss logged with no code change (nbtrain.rank.auto.losslogging), on real ranks and outside a run."""

from __future__ import annotations

import itertools

import torch

import nbtrain
from helpers.procs import collect
from nbtrain.messages import events
from nbtrain.rank.auto import losslogging


def test_loss_logging_is_off_outside_a_run():
    backward = torch.Tensor.backward
    with losslogging.loss_logging():
        assert torch.Tensor.backward is backward


def test_a_scalar_s_backward_is_logged_as_loss_until_the_function_logs_itself(launcher):
    def fn():
        model = torch.nn.Linear(2, 1)
        torch.nn.init.constant_(model.weight, 1.0)
        torch.nn.init.constant_(model.bias, 0.5)
        plain = torch.Tensor.backward
        with losslogging.loss_logging():
            patched = torch.Tensor.backward is not plain
            for _ in range(3):
                model(torch.ones(1, 2)).sum().backward()  # a scalar: 2.5, logged as loss
            model(torch.ones(2, 2)).backward(torch.ones(2, 1))  # not a scalar: not a loss
            nbtrain.log(accuracy=0.75)
            model(torch.ones(1, 2)).sum().backward()  # the function logs itself now: not logged
        return patched, torch.Tensor.backward is plain

    result, failure, seen = collect(nbtrain.start(fn, devices=2))
    assert failure is None and result == (True, True), failure
    rows = [row for e in seen if isinstance(e, events.Metrics) and e.rank == 0 for row in e.rows]
    assert [(step, dict(values)) for step, _time, values in rows] == [
        (1, {"loss": 2.5}),
        (2, {"loss": 2.5}),
        (3, {"loss": 2.5}),
        (4, {"accuracy": 0.75}),
    ]


def test_a_fast_loop_logs_every_first_step_then_a_power_of_two_stride_and_its_last_loss(launcher):
    def fn():
        model = torch.nn.Linear(2, 1)
        with losslogging.loss_logging():
            for step in range(1, 2001):  # each loss's value is its step
                (model(torch.ones(1, 2)).sum() * 0 + step).backward()

    _, failure, seen = collect(nbtrain.start(fn, devices=1))
    assert failure is None, failure
    rows = [(step, dict(values)) for e in seen if isinstance(e, events.Metrics) for step, _time, values in e.rows]
    assert all(values == {"loss": float(step)} for step, values in rows), rows[:5]
    steps = [step for step, _ in rows]
    first = losslogging.FIRST_STEPS
    assert steps[:first] == list(range(1, first + 1)) and steps[-1] == 2000
    # Past the first steps, a loop this fast is logged every stride-th step (a power of two, 2 or
    # more here), a stride that only grows; the last step is logged whatever the stride.
    sampled = steps[first - 1 : -1]
    gaps = [b - a for a, b in itertools.pairwise(sampled)]
    assert gaps == sorted(gaps) and all(step % 2 == 0 for step in sampled[1:]), steps
    assert len(rows) < 1000, len(rows)
