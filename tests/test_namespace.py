"""The kernel's side of a cell's namespace (nbtrain.kernel.namespace), without a kernel.

Which kernel globals a cell uses, which of them cannot travel and why, and how rank 0's
outcome is put back: the rank's side runs in this process (nbtrain.rank.cell.run_cell),
with the same pickling round trip as the engine.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import nbtrain
from helpers.procs import roundtrip
from nbtrain.errors import SerializationError
from nbtrain.kernel import namespace as ns
from nbtrain.messages import reach
from nbtrain.rank import cell as rank_cell


def notebook_cell(code: str, user_ns: dict) -> None:
    """Run ``code`` as a notebook cell would, defining its functions in ``user_ns``."""
    exec(code, user_ns)


# -- which kernel globals a cell uses ---------------------------------------------------------


def test_used_names_include_nested_scopes_but_not_locals_or_parameters():
    user_ns = {n: object() for n in ("loader", "model", "scale", "thresh", "items", "f", "x", "unused", "Base")}
    code = (
        "for x, y in loader:\n"
        "    out = model(x)\n"
        "def g(f, k=1):\n"
        "    return f + [q for q in items if q > thresh]\n"
        "sq = lambda v: v * scale\n"
        "class C(Base):\n"
        "    pass\n"
    )
    names = ns.analyse_cell(code, user_ns).names
    # x is a module-level name the cell loads (it may hold the kernel's x); f is only g's parameter
    assert names == ("Base", "items", "loader", "model", "scale", "thresh", "x")


def test_used_names_follow_notebook_functions_classes_and_closures():
    user_ns: dict = {"__name__": "__main__"}
    notebook_cell(
        "import math\n"
        "LR = 0.1\n"
        "WIDTH = 3\n"
        "def helper(v):\n"
        "    return v * LR\n"
        "def make(k):\n"
        "    def inner(v):\n"
        "        return helper(v) + k + math.pi\n"
        "    return inner\n"
        "closure = make(2)\n"
        "class Net:\n"
        "    def size(self):\n"
        "        return WIDTH\n"
        "net = Net()\n"
        "unrelated = 5\n",
        user_ns,
    )
    analysis = ns.analyse_cell("closure(1) + net.size()", user_ns)
    assert analysis.names == ("LR", "WIDTH", "closure", "helper", "math", "net")  # Net travels with net
    assert analysis.used_by["LR"] == "closure" and analysis.used_by["closure"] is None


def test_a_notebook_handler_a_library_object_holds_takes_its_globals_along():
    """An engine of a library keeps the notebook's handler deep in its attributes (ignite's
    ``engine._event_handlers[event][0][0]``): the list the handler appends to travels, to come back."""
    user_ns: dict = {"__name__": "__main__"}
    notebook_cell("seen = []\ndef on_done(engine):\n    seen.append(1)\n", user_ns)
    user_ns["engine"] = types.SimpleNamespace(handlers={"done": [(user_ns["on_done"], (), {})]})
    assert ns.analyse_cell("engine.run()", user_ns).names == ("engine", "seen")


def test_hidden_and_ipython_names_never_travel():
    user_ns = {"In": [], "_": 1, "_3": 2, "get_ipython": print, "secret": 1, "model": 1}
    analysis = ns.analyse_cell("print(In, _, _3, secret, model)", user_ns, hidden={"secret"})
    assert analysis.names == ("model",)


def test_augmented_assignments_read_the_kernels_value():
    user_ns = {"total": 0, "count": 0, "local": 0}
    code = "total += 1\ndef bump():\n    global count\n    count += 1\ndef own():\n    local = 1\n    local += 1\n"
    assert ns.analyse_cell(code, user_ns).names == ("count", "total")


def test_deleted_names_travel_so_the_cell_can_delete_them():
    assert ns.analyse_cell("del tmp", {"tmp": 1}).names == ("tmp",)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("model = DDP(model)", ("DDP",)),
        ("from torch.nn.parallel import DistributedDataParallel as W\nm = W(model)", ("DistributedDataParallel",)),
        ("s = torch.utils.data.DistributedSampler(ds)", ("DistributedSampler",)),
        ("fully_shard(model)", ("fully_shard",)),
        ("model, opt = nbtrain.prepare(model, opt)", ("nbtrain.prepare",)),
        ("for x in loader:\n    model(x)", ()),
    ],
)
def test_cells_that_distribute_themselves_are_detected(code, expected):
    user_ns = {"model": 1, "opt": 2, "loader": [], "nbtrain": nbtrain, "torch": torch, "ds": 3}
    assert ns.analyse_cell(code, user_ns).self_distributes == expected


def test_prepare_called_inside_a_notebook_function_is_detected():
    user_ns: dict = {"__name__": "__main__", "nbtrain": nbtrain}
    notebook_cell("def setup(m):\n    return nbtrain.prepare(m)\n", user_ns)
    assert ns.analyse_cell("model = setup(model)", user_ns).self_distributes == ("nbtrain.prepare",)


def test_logging_and_shell_use_and_the_shown_value_are_detected():
    user_ns = {"nbtrain": nbtrain, "log": nbtrain.log}
    assert ns.analyse_cell("nbtrain.log(loss=1)", user_ns).calls_log
    assert ns.analyse_cell("log(loss=1)", user_ns).calls_log
    assert not ns.analyse_cell("import math\nmath.log(2)", user_ns).calls_log
    assert ns.analyse_cell("get_ipython().system('ls')", {}).needs_shell
    assert ns.analyse_cell("x = 1\nx + 1", {}).display_last
    assert not ns.analyse_cell("x = 1\nx + 1", {}, raw_cell="x = 1\nx + 1;").display_last


def test_what_notebook_functions_refer_to_and_write_is_reported():
    user_ns: dict = {"__name__": "__main__", "epochs": 3}
    notebook_cell(
        "def setup():\n    global epochs\n    epochs = 5\ndef train_step(loss):\n    loss.backward()\n", user_ns
    )
    analysis = ns.analyse_cell("setup()\nfor i in range(epochs):\n    train_step(model(x))\n", user_ns)
    assert analysis.function_writes == {"epochs"}
    assert "backward" in analysis.function_names
    assert ns.analyse_cell("for i in range(epochs):\n    pass\n", user_ns).function_writes == set()


# -- what cannot travel -----------------------------------------------------------------


def test_unpicklable_variable_is_named_with_its_type_and_a_remedy():
    stream = (i for i in range(3))
    user_ns: dict = {"__name__": "__main__", "stream": stream}
    notebook_cell("def helper():\n    return next(stream)\n", user_ns)
    analysis = ns.analyse_cell("helper()", user_ns)
    error = ns.explain_unpicklable({n: user_ns[n] for n in analysis.names}, analysis.used_by)
    assert isinstance(error, SerializationError)
    message = str(error)
    assert "`stream` (a generator, used by `helper`)" in message
    assert "create it inside the cell" in message
    assert "`helper`" not in message.split("used by")[0]  # the function is not the culprit


def test_generators_and_open_files_are_named(tmp_path):
    with open(tmp_path / "f.txt", "w") as handle:
        error = ns.explain_unpicklable({"gen": (i for i in range(2)), "handle": handle, "ok": [1]}, {})
    assert "`gen` (a generator" in str(error) and "`handle` (a _io.TextIOWrapper" in str(error)
    assert "`ok`" not in str(error)
    assert ns.explain_unpicklable({"t": torch.zeros(3), "m": nn.Linear(2, 2)}, {}) is None


# -- coming back: run_cell in this process, then apply to a "kernel" namespace ------------


_travel = roundtrip  # the engine's round trip between the kernel and a rank


def _run_here(kernel_ns: dict, code: str, **spec_options):
    """Run ``code`` the way a rank would (one process, no process group) and apply the result."""
    analysis = ns.analyse_cell(code, kernel_ns)
    shipped = {n: kernel_ns[n] for n in analysis.names}
    held = reach.find_reached(shipped)  # as the kernel's cellrun does
    spec = rank_cell.CellSpec(
        code=code,
        filename="<cell>",
        names=analysis.names,
        display_last=analysis.display_last,
        held=tuple(h for h, _ in held),
        **spec_options,
    )
    namespace, anchor = _travel((shipped, ns.anchor_function(kernel_ns)))
    result = rank_cell.run_cell(spec, namespace, anchor)
    targets = {**shipped, **{h.label: obj for h, obj in held}}
    outcome = ns.decode_result(_travel(result), targets, kernel_ns)
    report = ns.apply_result(outcome, targets, kernel_ns, result.deleted)
    return outcome, report, result


def test_namespace_out_updates_kernel_objects_in_place():
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()  # the kernel's dtype stays, whatever the rank sends
    kernel_ns: dict = {
        "__name__": "__main__",
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "history": [],
        "tmp": 1,
        "torch": torch,
    }
    history, opt, before = kernel_ns["history"], kernel_ns["opt"], model.weight.detach().clone()
    code = (
        "x = torch.ones(4, 3, dtype=torch.float64)\n"
        "loss = model(x).pow(2).mean()\n"
        "opt.zero_grad(); loss.backward(); opt.step()\n"
        "history.append(round(loss.item(), 6))\n"
        "model.eval()\n"
        "del tmp\n"
        "def twice(v):\n"
        "    return 2 * v + len(history)\n"
        "alias = model\n"
        "len(history)\n"
    )
    outcome, report, _ = _run_here(kernel_ns, code)
    assert kernel_ns["model"] is model and kernel_ns["opt"] is opt and kernel_ns["history"] is history
    assert model.weight.dtype == torch.float64 and not torch.equal(model.weight, before)
    assert not model.training
    assert len(history) == 1 and "momentum_buffer" in opt.state[model.weight]
    assert "tmp" not in kernel_ns and report.deleted == ["tmp"]
    assert kernel_ns["alias"] is model  # a reference to a kernel object comes back as that object
    assert kernel_ns["twice"].__globals__ is kernel_ns and kernel_ns["twice"](1) == 3
    assert outcome["display"] == (1,)
    assert {"model", "opt", "history", "x", "loss", "twice", "alias"} <= set(report.updated)


class ModuleTrainer:  # a class of a module (this one), as a project's train_utils.Trainer is
    def __init__(self, config, model):
        self.config, self.model, self.optimizer, self.steps, self.history = config, model, None, 0, []
        self.scale = torch.ones(1)

    def run(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.lr, momentum=0.9)
        for _ in range(2):
            loss = self.model(torch.ones(4, 3)).pow(2).mean()
            self.optimizer.zero_grad(); loss.backward(); self.optimizer.step()
            self.steps += 1
            self.history.append(loss.item())
            self.scale.mul_(2)


class Slotted:
    __slots__ = ("count", "items")


def test_an_object_of_a_modules_class_comes_back_as_the_kernels_own_holding_the_kernels_own():
    """What one process leaves: the same trainer, holding the same model, config, list and tensor,
    changed as running the cell here changes them (a twin run here is the reference)."""
    torch.manual_seed(0)
    model, config = nn.Linear(3, 1), types.SimpleNamespace(lr=0.1)
    trainer = ModuleTrainer(config, model)
    twin = copy.deepcopy(trainer)
    twin.run()
    history, scale = trainer.history, trainer.scale
    kernel_ns: dict = {"__name__": "__main__", "trainer": trainer}
    _, report, _ = _run_here(kernel_ns, "trainer.run()\n")
    assert kernel_ns["trainer"] is trainer and trainer.model is model and trainer.config is config
    assert trainer.history is history and trainer.scale is scale and scale.tolist() == [4.0]
    assert trainer.steps == 2 and history == twin.history and torch.equal(model.weight, twin.model.weight)
    assert all(p in trainer.optimizer.state for p in model.parameters())  # keyed by the live parameters
    momentum = trainer.optimizer.state[model.weight]["momentum_buffer"]
    assert torch.equal(momentum, twin.optimizer.state[twin.model.weight]["momentum_buffer"])
    assert {"trainer.model", "trainer"} <= set(report.updated)


def test_a_list_shared_by_two_objects_and_a_new_one_stays_one_list_and_slots_are_refilled():
    shared = [1]
    a, b, slotted = types.SimpleNamespace(items=shared), types.SimpleNamespace(items=shared), Slotted()
    slotted.items, slotted.count = shared, 0
    kernel_ns: dict = {"__name__": "__main__", "a": a, "b": b, "slotted": slotted}
    _run_here(kernel_ns, "a.items.append(2)\nslotted.count += 1\nc = [b.items, slotted]\n")
    assert a.items is b.items is slotted.items is shared and shared == [1, 2]
    assert slotted.count == 1 and kernel_ns["c"][0] is shared and kernel_ns["c"][1] is slotted


def test_a_models_own_attributes_and_its_layers_come_back_into_the_kernels_model():
    model = nn.Sequential(nn.Linear(3, 1))
    model.epoch, model.log, model[0].calls = 0, [], 0
    log, layer = model.log, model[0]
    kernel_ns: dict = {"__name__": "__main__", "model": model}
    _, report, _ = _run_here(kernel_ns, "model.epoch = 5\nmodel.log.append(1)\nmodel[0].calls += 1\nmodel.new = [2]\n")
    assert model.epoch == 5 and model.log is log and log == [1] and model.new == [2]
    assert model[0] is layer and layer.calls == 1
    assert {"model", "model.log", "model.0"} <= set(report.updated)


def test_unchanged_plain_objects_are_left_alone_and_unpicklable_values_skipped():
    config = {"lr": 0.1, "nested": [1, 2]}
    kernel_ns: dict = {"__name__": "__main__", "config": config}
    nested = config["nested"]
    outcome, _, result = _run_here(kernel_ns, "lr = config['lr']\nguard = (i for i in range(3))\n")
    assert kernel_ns["config"] is config and config["nested"] is nested  # not even copied
    assert "config" not in outcome["changed"]
    assert kernel_ns["lr"] == 0.1
    assert [(name, kind) for name, kind, _ in result.skipped] == [("guard", "generator")]
    assert "guard" not in kernel_ns


def test_module_whose_architecture_changed_is_rebound():
    model = nn.Sequential(nn.Linear(2, 2))
    kernel_ns: dict = {"__name__": "__main__", "model": model, "nn": nn}
    _run_here(kernel_ns, "model[0] = nn.Linear(2, 5)\n")
    assert kernel_ns["model"] is not model and kernel_ns["model"][0].out_features == 5


def test_update_in_place_keeps_identity_where_it_can():
    values, table, found = [1], {"a": 1}, {1}
    assert ns.update_in_place(values, [1, 2]) and values == [1, 2]
    assert ns.update_in_place(table, {"b": 2}) and table == {"b": 2}
    assert ns.update_in_place(found, {3}) and found == {3}
    assert not ns.update_in_place((1,), (2,))
    assert not ns.update_in_place([1], (1,))


# -- more of what a cell uses --------------------------------------------------------------


def test_a_global_declared_in_a_function_and_augmented_is_read_from_the_kernel():
    user_ns = {"total": 0, "step": 1, "local_total": 5}
    code = "def bump():\n    global total\n    total += step\n    local_total = 0\n    local_total += 1\nbump()\n"
    assert ns.analyse_cell(code, user_ns).names == ("step", "total")  # local_total is the function's own


def test_names_the_kernel_does_not_have_and_ipython_history_do_not_travel():
    user_ns = {"_i2": "x", "_5": 1, "__": 2, "Out": {}, "x": 1}
    analysis = ns.analyse_cell("print(x, y, _i2, _5, __, Out)", user_ns)
    assert analysis.names == ("x",) and analysis.used_by == {"x": None}


def test_a_function_using_a_global_is_named_as_its_user_even_two_calls_deep():
    user_ns: dict = {"__name__": "__main__", "table": {}}
    notebook_cell("def low():\n    return table\ndef high():\n    return low()\n", user_ns)
    analysis = ns.analyse_cell("high()", user_ns)
    assert analysis.names == ("high", "low", "table")
    assert analysis.used_by == {"high": None, "low": "high", "table": "high"}  # named after what the cell calls


def test_methods_properties_and_static_methods_of_notebook_classes_are_followed():
    user_ns: dict = {"__name__": "__main__", "SCALE": 2, "OFFSET": 1, "LIMIT": 3}
    notebook_cell(
        "class Net:\n"
        "    @property\n"
        "    def scale(self):\n"
        "        return SCALE\n"
        "    @staticmethod\n"
        "    def offset():\n"
        "        return OFFSET\n"
        "    @classmethod\n"
        "    def limit(cls):\n"
        "        return LIMIT\n"
        "net = Net()\n",
        user_ns,
    )
    user_ns["Net"].__module__ = "__main__"
    assert ns.analyse_cell("net", user_ns).names == ("LIMIT", "OFFSET", "SCALE", "net")  # the class travels with net


def test_what_a_function_writes_is_reported_for_global_and_delete():
    user_ns: dict = {"__name__": "__main__", "best": 0, "cache": 1}
    notebook_cell("def track(v):\n    global best, cache\n    best = max(best, v)\n    del cache\n", user_ns)
    analysis = ns.analyse_cell("track(3)", user_ns)
    assert analysis.function_writes == frozenset({"best", "cache"})
    assert {"max", "best"} <= analysis.function_names


@pytest.mark.parametrize(
    ("raw_cell", "shown"),
    [("x", True), ("x;", False), ("x = 1", False), ("f(x)  \n\n", True), ("x; ", False), ("", False)],
)
def test_the_last_value_is_shown_unless_the_cell_ends_with_a_semicolon(raw_cell, shown):
    assert ns.analyse_cell(raw_cell or "pass", {"x": 1, "f": abs}, raw_cell=raw_cell).display_last is shown


def test_the_analysis_is_a_frozen_record():
    analysis = ns.analyse_cell("x", {"x": 1})
    with pytest.raises(AttributeError):
        analysis.names = ()  # type: ignore[misc]  # frozen: what the test checks


# -- what cannot travel, and files ------------------------------------------------------------


def test_a_variable_that_travels_gives_no_error():
    assert ns.explain_unpicklable({"values": [1, 2], "fn": lambda v: v, "scale": 0.5}, {}) is None


def test_a_function_is_named_only_when_it_is_the_culprit_itself():
    stream = (i for i in range(3))
    error = ns.explain_unpicklable({"fn": lambda: next(stream)}, {})  # no variable to blame: the function
    assert error is not None and str(error).startswith("cannot send `fn` (a function) to the ranks: ")


def test_an_open_file_is_refused_naming_it_and_its_user(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("x")
    with open(path) as handle, pytest.raises(SerializationError) as caught:
        ns.refuse_open_files({"ok": [1], "handle": handle}, {"handle": "load"})
    message = str(caught.value)
    assert message.startswith(
        "cannot send `handle` (a _io.TextIOWrapper, used by `load`) to the ranks: it is an open file"
    )
    assert "create it inside the cell" in message
    ns.refuse_open_files({"buffer": __import__("io").BytesIO(b"x")}, {})  # in memory: fine


def test_the_anchor_function_shares_the_kernels_globals():
    kernel_ns: dict = {"x": 1}
    anchor = ns.anchor_function(kernel_ns)
    assert anchor.__globals__ is kernel_ns and anchor() is None


# -- coming back ---------------------------------------------------------------------------


def test_update_in_place_for_bytearrays_arrays_and_objects_that_cannot_be_refilled():
    import numpy as np

    data, array = bytearray(b"ab"), np.zeros(3)
    assert ns.update_in_place(data, bytearray(b"xyz")) and data == b"xyz"
    assert ns.update_in_place(array, np.ones(3)) and array.tolist() == [1.0, 1.0, 1.0]
    assert not ns.update_in_place(np.zeros(3), np.ones(4))  # another shape: rebound instead

    class Slotted:
        __slots__ = ("v",)

    class Stateful:
        def __setstate__(self, state):
            pass

    assert not ns.update_in_place(Slotted(), Slotted())
    assert not ns.update_in_place(Stateful(), Stateful())


def test_apply_result_rebinds_what_cannot_be_updated_and_lets_a_rebinding_win():
    history, frozen = [1], (1,)
    kernel_ns: dict = {"history": history, "frozen": frozen, "gone": 1}
    outcome = {"changed": {"history": [1, 2], "frozen": (1, 2)}, "bound": {"history": "rebound", "new": 3}}
    report = ns.apply_result(outcome, dict(kernel_ns), kernel_ns, deleted=["gone", "never_there"])
    assert history == [1, 2]  # the old object was updated in place ...
    assert kernel_ns["history"] == "rebound"  # ... but the name the cell rebound holds the new value
    assert kernel_ns["frozen"] == (1, 2) and kernel_ns["new"] == 3 and "gone" not in kernel_ns
    assert report.updated == ["history", "frozen", "new"] and report.deleted == ["gone"]


def test_tensors_are_copied_into_the_kernels_tensor_when_shape_and_dtype_match():
    same, other = torch.zeros(2), torch.zeros(2)
    kernel_ns: dict = {"same": same, "other": other}
    outcome = {"tensors": {"same": torch.ones(2), "other": torch.ones(3)}}
    ns.apply_result(outcome, dict(kernel_ns), kernel_ns)
    assert kernel_ns["same"] is same and same.tolist() == [1.0, 1.0]
    assert kernel_ns["other"] is not other and kernel_ns["other"].shape == (3,)


def test_a_module_state_that_cannot_be_loaded_is_skipped_and_said_why():
    model = nn.Linear(2, 2)
    kernel_ns: dict = {"model": model}
    outcome = {"modules": {"model": ({"weight": torch.ones(2, 2)}, [("", True)])}}  # no bias
    report = ns.apply_result(outcome, dict(kernel_ns), kernel_ns)
    assert report.updated == [] and [(n, t) for n, t, _ in report.skipped] == [
        ("model", "torch.nn.modules.linear.Linear")
    ]
    assert report.skipped[0][2].startswith("its weights could not be loaded (")


def test_module_differs_compares_keys_values_and_train_modes():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [("", True), ("0", True), ("1", True)]
    assert not ns.module_differs(model, state, modes)
    assert ns.module_differs(model, state, [("1", False)])
    assert ns.module_differs(model, {"0.weight": state["0.weight"]}, modes)
    assert ns.module_differs(model, {**state, "0.bias": state["0.bias"] + 1}, modes)
    assert not ns.module_differs(model, {**state, "0.bias": state["0.bias"].double()}, modes)  # same values


def test_load_module_state_keeps_the_kernels_tensors_devices_and_dtypes():
    model = nn.Linear(2, 1).double()
    weight = model.weight
    ns.load_module_state(model, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, [("", False)])
    assert model.weight is weight and weight.dtype == torch.float64 and weight.tolist() == [[1.0, 1.0]]
    assert not model.training


def test_decoding_a_result_leaves_the_kernels_builtins_as_they_were():
    kernel_ns: dict = {"__name__": "__main__", "__builtins__": "ipython's", "k": 2}
    _run_here(kernel_ns, "def times(v):\n    return v * k\n")
    assert kernel_ns["__builtins__"] == "ipython's"
    assert kernel_ns["times"](3) == 6 and kernel_ns["times"].__globals__ is kernel_ns


# -- a parameter's own state beyond its values, in a real kernel -------------------------------

PARAMETER_SETUP = """
import torch, torch.nn as nn
torch.set_num_threads(1)
def fresh():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    return net, torch.optim.SGD(net.parameters(), lr=0.1)
X = torch.arange(32.0).reshape(8, 4) / 32
Y = X.sum(1, keepdim=True)
"""

# One step on the whole batch (bias of the first layer frozen at the end, last layer's grads dropped).
PARAMETER_CELL = """
torch.set_num_threads(1)
loss = (model(X) - Y).pow(2).mean()
opt.zero_grad(); loss.backward(); opt.step()
model[0].bias.requires_grad_(False)
model[2].weight.grad = None
"""


@pytest.fixture(scope="module")
def parameter_kernel():
    from kernel_helpers import nbtrain_kernel

    yield from nbtrain_kernel(PARAMETER_SETUP)


GRADS = "[None if p.grad is None else p.grad.tolist() for p in {0}.parameters()]"
FLAGS = "[p.requires_grad for p in {0}.parameters()]"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("magic", ["--devices 1", "--devices 1 --no-auto", "--devices 2 --no-auto"])
def test_gradients_and_requires_grad_the_cell_leaves_come_back_into_the_kernels_parameters(parameter_kernel, magic):
    """What one process leaves (the cell run in the kernel is the reference): each parameter's
    ``.grad`` as the loop left it (None where the cell dropped it) and its ``requires_grad``, on
    the kernel's own parameters. ``--no-auto`` on 2 ranks: each rank runs the whole batch, rank 0's come back."""
    kernel = parameter_kernel
    fresh = "ref = model\nmodel, opt = fresh()\nparams = list(model.parameters())"
    kernel.run_ok("model, opt = fresh()\n" + PARAMETER_CELL + fresh)
    kernel.run_ok(f"%%distributed {magic} --accelerator cpu\n{PARAMETER_CELL}")
    assert kernel.value("all(a is b for a, b in zip(params, model.parameters()))")
    assert kernel.value(FLAGS.format("model")) == kernel.value(FLAGS.format("ref")) == [True, False, True, True]
    grads = kernel.value(GRADS.format("model"))
    assert grads == kernel.value(GRADS.format("ref")) and grads[2] is None and grads[0] is not None


@pytest.mark.timeout(300)
def test_two_ranks_leave_the_averaged_gradients_on_the_kernels_parameters(parameter_kernel):
    """Auto mode on 2 ranks: the gradient each parameter keeps is the average of the ranks' (the
    union batch's), as one process on the whole batch leaves it; the flags as the cell set them."""
    kernel = parameter_kernel
    kernel.run_ok("model, opt = fresh()\n" + PARAMETER_CELL + "ref = model\nmodel, opt = fresh()")
    loader_cell = PARAMETER_CELL.replace(
        "loss = (model(X) - Y).pow(2).mean()",
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "for x, y in DataLoader(TensorDataset(X, Y), batch_size=4):\n    loss = (model(x) - y).pow(2).mean()",
    )
    kernel.run_ok(f"%%distributed --devices 2 --accelerator cpu\n{loader_cell}")
    assert kernel.value(FLAGS.format("model")) == [True, False, True, True]
    close = (
        "all((a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6))"
        " for a, b in zip({0}, {1}))"
    )
    grads = "[p.grad for p in {0}.parameters()]"
    assert kernel.value(close.format(grads.format("model"), grads.format("ref")))
    assert kernel.value("model[2].weight.grad is None and model[0].weight.grad is not None")


