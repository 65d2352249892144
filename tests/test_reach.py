"""nbtrain.messages.reach and nbtrain.kernel.lengths on real torch objects: what is held where, what was sized from a
loader."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import types

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbtrain.kernel import lengths
from nbtrain.messages import reach


class Holder:  # a class of the test module, as a trainer of a module beside the notebook is
    pass


@dataclasses.dataclass
class Pair:
    first: object
    second: object


def find_held(namespace):
    """The torch objects the ranks prepare in their places (nbtrain.rank.auto.prepare's choice)."""
    return [(h, obj) for h, obj in reach.find_reached(namespace) if h.preparable]


def test_objects_up_to_four_steps_inside_are_found_with_the_expression_that_reaches_them():
    model, other = nn.Linear(2, 1), nn.Linear(2, 1)
    trainer = Holder()
    trainer.model = model
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.parts = {"g": other, "deep": {"too": {"far": {"off": nn.Linear(1, 1)}}}}
    found = {h.label: (h.kind, obj) for h, obj in find_held({"trainer": trainer})}
    assert set(found) == {"trainer.model", "trainer.optimizer", "trainer.parts['g']"}  # five steps is too deep
    assert found["trainer.model"] == ("module", model) and found["trainer.optimizer"][0] == "optimizer"
    reached = [h.label for h, _ in reach.find_reached({"trainer": trainer})]
    assert "trainer.parts['deep']['too']['far']" in reached
    assert "trainer.parts['deep']['too']['far']['off']" not in reached


class Slotted:
    __slots__ = ("model", "steps")


def test_objects_of_any_class_whose_state_is_their_attributes_are_looked_into_slots_too():
    slotted = Slotted()
    slotted.model, slotted.steps = nn.Linear(2, 1), 0
    frozen = functools.partial(print, nn.Linear(1, 1))  # pickles its own way: not looked into
    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    found = {h.label: h.kind for h, _ in reach.find_reached({"slotted": slotted, "frozen": frozen, "loader": loader})}
    assert found == {
        "slotted.model": "module",
        "loader.dataset": "torch.utils.data.dataset.TensorDataset",  # the data set a loader reads is a place
        "loader.dataset.tensors": "builtins.tuple",
        "loader.dataset.tensors[0]": "tensor",
    }


def test_what_an_object_holds_refills_the_kernels_object_keeping_its_identity():
    slotted, box, items = Slotted(), Holder(), [1]
    slotted.model = box.kept = nn.Linear(1, 1)
    box.gone = 1
    held = {"kept": items, "new": 2}
    reach.refill(box, held)
    assert vars(box) == held and box.kept is items
    reach.refill(slotted, {"steps": 3})
    assert slotted.steps == 3 and not hasattr(slotted, "model")
    assert reach.contents(slotted) == {"steps": 3} and reach.contents(torch.zeros(1)) is None


class EncodingNet:
    """As skorch's ``NeuralNet``: its own pickling writes its module with the standard pickler into bytes."""

    def __init__(self, module):
        self.module, self.lr = module, 0.1

    def initialize(self):
        self.module_ = self.module
        return self

    def __getstate__(self):
        state = {k: v for k, v in vars(self).items() if k != "module_"}
        state["__encoded__"] = pickle.dumps({k: v for k, v in vars(self).items() if k == "module_"})
        return state

    def __setstate__(self, state):
        self.__dict__.update(pickle.loads(state.pop("__encoded__")), **state)


class EncodingInt(int):
    """An object with a C base (its number is no attribute) whose state is encoded: not looked into."""

    def __getstate__(self):
        return {"__encoded__": repr(vars(self))}


def test_an_object_whose_own_pickling_encodes_attributes_is_looked_into_and_refilled_through_them():
    module = nn.Linear(2, 1)
    net = EncodingNet(module).initialize()
    assert [h.label for h, _ in find_held({"net": net})] == ["net.module", "net.module_"]
    assert reach.contents(net) == {"module": module, "lr": 0.1, "module_": module}  # the module, not its bytes
    kernel = EncodingNet(kernel_module := nn.Linear(2, 1))  # the kernel's, never initialized
    reach.refill(kernel, {"module": kernel_module, "lr": 0.2, "module_": kernel_module})
    assert kernel.module_ is kernel.module is kernel_module and kernel.lr == 0.2
    # Going out, it pickles as its class says (the receiver's class decodes it), not as its attributes.
    assert reach.state_and_left_out(net) is None and pickle.loads(pickle.dumps(net)).module_.weight.shape == (1, 2)
    tagged = EncodingInt(3)
    tagged.model = nn.Linear(1, 1)
    assert find_held({"tagged": tagged}) == [] and reach.contents(tagged) is None


def test_a_model_is_listed_at_every_place_and_any_other_object_once():
    """Each place of a model must hold the prepared one on a rank: ``model`` and ``box.model`` alike."""
    model, shared = nn.Linear(2, 1), [1]
    box = types.SimpleNamespace(model=model, again=[model], items=shared, same=shared)
    assert [h.label for h, _ in find_held({"box": box, "model": model})] == ["box.model", "box.again[0]"]
    reached = [h.label for h, _ in reach.find_reached({"box": box, "shared": shared})]
    assert reached == ["box.model", "box.again", "box.again[0]"]  # a global, or a second place: once


def test_a_tuple_item_is_found_but_its_place_is_fixed_and_a_cycle_ends():
    pair = Pair((nn.Linear(1, 1),), None)
    pair.second = pair  # a cycle
    ((held, _),) = find_held({"pair": pair})
    assert held.label == "pair.first[0]" and held.fixed == "a tuple cannot hold another object"


def test_resolve_and_put_follow_the_steps():
    model, wrapped = nn.Linear(2, 1), nn.Sequential(nn.Linear(2, 1))
    models = {"g": [model]}
    ((held, obj),) = find_held({"models": models})
    assert obj is model and reach.resolve({"models": models}, held) is model
    reach.put({"models": models}, held, wrapped)
    assert models["g"][0] is wrapped


def _trainer_of(model, optimizer):
    """A library's factory, as ignite's create_supervised_trainer: the model lives in its step's closure."""

    def step(batch):
        optimizer.zero_grad()
        return model(batch)

    return types.SimpleNamespace(step=step)


def test_what_a_functions_closure_holds_is_a_place_and_the_function_none():
    model, wrapped = nn.Linear(2, 1), nn.Sequential(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer_of(model, optimizer)
    namespace, cell = {"trainer": trainer}, trainer.step.__code__.co_freevars.index("model")
    found = {h.label: (h, obj) for h, obj in reach.find_reached(namespace)}
    held, obj = found[f"trainer.step.__closure__[{cell}].cell_contents"]
    assert obj is model and held.preparable and held.steps == (("attr", "step"), ("cell", cell))
    assert "trainer.step" not in found  # it travels by value: what it holds is where the kernel's objects are
    assert sorted(h.kind for h, _ in find_held(namespace)) == ["module", "optimizer"]
    reach.put(namespace, held, wrapped)  # auto mode's prepared model, where the step finds it
    assert trainer.step.__closure__[cell].cell_contents is wrapped and reach.resolve(namespace, held) is wrapped


def _not_bound_yet():
    def later():
        return value

    found = reach.find_reached({"later": later})
    value = 1
    return found, value


def test_an_empty_closure_cell_holds_nothing():
    assert _not_bound_yet() == ([], 1)


def test_library_objects_and_tensors_are_not_looked_into():
    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    assert find_held({"loader": loader, "data": [torch.zeros(1)] * 3, "f": functools.partial(print)}) == []


def _loader(batches: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(batches * 8, 1)), batch_size=8, shuffle=True)


def test_a_closure_a_partial_a_default_and_onecycle_give_their_step_counts():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    def builder(num_training_steps):
        def factor(step):
            return 1 - step / num_training_steps

        return factor

    def with_default(step, num_training_steps=40):
        return 1.0

    closure = torch.optim.lr_scheduler.LambdaLR(opt, builder(20))
    assert lengths.expected_steps(closure) == 20
    partial = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(with_default, num_training_steps=30))
    assert lengths.expected_steps(partial) == 30
    assert lengths.expected_steps(torch.optim.lr_scheduler.LambdaLR(opt, with_default)) == 40
    cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=3, steps_per_epoch=10)
    assert lengths.expected_steps(cycle) == 30
    assert lengths.expected_steps(torch.optim.lr_scheduler.StepLR(opt, 5)) is None


def test_only_counts_that_are_multiples_of_a_sharded_loaders_length_are_named():
    loader = _loader(10)
    objects = {"train": loader, "num_training_steps": 30, "batch_size": 10, "warmup_steps": 7}
    expected = (
        "num_training_steps is 30 steps; each rank runs 15 (3 x len(train): 10 batches in the kernel, 5 on each "
        "rank): compute num_training_steps inside the %%distributed cell, where len(train) is each rank's"
    )
    assert lengths.derived_lengths(objects, 2, "ddp") == [expected]
    assert lengths.derived_lengths(objects, 2, "none") == []  # not sharded: nothing is left over
    assert lengths.derived_lengths(objects, 2, "ddp", {"num_training_steps"}) == []  # the cell computes it itself
