"""Nothing half-loaded (issue 54): each object a cell changed comes back whole, or is left as it was and named.

Frozen and slotted objects are restored in place where they can be (their identity kept), rebuilt
when the cell made them, and rebound whole where only that fits. An object that cannot be loaded
(it cannot be rebuilt in the kernel, or its holder cannot take a new one) keeps its kernel value,
and the cell's warning names it, says why and what to do; the cell's other objects still load.
Real kernels, 2 CPU ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbtrain.kernel import namespace as ns

pytestmark = pytest.mark.timeout(300)

MAGIC = "%%distributed --devices 2 --accelerator cpu\n"

# The classes a notebook defines; each test makes its objects anew (OBJECTS), so none sees another's.
CLASSES = """
import collections, dataclasses, os

@dataclasses.dataclass(frozen=True)
class Config:
    lr: float
    tags: list

@dataclasses.dataclass(frozen=True, slots=True)
class Dispatch:  # as plum's Dispatcher, which fastai's objects hold
    warn_redefinition: bool
    table: dict

@dataclasses.dataclass(frozen=True)
class Run:
    log: collections.deque

class Trainer:
    def __init__(self):
        self.config, self.dispatch, self.steps = Config(0.1, []), Dispatch(False, {}), 0

class Slotted:
    __slots__ = ("count", "items")
    def __init__(self):
        self.count, self.items = 0, []

class Locked:  # refuses every attribute, as a frozen class with slots does
    __slots__ = ("value",)
    def __init__(self):
        object.__setattr__(self, "value", 1)
    def __setattr__(self, key, value):
        raise AttributeError(f"cannot assign to field {key!r}")

class ReadOnly:  # refuses every attribute; its state is its __dict__
    def __init__(self):
        object.__setattr__(self, "value", 1)
    def __setattr__(self, key, value):
        raise AttributeError(f"{key} is read-only")

class Fragile:  # rebuilt nowhere but where it was made, as an object holding a device handle
    def __init__(self):
        self.pid = os.getpid()
    def __setstate__(self, state):
        raise RuntimeError("it holds a handle of the process that made it")

