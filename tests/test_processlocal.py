"""Per-process singletons (accelerate's state) travel as the receiving process's own."""

from __future__ import annotations

import io
import pickle
from typing import ClassVar

import pytest

from nbtrain.messages import codepickle, processlocal


class Borg:
    """A per-process singleton as accelerate writes one: every instance shares the class's dict."""

    _shared_state: ClassVar[dict[str, object]] = {}

    def __init__(self, size: int = 1) -> None:
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self.size = size


class Holder:
    def __init__(self) -> None:
        self.state = Borg(size=2)


def _round_trip(obj: object) -> object:
    buffer = io.BytesIO()
    codepickle.Pickler(buffer).dump(obj)
    return pickle.loads(buffer.getvalue())


@pytest.fixture(autouse=True)
def _fresh() -> None:
    Borg._shared_state.clear()
    processlocal.initialize()  # nothing left from another test


def test_a_singleton_arrives_as_the_receivers_own_and_its_fields_build_it_where_there_is_none() -> None:
    holder = Holder()
    assert processlocal.is_shared_state(holder.state) and not processlocal.is_shared_state(holder)
    payload = io.BytesIO()
    codepickle.Pickler(payload).dump(holder)
    Borg._shared_state.clear()  # the receiving process has built none
    arrived = pickle.loads(payload.getvalue())
    assert vars(arrived.state) is Borg._shared_state and not Borg._shared_state
    assert processlocal.initialize() == []
    assert arrived.state.size == 2  # the sender's fields: this singleton holds no world
    assert Borg().size == 2  # the process's own, one dict for every instance


def test_a_singleton_without_a_world_is_the_senders_also_where_the_receiver_made_one() -> None:
    payload = io.BytesIO()
    codepickle.Pickler(payload).dump(Holder())  # size 2
    Borg._shared_state.clear()
    Borg(size=1)  # made here meanwhile (as unpickling accelerate's loader makes a GradientState)
    arrived = pickle.loads(payload.getvalue())
    processlocal.initialize()
    assert arrived.state.size == 2
    assert Borg().size == 2


def test_accelerates_state_reads_the_receivers_world_and_keeps_the_senders_choices() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
    payload = io.BytesIO()
    codepickle.Pickler(payload).dump(accelerator)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    arrived = pickle.loads(payload.getvalue())
    assert processlocal.initialize() == []
    assert arrived.state.num_processes == 1 and PartialState().device.type == "cpu"
    assert arrived.state.dynamo_plugin is not None  # the sender's own fields came with it
    assert arrived.gradient_state.num_steps == 3
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class NoWorldHere(Borg):
    """A world singleton whose constructor fails in this process."""

    _shared_state: ClassVar[dict[str, object]] = {}

    def __init__(self, size: int = 1) -> None:
        raise RuntimeError("no world here")


def test_a_state_that_cannot_be_built_is_left_unbuilt_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(processlocal._WORLDS, f"{__name__}:NoWorldHere", {"size": "size"})
    processlocal.attached_state(NoWorldHere, {"size": 2})
    failed = processlocal.initialize()
    assert failed == ["NoWorldHere could not be rebuilt for this process (RuntimeError: no world here)"]
    assert NoWorldHere._shared_state == {}
