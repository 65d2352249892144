"""Notebook code for the processes a rank starts (nbtrain.rank.machinery.childpickling).

The rule itself runs here, in this process and in a real spawned pool; the DataLoader workers and
process pools of a cell run on 2 real CPU ranks in a real kernel, under forkserver (Python 3.14's
default; a spawned pool too). Each worker that loads a Dataset imports torch (~2 s here): the
cells start as few as make the point.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import sys
from multiprocessing.reduction import ForkingPickler

import pytest

from kernel_helpers import nbtrain_kernel
from nbtrain import patches
from nbtrain.rank.machinery import childpickling

pytestmark = pytest.mark.timeout(300)

# What a rank holds of the notebook: classes and functions whose module is "__main__", not found there.
NOTEBOOK = """
import dataclasses

@dataclasses.dataclass(frozen=True)
class Point:
    x: int

def double(x):
    return Point(2 * x)
"""


@pytest.fixture
def notebook() -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(NOTEBOOK, namespace)  # code as a notebook cell defines it
    return namespace


@pytest.fixture
def installed():
    with contextlib.ExitStack() as stack:
        patches.install(childpickling.GROUP, stack)
        yield
    assert "reducer_override" not in vars(ForkingPickler)  # undone


def test_without_the_group_multiprocessing_cannot_pickle_notebook_code(notebook):
    with pytest.raises(pickle.PicklingError, match="Can't pickle <class '__main__.Point'>"):
        ForkingPickler.dumps(notebook["Point"])


def test_notebook_code_travels_by_value_and_everything_else_as_before(notebook, installed):
    point, double = notebook["Point"], notebook["double"]
    assert pickle.loads(ForkingPickler.dumps(point)) is point  # cloudpickle tracks the class: the same one
    assert pickle.loads(ForkingPickler.dumps(double))(4) == point(8)
    assert pickle.loads(ForkingPickler.dumps(lambda x: x + 1))(1) == 2  # a lambda has no name to find
    for importable in (len, pickle.Pickler, childpickling.reduce_by_value, [1, "a", {"b": (2.0, None)}]):
        assert bytes(ForkingPickler.dumps(importable)) == pickle.dumps(importable)


def test_an_override_already_there_is_asked_for_what_ours_leaves(notebook):
    def theirs(pickler, obj):
        return (str, ("theirs",)) if obj == {"mine": 1} else NotImplemented

    chained = childpickling.by_value_reducer(theirs)
    assert chained(None, {"mine": 1}) == (str, ("theirs",))
    assert chained(None, notebook["double"])[0] is childpickling.load_by_value
    assert chained(None, [1]) is NotImplemented


def test_a_spawned_pool_runs_notebook_code_and_sends_a_notebook_class_back(notebook, installed):
    # The child loads double by value and installs the group as it does, so the Point it returns
    # travels back by value too, as this process's own Point.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        points = pool.map(notebook["double"], [1, 2])
    assert points == [notebook["Point"](2), notebook["Point"](4)]
    assert all(type(point) is notebook["Point"] for point in points)


def test_loading_by_value_outside_a_child_of_multiprocessing_installs_nothing(notebook, installed):
    sent = ForkingPickler.dumps(notebook["double"])
    pickle.loads(sent)  # a test's process: the group would outlive the fixture's undo
    assert childpickling.GROUP not in patches._for_the_process


SETUP = """
import dataclasses, multiprocessing, concurrent.futures, torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

@dataclasses.dataclass
class Batch:
    values: list

class Squares(Dataset):
    offset = 0
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return i * i + self.offset

def to_batch(items):
    return Batch([int(item) for item in items])

def offset_by_one(worker_id):
    get_worker_info().dataset.offset = 1  # the worker's own copy: seen in what it loads

def cube(x):
    return x ** 3
"""

# On every rank: what each pass over the loader gives, and whether each batch is the notebook's Batch.
PASSES = """%%distributed --devices 2 --accelerator cpu
loader = DataLoader(Squares(), batch_size=3, num_workers=2, collate_fn=to_batch, worker_init_fn=offset_by_one,
                    multiprocessing_context={context!r}, persistent_workers={persistent})
passes = [[batch.values for batch in loader] for _ in range({passes})]
batches_are_batch = all(isinstance(batch, Batch) for batch in loader)
"""
EXPECTED = [[1, 2, 5], [10, 17, 26], [37, 50]]  # squares of 0..7, plus the worker's offset


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


def test_a_loaders_forkserver_workers_get_the_notebooks_dataset_collate_and_init_functions(kernel):
    """Two passes over persistent workers: the workers started once, with the notebook's code."""
    out = kernel.run_ok(PASSES.format(context="forkserver", persistent=True, passes=2))
    assert kernel.value("passes") == [EXPECTED, EXPECTED], out.text
    assert kernel.value("batches_are_batch") is True


def test_process_pools_of_a_cell_map_a_notebook_function(kernel):
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "forkserver = multiprocessing.get_context('forkserver')\n"
        "with concurrent.futures.ProcessPoolExecutor(1, mp_context=forkserver) as pool:\n"
        "    cubes = list(pool.map(cube, range(4)))\n"
        "with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "    cubes += pool.map(cube, [4])\n"
    )
    assert kernel.value("cubes") == [0, 1, 8, 27, 64], out.text


def test_a_loader_naming_no_start_method_gets_the_pythons_default(kernel):
    """A loader as most notebooks write it, naming no start method: on Python 3.14 its workers start by
    forkserver, multiprocessing's default there (by fork before 3.14), and get the notebook's code either way.
    .ci/pythons runs this on 3.14 as well as 3.11 and 3.12: it tests forkserver only there."""
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "loader = DataLoader(Squares(), batch_size=3, num_workers=2, collate_fn=to_batch,\n"
        "                    worker_init_fn=offset_by_one)\n"
        "default_pass = [batch.values for batch in loader]\n"
        "default_method = multiprocessing.get_start_method()\n"
    )
    assert kernel.value("default_method") == ("forkserver" if sys.version_info >= (3, 14) else "fork"), out.text
    assert kernel.value("default_pass") == EXPECTED, out.text