Point = collections.namedtuple("Point", "x history")
"""

OBJECTS = """
trainer, cfg, run, slotted, guard = Trainer(), Config(0.1, []), Run(collections.deque()), Slotted(), ReadOnly()
point, pair, history, settings = Point(0, []), (collections.deque([1]), 2), [], Config(0.1, [])
kept = {n: globals()[n] for n in ("trainer", "cfg", "run", "slotted", "guard", "point", "pair", "history")}
kept.update(config=trainer.config, dispatch=trainer.dispatch, items=slotted.items, tags=cfg.tags)
"""


@pytest.fixture(scope="module")
def kernel():
    from kernel_helpers import nbtrain_kernel

    yield from nbtrain_kernel(CLASSES)


def _not_loaded(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "not brought back" in line]
    assert len(lines) <= 1, stderr
    return lines[0] if lines else ""


def test_frozen_slotted_and_tuple_objects_come_back_in_place_or_rebound_whole(kernel):
    kernel.run_ok(OBJECTS)
    out = kernel.run_ok(
        MAGIC + "trainer.config = dataclasses.replace(trainer.config, lr=0.5)\n"  # a frozen one, rebound inside
        "trainer.dispatch.table['f'] = 1\n"  # a frozen one with slots, changed inside
        "cfg.tags.append('x')\n"  # a frozen one holding a list the cell appended to
        "run.log.append(1)\n"  # a frozen one holding what travels whole
        "slotted.count += 1; slotted.items.append(1)\n"
        "object.__setattr__(guard, 'value', 2)\n"  # one whose __setattr__ refuses
        "point.history.append(2)\n"
        "settings = dataclasses.replace(settings, lr=0.3)\n"  # a frozen one rebound to a new one
        "made, locked = Dispatch(True, {'g': 2}), Locked()\n"  # made in the cell: rebuilt in the kernel
    )
    assert _not_loaded(out.stderr) == "", out.text
    same = "all(globals()[n] is kept[n] for n in ('trainer', 'cfg', 'run', 'slotted', 'guard', 'point'))"
    assert kernel.value(same + " and trainer.dispatch is kept['dispatch'] and cfg.tags is kept['tags']")
    assert kernel.value("[trainer.config.lr, trainer.config is not kept['config'], trainer.dispatch.table]") == [
        0.5,
        True,
        {"f": 1},
    ]
    assert kernel.value("[cfg.tags, list(run.log), slotted.count, slotted.items is kept['items']]") == [
        ["x"],
        [1],
        1,
        True,
    ]
    assert kernel.value(
        "[settings.lr, guard.value, point.history, made.warn_redefinition, made.table, locked.value]"
    ) == [
        0.3,
        2,
        [2],
        True,
        {"g": 2},
        1,
    ]


def test_an_object_that_cannot_be_loaded_is_left_whole_and_named_while_the_others_load(kernel):
    kernel.run_ok(OBJECTS)
    out = kernel.run_ok(
        MAGIC + "history.append(1)\n"
        "trainer.steps += 1\n"
        "trainer.extra = Fragile()\n"  # the trainer now holds what the kernel cannot rebuild
        "fragile = Fragile()\n"
        "pair[0].append(2)\n"  # a deque in a tuple: not in place, and the tuple takes no new one
        "fine = [1]\n"
    )
    warning = _not_loaded(out.stderr)
    assert "so they keep their old values there" in warning, out.text
    assert (
        "trainer (Trainer: `trainer.extra` (a Fragile) could not be rebuilt in the kernel "
        "(RuntimeError: it holds a handle of the process that made it), so none of `trainer` was loaded; "
        "make that object in the kernel from what it is made of"
    ) in warning
    assert "fragile (Fragile: it could not be rebuilt in the kernel (RuntimeError:" in warning
    assert "none of `fragile` was loaded" in warning
    assert (
        "pair[0] (collections.deque: it cannot be changed in place, and `pair` cannot hold a new one "
        "(TypeError: 'tuple' object does not support item assignment); rebind `pair` in the cell"
    ) in warning
    # The others loaded; the trainer is as it was, not half: its steps did not move without its extra.
    assert kernel.value("[history, fine, trainer.steps, hasattr(trainer, 'extra'), 'fragile' in globals()]") == [
        [1],
        [1],
        0,
        False,
        False,
    ]
    assert kernel.value("trainer is kept['trainer'] and list(pair[0])") == [1]


# -- without a kernel: what the kernel's loading does with objects it is handed -------------------


class _Locking(nn.Module):
    """A model whose ``locked`` attribute refuses a new value, after ``first`` took one."""

    @property
    def locked(self) -> int:
        return 0

    @locked.setter
    def locked(self, value: int) -> None:
        raise AttributeError("locked is read-only")


def test_an_object_that_refuses_part_of_its_refill_keeps_all_it_held():
    model = _Locking()
    model.first, model.log = 1, [0]
    log = model.log
    outcome = {"contents": {"model": {"first": 2, "log": log, "locked": 3}}}
    report = ns.apply_result(outcome, {"model": model}, {"model": model})
    assert model.first == 1 and model.log is log  # as it was: not first=2 with the rest refused
    assert report.updated == [] and [(n, t) for n, t, _ in report.skipped] == [("model", "test_halfloaded._Locking")]
    assert report.skipped[0][2].startswith("it could not be refilled in place (AttributeError: locked is read-only)")


def test_a_model_whose_weights_do_not_fit_keeps_all_of_its_own():
    model = nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    outcome = {"modules": {"model": ({"weight": torch.ones(2, 2)}, [("", True)])}}  # no bias: torch copies the weight
    report = ns.apply_result(outcome, {"model": model}, {"model": model})
    assert torch.equal(model.weight, weight) and report.updated == []
    assert "bias differ from the kernel's model in name or shape" in report.skipped[0][2]
