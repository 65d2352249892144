"""cloudpickle as nbtrain sends code and optimizers to the ranks (nbtrain.messages.codepickle).

A function defined in a notebook cell is exec'd with the cell's file name, as IPython does;
the pickle is loaded in another Python process, as a rank loads it, so its traceback there
is the one the rank would print. Optimizers are real torch optimizers, stepped after the trip.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import types

import torch

from nbtrain.messages import codepickle

CELL_FILE = "/tmp/ipykernel_4242/1234567.py"  # what IPython names a cell's code
SUBPROCESS_SECONDS = 60
LOAD_AND_CALL = """
import pickle, sys, traceback
function = pickle.load(sys.stdin.buffer)
try:
    function(0)
except ZeroDivisionError as error:
    last = traceback.extract_tb(error.__traceback__)[-1]
    print(last.filename, last.lineno, last.name)
"""


def _cell_function():
    namespace: dict = {}
    exec(compile("def ratio(x):\n    return 1 / x\n", CELL_FILE, "exec"), namespace)
    return namespace["ratio"]


def test_a_cells_function_keeps_its_file_name_through_the_pickle():
    ratio = _cell_function()
    loaded = pickle.loads(codepickle.dumps_keeping_filenames(ratio))
    assert loaded is not ratio and loaded.__code__.co_filename == CELL_FILE and loaded(4) == 0.25


def test_another_process_names_the_cells_file_in_its_traceback():
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_CALL],
        input=codepickle.dumps_keeping_filenames(_cell_function()),
        capture_output=True,
        timeout=SUBPROCESS_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split() == [CELL_FILE, "2", "ratio"]


class _Warmed(torch.optim.SGD):
    """An optimizer that keeps its own settings beside what Optimizer.__getstate__ returns."""

    def __init__(self, params, lr: float, warmup: int) -> None:
        super().__init__(params, lr=lr)
        self.warmup = warmup
        self.schedule = {"steps": [1, 2], "scale": 0.5}
        self.callback = lambda: None  # not plain data: not sent


def test_an_optimizers_own_plain_attributes_travel_and_others_do_not():
    model = torch.nn.Linear(2, 1)
    optimizer = _Warmed(model.parameters(), lr=0.1, warmup=5)
    assert set(codepickle.own_attributes(optimizer)) == {"warmup", "schedule"}
    _, loaded = pickle.loads(codepickle.dumps_keeping_filenames((model, optimizer)))
    assert loaded.warmup == 5 and loaded.schedule == {"steps": [1, 2], "scale": 0.5}
    assert not hasattr(loaded, "callback")
    assert pickle.loads(pickle.dumps(optimizer)).__dict__.get("warmup") is None  # plain pickle loses it


def test_lbfgs_steps_after_the_trip_with_its_params_the_very_list_of_its_group():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1)
    loaded_model, loaded = pickle.loads(codepickle.dumps_keeping_filenames((model, optimizer)))
    assert loaded._params is loaded.param_groups[0]["params"]
    x, y = torch.ones(4, 3), torch.zeros(4, 1)

    def closure():
        loaded.zero_grad()
        loss = torch.nn.functional.mse_loss(loaded_model(x), y)
        loss.backward()
        return loss

    before = closure().item()
    loaded.step(closure)
    assert closure().item() < before


def test_an_optimizer_another_wraps_is_left_out_when_asked():
    inner = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    outer = _Warmed(torch.nn.Linear(1, 1).parameters(), lr=0.1, warmup=1)
    outer.inner = inner
    assert "inner" in codepickle.own_attributes(outer)
    assert "inner" not in codepickle.own_attributes(outer, optimizers=False)
    assert codepickle.optimizer_reduce(model := torch.nn.Linear(1, 1)) is None and model is not None


class _Fitted:
    """What fastcore's Stateful does for Learner.export: its history and its lock left out of its pickle."""

    def __init__(self):
        self.lock, self.losses, self.lr = threading.Lock(), [], 0.1

    def __getstate__(self):
        return {"lr": self.lr}

    def __setstate__(self, state):
        self.__dict__.update(state, lock=threading.Lock(), losses=[], made_again=True)


def test_code_a_classs_own_pickling_leaves_out_stays_the_receivers():
    """An LR scheduler sets a wrapped ``step`` on its optimizer, which torch's pickling leaves out: sent
    along, it would pass by the receiver's step hooks (a graceful stop would see no step)."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, 1)
    assert "step" in vars(optimizer)
    loaded = pickle.loads(codepickle.dumps_keeping_filenames(optimizer))
    assert "step" not in vars(loaded) and loaded.param_groups[0]["lr"] == 0.1


def test_what_a_classs_own_pickling_leaves_out_travels_where_it_can():
    fitted = _Fitted()
    fitted.losses.append(0.5)
    fitted.me = [fitted]
    loaded = pickle.loads(codepickle.dumps_keeping_filenames(fitted))
    assert loaded.losses == [0.5] and loaded.lr == 0.1 and loaded.me[0] is loaded  # the history, and itself
    assert loaded.made_again and loaded.lock is not fitted.lock  # its __setstate__ ran: a lock of its own
    assert codepickle.own_state_reduce(types.SimpleNamespace(a=1)) is None  # all its attributes travel anyway
