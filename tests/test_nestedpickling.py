"""A standard pickle made inside ours (skorch's __getstate__, torch.save) sends notebook code by value."""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch

from nbtrain.messages import codepickle, nestedpickling


def _round_trip(obj: object) -> object:
    return pickle.loads(codepickle.dumps_keeping_filenames(obj))


def test_a_standard_pickle_inside_ours_sends_a_function_by_value_only_meanwhile():
    def triple(x: int) -> int:
        return 3 * x

    class Nested:
        def __reduce__(self) -> tuple[object, ...]:
            return pickle.loads, (pickle.dumps(triple),)

    assert _round_trip(Nested())(2) == 6
    assert pickle.dumps is nestedpickling._ORIGINAL_DUMPS
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(triple)


def test_a_torch_save_inside_ours_sends_a_module_class_by_value_with_its_lock():
    class Local(torch.nn.Module):  # only findable by value, as a notebook's class on a rank
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.lock = threading.Lock()

    class SavesItsModule:  # skorch's way: its state is a torch.save of its module
        def __init__(self, module: torch.nn.Module) -> None:
            self.module = module

        def __getstate__(self) -> dict[str, bytes]:
            buffer = io.BytesIO()
            torch.save(self.module, buffer)
            return {"saved": buffer.getvalue()}

        def __setstate__(self, state: dict[str, bytes]) -> None:
            self.module = torch.load(io.BytesIO(state["saved"]), weights_only=False)

    sent = SavesItsModule(Local())
    copy = _round_trip(sent)
    assert type(copy.module).__name__ == "Local" and torch.equal(copy.module.layer.weight, sent.module.layer.weight)
    assert pickle.Pickler is nestedpickling._pickler_class().__base__


def test_the_originals_are_back_after_a_pickle_that_failed():
    class Refuses:
        def __reduce__(self) -> tuple[object, ...]:
            raise pickle.PicklingError("no")

    with pytest.raises(pickle.PicklingError):
        codepickle.dumps_keeping_filenames(Refuses())
    assert pickle.dumps is nestedpickling._ORIGINAL_DUMPS and nestedpickling._Installed.running == 0
