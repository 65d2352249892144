"""The worker API (nbtrain.rank.api): outside a run, inside a rank's context, and on real ranks.

A rank's context is set here as the runtime sets it, with ``send`` collecting what a rank
would send to its launcher; the collectives run on two real ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import pytest
import torch

import nbtrain
from helpers.procs import finish
from nbtrain.messages import events
from nbtrain.rank import api


@pytest.fixture
def sent() -> Iterator[list[object]]:
    """A rank's context (rank 1 of 4, on CPU); yields what it sends, and clears it after."""
    messages: list[object] = []
    api._set_context(api.RankContext(7, 1, 1, 4, "cpu", None, send=messages.append))
    try:
        yield messages
    finally:
        api._set_context(None)


def metric_rows(messages: list[object]) -> list[tuple[int, dict]]:
    return [(step, dict(values)) for m in messages if isinstance(m, events.Metrics) for step, _, values in m.rows]


def test_outside_a_run_the_kernel_is_rank_0_of_1():
    assert api.current_context() is None
    assert (api.rank(), api.local_rank(), api.world_size(), api.is_rank_zero()) == (0, 0, 1, True)
    assert api.device() == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert api.log(loss=1.0) is None  # nothing to send to


def test_inside_a_run_the_context_answers(sent):
    assert (api.rank(), api.local_rank(), api.world_size(), api.is_rank_zero()) == (1, 1, 4, False)
    assert api.device() == torch.device("cpu")
    api._set_context(api.RankContext(7, 2, 0, 4, "cuda", 1, send=sent.append))
    assert api.device() == torch.device("cuda", 1)  # no CUDA needed to name it


def test_log_batches_rows_until_flush_rows_or_flush_seconds(sent, monkeypatch):
    monkeypatch.setattr(api, "FLUSH_SECONDS", 3600.0)
    context = api.current_context()
    assert context is not None
    context.last_flush = float("inf")  # as if just flushed: only the row count sends
    for value in range(api.FLUSH_ROWS - 1):
        api.log(loss=float(value))
    assert sent == []
    api.log(loss=0.5)
    assert len(sent) == 1 and isinstance(sent[0], events.Metrics)
    assert (sent[0].run_id, sent[0].rank, len(sent[0].rows)) == (7, 1, api.FLUSH_ROWS)
    assert context.pending == []


def test_log_sends_at_once_when_the_last_send_is_older_than_flush_seconds(sent):
    api.log(loss=1.0)  # last_flush starts at 0: long ago
    assert metric_rows(sent) == [(1, {"loss": 1.0})]


def test_log_counts_steps_unless_given_and_keeps_only_scalars(sent):
    context = api.current_context()
    assert context is not None
    context.last_flush = float("inf")
    api.log(loss=1, acc=np.float32(0.5), frac=Fraction(1, 4))
    api.log(step=10, loss=torch.tensor(2.0), name="text", weights=torch.ones(3), nothing=None)
    api.log(loss=3.0)
    api.log()  # nothing to record: not a step
    context.flush()
    assert metric_rows(sent) == [(1, {"loss": 1.0, "acc": 0.5, "frac": 0.25}), (10, {"loss": 2.0}), (11, {"loss": 3.0})]
    assert context.logged
    assert all(type(v) is float for _, values in metric_rows(sent) for v in values.values())


def test_flush_with_nothing_pending_sends_nothing(sent):
    context = api.current_context()
    assert context is not None
    context.flush()
    assert sent == []


def test_device_tensors_wait_as_tensors_and_are_floats_when_sent(sent):
    # A meta tensor stands for a GPU one: not on the CPU, so kept as it is until the batch goes.
    context = api.current_context()
    assert context is not None
    context.last_flush = float("inf")
    api.log(loss=torch.tensor(1.5, device="meta"), acc=0.75)
    assert context.pending_on_device and isinstance(context.pending[0][2]["loss"], torch.Tensor)
    context.flush()
    assert metric_rows(sent) == [(1, {"acc": 0.75})]  # a meta tensor has no value: dropped, the rest sent
    assert not context.pending_on_device


@pytest.mark.parametrize(
    ("op", "message"),
    [("avg", "all_reduce(op='avg') is not a reduction nbtrain knows; use one of sum, mean, max, min.")],
)
def test_all_reduce_names_an_unknown_op_and_the_known_ones(op, message):
    with pytest.raises(ValueError) as caught:
        api.all_reduce(1, op=op)
    assert str(caught.value) == message


@pytest.mark.parametrize("value", ["3", [1, 2], None, 1j])
def test_all_reduce_of_what_is_not_a_number_or_a_tensor_says_what_to_pass(value):
    with pytest.raises(
        TypeError,
        match=rf"all_reduce\(\) takes a number or a tensor, not {type(value).__name__}: .* torch.tensor\(values\)",
    ):
        api.all_reduce(value)


def test_all_reduce_on_one_rank_gives_the_value_back(sent):
    api._set_context(api.RankContext(7, 0, 0, 1, "cpu", None, send=sent.append))
    tensor = torch.ones(2)
    assert api.all_reduce(tensor, op="mean") is tensor and api.all_reduce(5, op="max") == 5


def test_all_reduce_combines_numbers_and_tensors_over_real_ranks(launcher):
    def reduce_on_each_rank():
        import torch

        import nbtrain

        r = nbtrain.rank()
        own = torch.tensor([float(r), 10.0])
        reduced = nbtrain.all_reduce(own, op="max")
        return {
            "sum": nbtrain.all_reduce(r + 1),
            "mean": nbtrain.all_reduce(r + 1, op="mean"),
            "min": nbtrain.all_reduce(0.5 * (r + 1), op="min"),
            "max": reduced.tolist(),
            "own unchanged": own.tolist() == [float(r), 10.0],
        }

    result = finish(nbtrain.start(reduce_on_each_rank, devices=2, accelerator="cpu"))
    assert result == {"sum": 3, "mean": 1.5, "min": 0.5, "max": [1.0, 10.0], "own unchanged": True}
    assert type(result["sum"]) is int


def test_device_scalars_of_a_batch_become_floats_together_in_their_rows():
    """The rows a flush sends: each scalar kept as a tensor made a float, in its row, mixed dtypes too."""
    pending = [
        (1, 10.0, {"loss": torch.tensor(1.5, dtype=torch.bfloat16), "acc": 0.5}),
        (2, 11.0, {"loss": torch.tensor([2.25]), "hist": torch.zeros(3), "n": torch.tensor(7)}),
    ]
    assert api._RowsOnTheWay(pending).rows() == (
        (1, 10.0, {"loss": 1.5, "acc": 0.5}),
        (2, 11.0, {"loss": 2.25, "n": 7.0}),  # not a scalar: nothing to draw, dropped
    )