# Gradient accumulation across cells: a backward in the kernel, then a cell that adds one and steps.
ACCUMULATE_BEFORE = "torch.set_num_threads(1)\n{0}, {1} = fresh()\n(({0}(X) - Y).pow(2).mean() / 2).backward()\n"
ACCUMULATE_CELL = """
torch.set_num_threads(1)
from torch.utils.data import DataLoader, TensorDataset
for x, y in DataLoader(TensorDataset(X, Y), batch_size={0}):
    ((model(x) - y).pow(2).mean() / 2).backward()
opt.step()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("magic", ["--devices 1", "--devices 2"])
def test_gradients_in_the_kernel_before_the_cell_go_into_the_ranks(parameter_kernel, magic):
    """A backward in the kernel, then a cell that adds another and steps (gradient accumulation
    over cells): one process steps with the sum, so the ranks start from the kernel's gradients
    (on 2 ranks DDP averages the sum of the kernel's and each rank's, which is the kernel's plus
    the union batch's). The weights and gradients are one process's."""
    kernel = parameter_kernel
    kernel.run_ok(ACCUMULATE_BEFORE.format("ref", "ref_opt") + ACCUMULATE_CELL.format(8).replace("model", "ref")
                  .replace("opt.step", "ref_opt.step"))
    kernel.run_ok(ACCUMULATE_BEFORE.format("model", "opt"))
    batch = 4 if magic == "--devices 2" else 8  # per rank: the two ranks' batches are the reference's one
    kernel.run_ok(f"%%distributed {magic} --accelerator cpu\n" + ACCUMULATE_CELL.format(batch))
    close = "[torch.allclose(a, b, atol=1e-6) for a, b in zip({0}, {1})]"
    assert kernel.value(close.format("model.parameters()", "ref.parameters()")) == [True] * 4
    grads = "[p.grad for p in {0}.parameters()]"
    assert kernel.value(close.format(grads.format("model"), grads.format("ref"))) == [True] * 4


MADE_CELL = """
torch.set_num_threads(1)
made, _ = fresh()
held = {"first": made[0]}
made_opt = torch.optim.SGD(made.parameters(), lr=0.1)
made_opt.zero_grad(); (made(X) - Y).pow(2).mean().backward(); made_opt.step()
made[0].bias.requires_grad_(False)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("magic", ["--devices 1", "--devices 2 --no-auto"])
def test_a_model_made_in_the_cell_comes_back_with_its_gradients(parameter_kernel, magic):
    """A model the cell makes travels whole: its parameters keep the gradients the loop left on them
    (pickling a parameter drops ``.grad``) and their ``requires_grad``, bit for bit as in one process."""
    kernel = parameter_kernel
    kernel.run_ok(MADE_CELL + "made_ref = made")
    kernel.run_ok(f"%%distributed {magic} --accelerator cpu\n{MADE_CELL}")
    assert kernel.value(FLAGS.format("made")) == kernel.value(FLAGS.format("made_ref"))
    grads = kernel.value(GRADS.format("made"))
    assert grads == kernel.value(GRADS.format("made_ref")) and grads[0] is not None
    assert kernel.value("held['first'] is made[0] and made_opt.param_groups[0]['params'][0] is made[0].weight")
