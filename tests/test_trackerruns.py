"""A tracker run the kernel opened, sent to the ranks as a stand-in, and rank 0's calls made on it.

In one process here: the kernel's pickler sends a real SummaryWriter as a stand-in, and a
TrackerCalls event made of calls like those a rank sends is replayed on the real writer,
read back with TensorBoard's own reader. The rank side runs in tests/test_trackers.py.
"""

from __future__ import annotations

import pickle

import pytest

from nbtrain.messages import codepickle, events, trackerruns


@pytest.fixture
def writer(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    yield writer
    writer.close()


def test_a_kernel_summary_writer_travels_as_a_stand_in_with_its_log_dir(writer):
    sent = pickle.loads(codepickle.dumps_keeping_filenames({"writer": writer}))["writer"]
    assert isinstance(sent, trackerruns.KernelRunStandIn)
    assert sent.log_dir == writer.log_dir and sent.get_logdir() == writer.log_dir
    assert sent.add_scalar("x", 1.0, 0) is None  # outside a run: accepted, sent nowhere
    assert pickle.loads(pickle.dumps(sent)).log_dir == writer.log_dir  # and back, as itself


def test_rank_0s_calls_are_made_on_the_kernels_writer_in_order(writer):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pickle.loads(codepickle.dumps_keeping_filenames(writer))  # the kernel now knows it by its token
    calls = tuple((id(writer), ("add_scalar",), ("x", float(step), step), {}) for step in range(3))
    failed: list[str] = []
    trackerruns.replay(events.TrackerCalls(1, 0, (*calls, (id(writer), ("flush",), (), {}))), failed.append)
    trackerruns.replay(events.TrackerCalls(1, 0, ((id(writer), ("no_such_call",), (), {}),) * 2), failed.append)
    accumulator = EventAccumulator(writer.log_dir)
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("x")] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert len(failed) == 1 and "no_such_call(...) from rank 0 could not be made" in failed[0], failed


def test_only_numbers_go_to_the_live_view():
    assert trackerruns.scalars({"a": 1, "b": "text", "c": None, "d": {"e": 2.5}, "f": True}) == {"a": 1.0, "d/e": 2.5}


def test_a_kernel_tensorboardx_writer_travels_as_a_stand_in_and_gets_rank_0s_calls(tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tbx"))
    try:
        sent = pickle.loads(codepickle.dumps_keeping_filenames(writer))
        assert isinstance(sent, trackerruns.KernelRunStandIn)
        assert sent.logdir == writer.logdir and sent.get_logdir() == writer.logdir
        calls = ((id(writer), ("add_scalar",), ("x", 2.0, 5), {}), (id(writer), ("flush",), (), {}))
        trackerruns.replay(events.TrackerCalls(1, 0, calls), pytest.fail)
    finally:
        writer.close()
    accumulator = EventAccumulator(writer.logdir)
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("x")] == [(5, 2.0)]
